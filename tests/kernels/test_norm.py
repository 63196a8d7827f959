"""kt_rmsnorm_f32 (ops.rms_norm) on each variant against RMSNorm computed in float64.

Bound: 2e-6 relative per element (float32 products after an inverse RMS computed
from a double-accumulated mean: about 2 roundings of 6e-8 each, measured <= 1.8e-7)."""

import pytest
import torch

from kt_cli.errors import KtError

BOUND = 2e-6


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64, w64 = x.double(), w.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(1, 1), (1, 576), (3, 2048), (2, 7), (64, 130)])
def test_rows_match_float64(ops, shape):
    x, w = 50 * _randn(*shape, seed=1), _randn(shape[-1], seed=2)
    got = ops.rms_norm(x, w, 1e-6)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), _reference(x, w, 1e-6), rtol=BOUND, atol=1e-30)


def test_per_head_weights(ops):
    x, w = _randn(2, 36, 128, seed=3), _randn(36, 128, seed=4)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5).double(), _reference(x, w, 1e-5), rtol=BOUND, atol=1e-30)


def test_zero_row_gives_zero(ops):
    x = torch.zeros(1, 64)
    assert ops.rms_norm(x, torch.ones(64), 1e-6).eq(0).all()


@pytest.mark.parametrize("x, w, eps, message", [
    (torch.ones(2, 8), torch.ones(7), 1e-6, "does not fit"),
    (torch.ones(2, 3, 8), torch.ones(2, 8), 1e-6, "does not fit"),
    (torch.ones(2, 8, dtype=torch.float64), torch.ones(8), 1e-6, "float32"),
    (torch.ones(8, 2).t(), torch.ones(8), 1e-6, "contiguous"),
    (torch.ones(0, 8), torch.ones(8), 1e-6, "non-empty"),
    (torch.ones(2, 8), torch.ones(8), -1.0, "eps"),
])
def test_bad_inputs_are_refused(ops, x, w, eps, message):
    with pytest.raises(KtError, match=message):
        ops.rms_norm(x, w, eps)
