"""A tiny MoE model loaded under KT_NUMA=interleave (workers pinned, every MoE layer's
expert tensors interleaved over the nodes, here node 0) gives the same logits, bit
for bit, as under KT_NUMA=off: placement moves pages, never values."""

import pytest
import torch

from kt_cli import ops
from kt_cli.models.registry import ModelOptions, build_model
from kt_cli.ops import numa
from kt_weights.checkpoint import open_checkpoint
from tiny_models import PagedDriver, build_tiny

REAL_INTERLEAVE = numa.interleave


@pytest.fixture
def fresh_default_pool():
    ops.default.cache_clear()       # KT_NUMA is read when the default pool is created
    yield
    ops.default.cache_clear()


def logits_under(mode: str, checkpoint, monkeypatch) -> tuple[list[torch.Tensor], list[int]]:
    monkeypatch.setenv(numa.ENV, mode)
    ops.default.cache_clear()
    placed = []

    def counting(kernels, tensors, plan):
        placed.append(REAL_INTERLEAVE(kernels, tensors, plan))
        return placed[-1]
    monkeypatch.setattr(numa, "interleave", counting)
    driver = PagedDriver(build_model(open_checkpoint(checkpoint), ModelOptions()))
    g = torch.Generator().manual_seed(0)
    out = list(driver.step({"a": torch.randint(0, 256, (9,), generator=g).tolist()}).values())
    for _ in range(4):
        out += driver.step({"a": torch.randint(0, 256, (1,), generator=g).tolist()}).values()
    return out, placed


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v2_lite"])
def test_interleaved_experts_give_bit_identical_logits(kind, tmp_path, monkeypatch, fresh_default_pool):
    checkpoint = build_tiny(kind, tmp_path / kind)
    plain, placed_off = logits_under("off", checkpoint, monkeypatch)
    interleaved, placed_on = logits_under("interleave", checkpoint, monkeypatch)
    assert ops.pool().numa.nodes and placed_off and all(n == 0 for n in placed_off)
    assert len(placed_on) == len(placed_off) and all(n >= 1 for n in placed_on), placed_on   # every MoE layer
    for got, want in zip(interleaved, plain, strict=True):
        assert torch.equal(got, want)
