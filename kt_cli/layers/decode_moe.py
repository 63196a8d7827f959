"""The MoE half of a decode step in one native call (kt.h kt_decode_moe_f32): post-norm,
router logits, softmax top-k routing with the expert counts, the routed experts and the
residual, the same kernels in the same order as MoEBlock.forward on the CPU.

From Python each of those steps cost 50-110 us per layer and decode step on a 2-core
machine, most of it in data the experts' weights had just evicted from the caches. The
plan covers blocks whose experts all run on the CPU with softmax top-k routing and no
shared expert (Qwen3-MoE, Mixtral); MoEBlock.native_decode_ok() is asked on every call,
since expert placement can change between steps, and the module path runs otherwise."""

import time

import torch

from .. import ops
from ..ops.ffi_args import OpError, check_status
from .moe import MoEBlock
from .norm import RMSNorm
from .router import SoftmaxTopK


def moe_plan_for(block, post_norm) -> "MoEDecodePlan | None":
    """A plan for this MoE block (post_norm: the layer's norm before it) on the CPU, or None."""
    if not (isinstance(block, MoEBlock) and isinstance(block.router, SoftmaxTopK) and block.router_counts
            and block.shared is None):
        return None
    if not (isinstance(post_norm, RMSNorm) and post_norm.f32_weight and post_norm.weight.device.type == "cpu"):
        return None
    if block.router.logits.kernel is None:
        return None
    return MoEDecodePlan(block, post_norm)


class MoEDecodePlan:
    def __init__(self, block: MoEBlock, post_norm: RMSNorm):
        self.block = block
        self.pool = ops.pool()
        self.ffi, self.lib = self.pool.kernels.ffi, self.pool.kernels.lib
        self.desc = self._describe(block, post_norm)
        self.scratch_floats = {}

    def _describe(self, block: MoEBlock, post_norm: RMSNorm):
        router, ffi = block.router, self.ffi
        d = ffi.new("kt_decode_moe *")
        d.hidden, d.n_experts = block.cpu.shape.hidden, block.num_experts
        d.top_k, d.normalize = router.top_k, int(router.normalize)
        d.post_norm, d.post_eps = ffi.cast("const float *", post_norm.weight.data_ptr()), post_norm.eps
        d.router = router.logits.kernel.desc
        d.moe = block.cpu.native_handle()
        d.counts = ffi.cast("int64_t *", block.usage.routed.data_ptr())
        self.keep = (post_norm.weight, router.logits, block.cpu, block.usage.routed)   # what d points into
        if self.lib.kt_decode_moe_scratch_floats(d, 1) < 0:
            raise OpError("decode plan: the native MoE half refused this block's sizes")
        return d

    def applies(self) -> bool:
        return self.block.native_decode_ok()

    def __call__(self, h: torch.Tensor, scratch_for) -> None:
        """h [n, hidden] contiguous float32 on the cpu (checked by the caller), in place:
        h += block(post_norm(h)). scratch_for(floats) -> a float32 tensor that large."""
        n = h.shape[0]
        floats = self.scratch_floats.get(n) or self.scratch_floats.setdefault(
            n, self.lib.kt_decode_moe_scratch_floats(self.desc, n))
        scratch = scratch_for(floats)
        self.block.cpu.native_handle()          # waits out a pending asynchronous call, if any
        start = time.perf_counter()
        rc = self.lib.kt_decode_moe_f32(self.pool.handle, self.desc, self.ffi.cast("float *", h.data_ptr()), n,
                                        self.ffi.cast("float *", scratch.data_ptr()), scratch.numel())
        seconds = time.perf_counter() - start
        check_status(rc, "kt_decode_moe_f32")
        self.block.account_native(n, seconds)
