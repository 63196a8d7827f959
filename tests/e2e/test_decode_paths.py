"""Attention reads the cache through a view when a sequence's blocks are consecutive
and gathers its slots otherwise: both give the same logits, bit for bit, through
prefill, batched decode and a chunk after decode."""

import pytest
import torch

from kt_cli.models.registry import ModelOptions, build_model
from kt_weights.checkpoint import open_checkpoint
from tiny_models import PagedDriver, build_tiny


def steps(driver: PagedDriver) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()
    out = list(driver.step({"a": tokens(7), "b": tokens(5)}).values())
    for _ in range(6):
        out += driver.step({"a": tokens(1), "b": tokens(1)}).values()
    out += driver.step({"a": tokens(3)}).values()
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "deepseek_v2_lite"])
def test_consecutive_and_scattered_blocks_agree(kind, tmp_path):
    model = build_model(open_checkpoint(build_tiny(kind, tmp_path / kind)), ModelOptions())
    scattered = PagedDriver(model)
    consecutive = PagedDriver(model)
    consecutive.free = list(range(consecutive.num_blocks))[::-1]      # pop() hands out 0, 1, 2, ...
    for got, want in zip(steps(consecutive), steps(scattered), strict=True):
        assert torch.equal(got, want)
    assert consecutive.tables["a"][:2] == [0, 1] and consecutive.tables["a"][2] != 2   # ranges, then a gather
