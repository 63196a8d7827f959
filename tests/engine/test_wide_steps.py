"""ModelRunner's wide steps: torch gets prefill_threads threads for steps of
WIDE_STEP_TOKENS tokens or more, and kt's idle workers sleep at once while torch
runs more than one thread; everything is restored after the step, also on errors."""

from types import SimpleNamespace

import pytest
import torch

from kt_cli import ops
from kt_cli.engine.model_runner import WIDE_STEP_TOKENS, ModelRunner
from kt_cli.ops.pool import Pool


@pytest.fixture
def spins(monkeypatch) -> list[int]:
    calls = []
    monkeypatch.setattr(Pool, "set_spin", lambda self, rounds: calls.append(rounds))
    ops.pool()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield calls
    torch.set_num_threads(before)


def step(prefill_threads, n_tokens):
    return ModelRunner._torch_threads(SimpleNamespace(prefill_threads=prefill_threads), n_tokens)


def test_wide_step_gives_torch_the_threads_and_puts_kt_workers_to_sleep(spins):
    with step(2, WIDE_STEP_TOKENS):
        assert torch.get_num_threads() == 2 and spins == [0]
    assert torch.get_num_threads() == 1 and spins == [0, -1]


@pytest.mark.parametrize("prefill_threads, n_tokens", [(2, WIDE_STEP_TOKENS - 1), (1, 512), (None, 512)])
def test_other_steps_change_nothing(spins, prefill_threads, n_tokens):
    with step(prefill_threads, n_tokens):
        assert torch.get_num_threads() == 1 and spins == []
    assert torch.get_num_threads() == 1 and spins == []


def test_an_error_inside_restores_both(spins):
    with pytest.raises(RuntimeError):
        with step(2, 512):
            raise RuntimeError("model failed")
    assert torch.get_num_threads() == 1 and spins == [0, -1]


def test_kt_workers_sleep_when_torch_already_runs_the_threads(spins):
    torch.set_num_threads(2)
    with step(2, 512):
        assert torch.get_num_threads() == 2 and spins == [0]
    assert torch.get_num_threads() == 2 and spins == [0, -1]
