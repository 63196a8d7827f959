"""A decode step through every layer of a model in one native call (kt.h
kt_decode_stack_f32): for each layer its DecodePlan's kt_decode_layer_f32, then its
MoEDecodePlan's kt_decode_moe_f32 when it has one, the same calls as the per-layer path.

Driving the layers one by one from Python cost ~45 us a layer and step in checks, casts
and allocations on a 2-core machine (SmolLM2, 30 layers: 13.8 -> 12.4 ms a token). A
stack is built when every layer has a plan whose MLP is native (dense, or a MoE block
kt_decode_moe covers); applies() is asked every step, since expert placement can send a
block back to the modules, and the per-layer path runs then."""

import torch

from ..ops.ffi_args import OpError, check_status
from .attention import AttentionContext
from .decode_plan import DecodePlan, DecodeWorkspace, check_hidden
from .linear import dense_acts


def stack_for(plans: list, workspace: DecodeWorkspace) -> "DecodeStack | None":
    if not plans or any(p is None or not (p.dense or p.moe is not None) for p in plans):
        return None
    if len({(p.hidden, p.head_dim) for p in plans}) != 1:
        return None
    return DecodeStack(plans, workspace)


class DecodeStack:
    def __init__(self, plans: list[DecodePlan], workspace: DecodeWorkspace):
        self.plans, self.ws = plans, workspace
        first = plans[0]
        self.pool, self.ffi, self.lib = first.pool, first.ffi, first.lib
        self.hidden, self.head_dim = first.hidden, first.head_dim
        self.moe = [(i, p.moe) for i, p in enumerate(plans) if p.moe is not None]
        self.layers = self.ffi.new("kt_decode_stack_layer[]", len(plans))
        for entry, plan in zip(self.layers, plans):
            entry.layer = plan.desc
            entry.moe = plan.moe.desc if plan.moe is not None else self.ffi.NULL
        self.moe_seconds = self.ffi.new("double[]", len(plans))
        self.bound = [None] * len(plans)        # the (k, v) caches each entry points at
        self.acts_rows = 0                      # the row count the layers' acts were set for
        self.scratch_floats = {}
        if self.lib.kt_decode_stack_scratch_floats(self.layers, len(plans), 1) < 0:
            raise OpError("decode plan: the native stack refused these layers")

    def applies(self) -> bool:
        return all(moe.applies() for _, moe in self.moe)

    def __call__(self, h: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """h [n, hidden] f32 -> the last layer's output [n, hidden]; ctx.decode must be set"""
        check_hidden(h, self.hidden)
        n = h.shape[0]
        step = self.ws.step_for(ctx, n, self.head_dim, self.ffi)
        self._bind_caches(ctx)
        if n != self.acts_rows:
            for plan in self.plans:
                plan.desc.acts = plan.acts_kinds[dense_acts(n, plan.decode_acts, until=plan.int16_until)]
            self.acts_rows = n
        floats = self.scratch_floats.get(n) or self.scratch_floats.setdefault(
            n, self.lib.kt_decode_stack_scratch_floats(self.layers, len(self.plans), n))
        scratch = self.ws.scratch_for(floats)
        out = h.clone()
        cast = self.ffi.cast
        rc = self.lib.kt_decode_stack_f32(self.pool.handle, self.layers, len(self.plans), step,
                                          cast("float *", out.data_ptr()), cast("float *", scratch.data_ptr()),
                                          scratch.numel(), self.moe_seconds)
        check_status(rc, "kt_decode_stack_f32")
        for i, moe in self.moe:
            moe.block.account_native(n, self.moe_seconds[i])
        return out

    def _bind_caches(self, ctx: AttentionContext) -> None:
        for i, plan in enumerate(self.plans):
            caches = plan.caches(ctx)
            if caches is not self.bound[i]:
                entry = self.layers[i]
                entry.k_cache, entry.v_cache = (self.ffi.cast("float *", t.data_ptr()) for t in caches)
                entry.cache_rows = caches[0].shape[0]
                self.bound[i] = caches
