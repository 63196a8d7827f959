"""Sampler transforms against an independent numpy reimplementation, on random logits."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kt_cli.engine.sampling_params import SamplingParams
from kt_cli.errors import KtError
from kt_cli.layers.sampler import Sampler, apply_penalties, filtered_probs

VOCAB = 64


@dataclass
class Row:
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def np_filtered_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature, then keep the top_k largest logits, then the smallest set of most likely
    tokens whose mass reaches top_p, then tokens with prob >= min_p * max prob."""
    probs = np_softmax(logits.astype(np.float64) / p.temperature)
    keep = np.ones(len(probs), dtype=bool)
    if p.top_k > 0:
        keep &= probs >= np.sort(probs)[::-1][p.top_k - 1]
    probs = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
    if p.top_p < 1:
        mass_above = np.array([probs[probs > q].sum() for q in probs])
        keep &= mass_above < p.top_p
    probs = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
    keep &= probs >= p.min_p * probs.max()
    probs = np.where(keep, probs, 0)
    return probs / probs.sum()


def np_penalised(logits: np.ndarray, token_ids: list[int], n_prompt: int, p: SamplingParams) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for t in set(token_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(token_ids[n_prompt:]):
        count = token_ids[n_prompt:].count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty
    return out


FILTERS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.5, min_p=0.1),
    SamplingParams(temperature=1.1, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=2.0, top_k=1),
]


def test_filters_match_numpy_in_one_mixed_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(FILTERS), VOCAB, generator=g) * 3
    got = filtered_probs(logits, FILTERS).numpy()
    for row, params in enumerate(FILTERS):
        want = np_filtered_probs(logits[row].numpy(), params)
        np.testing.assert_allclose(got[row], want, atol=1e-6)
        assert (got[row] > 0).sum() == (want > 0).sum()


@pytest.mark.parametrize("scale", [8.0, 0.5])   # peaked: 1024 candidates suffice; flat: all needed
def test_filters_on_a_large_vocabulary_match_numpy(scale):
    params = [SamplingParams(top_p=0.9), SamplingParams(min_p=0.2), SamplingParams(top_p=0.95, min_p=0.01),
              SamplingParams(temperature=0.6, top_k=3000, top_p=0.99)]
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(len(params), 5000, generator=g) * scale
    got = filtered_probs(logits, params).numpy()
    for row, p in enumerate(params):
        want = np_filtered_probs(logits[row].numpy(), p)
        np.testing.assert_allclose(got[row], want, atol=1e-6)
        assert (got[row] > 0).sum() == (want > 0).sum()


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8),
    SamplingParams(presence_penalty=0.7),
    SamplingParams(frequency_penalty=-0.5),
    SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.4),
])
def test_penalties_match_numpy(params):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, VOCAB, generator=g) * 3
    history = torch.randint(0, VOCAB, (2, 30), generator=g).tolist()
    rows = [Row(params, history[0], 10), Row(SamplingParams(), history[1], 10)]
    got = apply_penalties(logits, rows)
    want = np_penalised(logits[0].numpy(), history[0], 10, params)
    np.testing.assert_allclose(got[0].numpy(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], logits[1])


def test_greedy_takes_the_argmax_after_penalties():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler()(logits, [Row(params, [3], 1)]) == [1]
    assert Sampler()(logits, [Row(params, [1], 1)]) == [2]


def test_argmax_only_for_greedy_rows_without_penalties():
    """The rows whose tokens the model's own argmax may give (ModelRunner skips the sampler)"""
    row = lambda **kw: Row(SamplingParams(**kw), [1, 2], 1)
    assert Sampler.argmax_only([row(temperature=0.0), row(temperature=0.0, top_k=5)])
    assert not Sampler.argmax_only([])
    assert not Sampler.argmax_only([row(temperature=0.0), row(temperature=0.7)])
    for penalty in (dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(frequency_penalty=0.5)):
        assert not Sampler.argmax_only([row(temperature=0.0, **penalty)])


def test_draws_follow_the_filtered_distribution():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 8, generator=g) * 2
    params = SamplingParams(temperature=0.9, top_p=0.85)
    row = Row(params, [0], 1, torch.Generator().manual_seed(7))
    sampler = Sampler()
    counts = np.bincount([sampler(logits, [row])[0] for _ in range(4000)], minlength=8)
    want = np_filtered_probs(logits[0].numpy(), params)
    assert counts[want == 0].sum() == 0
    # 4000 draws: each frequency is within 5 standard deviations of its probability
    sigma = np.sqrt(want * (1 - want) / 4000)
    assert np.all(np.abs(counts / 4000 - want) <= 5 * sigma + 1e-9)


def test_seeded_rows_reproduce_whatever_the_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=g)
    params = SamplingParams(temperature=1.0, seed=42)

    def draws(batch_rows: int) -> list[int]:
        row = Row(params, [0], 1, torch.Generator().manual_seed(42))
        others = [Row(SamplingParams(), [0], 1) for _ in range(batch_rows - 1)]
        return [Sampler()(logits[:batch_rows], [row, *others])[0] for _ in range(20)]

    assert draws(1) == draws(3)
    assert len(set(draws(1))) > 1


@pytest.mark.parametrize("bad", [
    dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2),
    dict(max_tokens=0), dict(repetition_penalty=0), dict(presence_penalty=3), dict(seed="x"),
    dict(stop=[""]), dict(stop=[3]), dict(stop_token_ids=[-1]), dict(temperature=float("nan")),
])
def test_invalid_params_are_one_line_errors(bad):
    with pytest.raises(KtError) as err:
        SamplingParams(**bad)
    assert "\n" not in str(err.value) and str(err.value).startswith("invalid sampling parameter")


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="###").stop == ("###",)
