"""The end of a decode step in one native call (kt.h kt_decode_head_f32): the final
RMSNorm, the lm_head and, for greedy rows, each row's argmax.

Through the modules and the sampler these were an RMSNorm, a Linear and a torch argmax
with its .tolist(): ~0.3 ms a step on a 2-core machine (scaled Qwen3-MoE, vocab 49152),
most of it interpreter work on caches the lm_head's weights had just flushed. The head
runs the kernels those modules call (kt_rmsnorm_f32 up to norm.NATIVE_MAX_ROWS rows,
then kt_linear with the lm_head's own activations), so its logits are the same bits;
wider batches (prefill with every row's logits) take the modules."""

import torch

from .. import ops
from ..ops.ffi_args import OpError, check_status
from .decode_plan import DecodeWorkspace
from .linear import Linear, dense_acts
from .norm import NATIVE_MAX_ROWS, RMSNorm


def head_for(norm, lm_head, workspace: DecodeWorkspace) -> "DecodeHead | None":
    """A native head for this final norm and lm_head on the CPU in float32, or None; its
    scratch is the decode plans' workspace (the head runs after the last layer)."""
    if not (isinstance(norm, RMSNorm) and norm.f32_weight and norm.weight.device.type == "cpu"
            and norm.weight.dim() == 1):
        return None
    if not (isinstance(lm_head, Linear) and lm_head.kernel is not None and lm_head.bias is None
            and lm_head.cols == norm.weight.numel()):
        return None
    return DecodeHead(norm, lm_head, workspace)


class DecodeHead:
    def __init__(self, norm: RMSNorm, lm_head: Linear, workspace: DecodeWorkspace):
        self.norm, self.lm_head, self.ws = norm, lm_head, workspace
        self.pool = ops.pool()
        self.ffi, self.lib = self.pool.kernels.ffi, self.pool.kernels.lib
        self.hidden, self.vocab = lm_head.cols, lm_head.rows
        d = self.ffi.new("kt_decode_head *")
        d.hidden, d.eps = self.hidden, norm.eps
        d.norm = self.ffi.cast("const float *", norm.weight.data_ptr())
        d.lm_head = lm_head.kernel.desc
        self.desc = d
        if self.lib.kt_decode_head_scratch_floats(d, 1) < 0:
            raise OpError("decode head: the native head refused this norm and lm_head")

    def applies(self, h: torch.Tensor) -> bool:
        """Whether h's rows take this head: RMSNorm.forward runs the same native norm for them"""
        return (h.dim() == 2 and 0 < h.shape[0] <= NATIVE_MAX_ROWS and h.shape[1] == self.hidden
                and h.dtype == torch.float32 and h.device.type == "cpu")

    def __call__(self, h: torch.Tensor, argmax: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [n, hidden] (applies(h)) -> (logits [n, vocab] float32, their argmax [n] int64 or None)"""
        h = h.contiguous()
        n = h.shape[0]
        scratch = self.ws.scratch_for(n * self.hidden)
        logits = torch.empty(n, self.vocab, dtype=torch.float32)
        tokens = torch.empty(n, dtype=torch.int64) if argmax else None
        lm = self.lm_head
        self.desc.acts = lm.kernel.kinds[dense_acts(n, lm.decode_acts, lm.prefill_acts, lm.int16_until)]
        cast = self.ffi.cast
        rc = self.lib.kt_decode_head_f32(
            self.pool.handle, self.desc, cast("const float *", h.data_ptr()), n,
            cast("float *", logits.data_ptr()), cast("int64_t *", tokens.data_ptr()) if argmax else self.ffi.NULL,
            cast("float *", scratch.data_ptr()), scratch.numel())
        check_status(rc, "kt_decode_head_f32")
        return logits, tokens
