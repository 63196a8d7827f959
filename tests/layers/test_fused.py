"""FusedLinear and the QMatrix row concatenation behind it: rows stacked in every
stored format dequantize to torch.cat of the parts, and one fused kernel call
returns exactly (bit for bit) what the separate Linear layers return."""

import pytest
import torch

from kt_cli.errors import ModelError
from kt_cli.layers.fused import FusedLinear, can_concat_rows, concat_rows
from kt_cli.layers.linear import Linear, Target
from kt_weights.layout import Format, QMatrix, quantize_reference

CPU = Target(torch.device("cpu"), torch.float32)
ROWS = (64, 16, 16)      # q, k, v of a 4-head / 1-kv-head layer with head_dim 16
COLS = 128


def matrix(rows: int, fmt: Format, seed: int, symmetric: bool = True, group: int = 32) -> QMatrix:
    w = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(seed))
    if fmt.quantized:
        return quantize_reference(w, fmt, group, symmetric)
    dtype = {Format.F32: torch.float32, Format.BF16: torch.bfloat16, Format.F16: torch.float16}[fmt]
    return QMatrix(fmt, rows, COLS, w.to(dtype).contiguous())


FORMATS = [(Format.I4, True), (Format.I4, False), (Format.I8, True), (Format.I8, False),
           (Format.F32, True), (Format.BF16, True), (Format.F16, True)]


@pytest.mark.parametrize("fmt,symmetric", FORMATS)
def test_concat_rows_dequantizes_to_the_concatenation(fmt, symmetric):
    parts = [matrix(r, fmt, seed, symmetric) for seed, r in enumerate(ROWS)]
    fused = concat_rows(parts)
    assert (fused.format, fused.rows, fused.cols, fused.group) == (fmt, sum(ROWS), COLS, parts[0].group)
    assert torch.equal(fused.dequantize(), torch.cat([m.dequantize() for m in parts]))


@pytest.mark.parametrize("other", [
    matrix(16, Format.I8, 1),                       # format
    matrix(16, Format.I4, 1, group=64),             # group
    matrix(16, Format.I4, 1, symmetric=False),      # min present
])
def test_matrices_that_differ_are_not_concatenated(other):
    first = matrix(64, Format.I4, 0)
    assert not can_concat_rows([first, other])
    with pytest.raises(ModelError, match="cannot concatenate"):
        concat_rows([first, other])


def separate_outputs(weights, biases, x):
    return [Linear(w, b, CPU)(x) for w, b in zip(weights, biases)]


@pytest.mark.parametrize("tokens", [1, 5, 70])     # 70: the GEMM path of prefill
@pytest.mark.parametrize("fmt,symmetric", [(Format.I4, True), (Format.I4, False), (Format.I8, True),
                                            (Format.F32, True)])
def test_fused_linear_equals_separate_linears(fmt, symmetric, tokens):
    weights = [matrix(r, fmt, seed, symmetric) for seed, r in enumerate(ROWS)]
    biases = [torch.randn(ROWS[0]), None, torch.randn(ROWS[2])]
    x = torch.randn(tokens, COLS, generator=torch.Generator().manual_seed(7))
    fused = FusedLinear(weights, biases, CPU)
    assert fused.fused
    outputs = fused(x)
    for got, want in zip(outputs, separate_outputs(weights, biases, x), strict=True):
        assert got.shape == want.shape
        assert torch.equal(got, want)


def test_unfusable_parts_run_separately():
    weights = [matrix(64, Format.I4, 0), matrix(16, Format.I8, 1)]
    x = torch.randn(3, COLS)
    fused = FusedLinear(weights, [None, None], CPU)
    assert not fused.fused
    for got, want in zip(fused(x), separate_outputs(weights, [None, None], x), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("formats", [(Format.I4, Format.I4, Format.I4), (Format.I4, Format.I8, Format.I4)])
def test_joined_output_is_the_parts_side_by_side(formats):
    weights = [matrix(r, fmt, seed) for seed, (r, fmt) in enumerate(zip(ROWS, formats))]
    x = torch.randn(2, COLS)
    fused = FusedLinear(weights, [None] * 3, CPU)
    assert torch.equal(fused.forward_joined(x), torch.cat(separate_outputs(weights, [None] * 3, x), dim=-1))
