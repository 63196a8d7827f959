"""kt_decode_head_f32 (kt_cli.layers.decode_head, the end of a decode step) on each variant:
the final norm and the lm_head against a float64 reference, the same bits as the kernels it
chains (kt_rmsnorm_f32, kt_linear) called one by one, and each row's argmax as torch.argmax
takes it: the first of equal largest logits, a NaN counting as the largest. Inconsistent
descriptors, short scratch and empty batches are refused."""

import pytest
import torch

from kt_cli.ops.ffi_args import kt_matrix, pointer
from kt_cli.ops.linear import decode_layout
from kt_weights.layout import Format, QMatrix

HIDDEN, VOCAB, EPS = 256, 200, 1e-5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


class Head:
    """One kt_decode_head over norm weight [hidden] and lm_head w, on ops' pool"""

    def __init__(self, ops, norm: torch.Tensor, w: QMatrix, acts: str):
        self.ops, self.norm, self.w = ops, norm, w
        self.ffi, self.lib = ops.pool.kernels.ffi, ops.pool.kernels.lib
        d = self.ffi.new("kt_decode_head *")
        d.hidden, d.eps, d.norm = w.cols, EPS, pointer(self.ffi, norm, "const float *")
        d.lm_head = kt_matrix(self.ffi, w)
        d.acts = {"int8": self.lib.KT_ACTS_INT8, "int16": self.lib.KT_ACTS_INT16, "f32": self.lib.KT_ACTS_F32}[acts]
        self.desc = d

    def scratch_floats(self, n: int) -> int:
        return self.lib.kt_decode_head_scratch_floats(self.desc, n)

    def run(self, h: torch.Tensor, argmax: bool = True, scratch_floats: int | None = None):
        n = h.shape[0]
        logits = torch.full((max(n, 1), self.w.rows), -7.0)
        tokens = torch.full((max(n, 1),), -1, dtype=torch.int64)
        floats = self.scratch_floats(max(n, 1)) if scratch_floats is None else scratch_floats
        scratch = torch.empty(max(floats, 1))
        rc = self.lib.kt_decode_head_f32(
            self.ops.pool.handle, self.desc, pointer(self.ffi, h, "const float *"), n,
            pointer(self.ffi, logits, "float *"), pointer(self.ffi, tokens, "int64_t *") if argmax else self.ffi.NULL,
            pointer(self.ffi, scratch, "float *"), floats)
        return rc, logits, tokens


def _q4_lm_head(ops, seed: int) -> QMatrix:
    g = _gen(seed)
    w = torch.randn(VOCAB, HIDDEN, generator=g) * 0.05
    return decode_layout(ops.quantize(w, Format.I4, 32), ops.pool)


def _reference(h: torch.Tensor, norm: torch.Tensor, w: QMatrix) -> torch.Tensor:
    x = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + EPS) * norm.double()
    return x @ w.dequantize().double().T


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("acts", ["int8", "int16"])
def test_logits_and_argmax_of_a_quantized_head(ops, n, acts):
    w = _q4_lm_head(ops, seed=n)
    norm = 1.0 + 0.1 * torch.randn(HIDDEN, generator=_gen(1))
    h = 3.0 * torch.randn(n, HIDDEN, generator=_gen(2))
    head = Head(ops, norm, w, acts)
    rc, logits, tokens = head.run(h)
    assert rc == 0
    want = _reference(h, norm, w)
    bound = 0.05 if acts == "int8" else 2e-3    # int8 activations round x to 1/254 of a block's largest
    assert (logits.double() - want).abs().max() <= bound * want.abs().max()
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))
    x = ops.rms_norm(h, norm, EPS)
    assert torch.equal(logits, ops.linear(x, w, acts))       # the chained kernels' own bits


def test_equal_largest_logits_pick_the_first_and_a_nan_wins(ops):
    g = _gen(3)
    rows = torch.randn(VOCAB, HIDDEN, generator=g)
    rows[150] = rows[40]            # equal logits at 40 and 150 for every x
    w = QMatrix(Format.F32, VOCAB, HIDDEN, rows.contiguous())
    norm = torch.ones(HIDDEN)
    x = rows[40].clone()            # its own row gives row 40 (and 150) the largest dot
    h = torch.stack([x, x, torch.randn(HIDDEN, generator=g)])
    head = Head(ops, norm, w, "f32")
    rc, logits, tokens = head.run(h)
    assert rc == 0 and tokens[0] == 40 and torch.equal(tokens, torch.argmax(logits, dim=-1))
    rows[70, 5] = float("nan")      # row 70's logit is NaN for every x: torch.argmax takes it
    rows[120, 9] = float("nan")
    w_nan = QMatrix(Format.F32, VOCAB, HIDDEN, rows.contiguous())
    rc, logits, tokens = Head(ops, norm, w_nan, "f32").run(h)
    assert rc == 0 and tokens.tolist() == [70, 70, 70]
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))


def test_logits_without_argmax(ops):
    w = _q4_lm_head(ops, seed=9)
    norm = torch.ones(HIDDEN)
    h = torch.randn(2, HIDDEN, generator=_gen(4))
    rc, logits, tokens = Head(ops, norm, w, "int8").run(h, argmax=False)
    assert rc == 0 and torch.equal(tokens, torch.full((2,), -1, dtype=torch.int64))
    assert torch.equal(logits, ops.linear(ops.rms_norm(h, norm, EPS), w, "int8"))


def test_bad_calls_are_refused(ops):
    w = _q4_lm_head(ops, seed=5)
    norm = torch.ones(HIDDEN)
    h = torch.randn(2, HIDDEN, generator=_gen(6))
    head = Head(ops, norm, w, "int8")
    einval = ops.pool.kernels.lib.KT_EINVAL
    assert head.scratch_floats(2) == 2 * HIDDEN and head.scratch_floats(0) == -1
    assert head.run(h, scratch_floats=2 * HIDDEN - 1)[0] == einval
    assert head.run(h[:0])[0] == einval
    head.desc.hidden = HIDDEN + 64          # the lm_head has HIDDEN columns
    assert head.scratch_floats(1) == -1 and head.run(h)[0] == einval
    head.desc.hidden, head.desc.norm = HIDDEN, head.ffi.NULL
    assert head.run(h)[0] == einval
    head.desc.norm, head.desc.acts = pointer(head.ffi, norm, "const float *"), 99
    assert head.run(h)[0] == einval
