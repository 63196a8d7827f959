"""Decode steps of a plain GQA decoder layer in one native call.

In decode every layer runs about twenty small operations on a few rows. Through the
modules each one is a Python method, a torch allocation and a check, and once the
weights streamed through the caches have evicted the interpreter's data each costs
several times more: on SmolLM2 (30 layers of 576) that glue outweighed the kernels.
A DecodePlan hands the whole layer to kt_decode_layer_f32 (kt.h), which runs the same
kernels in the same order: norm, fused qkv projection, per-head norm (Qwen3), rope,
cache write, decode attention, o_proj (with the projections' biases, if any) and the
residual, then a dense gated SiLU MLP. A CPU MoE block with softmax top-k routing
runs as a second call (kt_cli.layers.decode_moe); other MLPs stay modules.

The layer's shapes and weight descriptors are checked once, when the plan is built
(C checks them again on every call); the step's contexts once per step; the hidden
states on every call. q, k and v that could not be fused (formats that differ, as Q4_K_M's
Q6_K v) go as three matrices. Layers a plan does not cover (MLA, GPU or non-float32 models)
keep the module path: plan_for() returns None for them; a dense MLP with biases runs as modules."""

import torch
import torch.nn.functional as F

from .. import ops
from ..ops.ffi_args import OpError, check_status
from ..ops.rope import supports_dim as rope_dim_ok
from .attention import AttentionContext, GQAAttention
from .decode_moe import moe_plan_for
from .linear import Linear, dense_acts
from .mlp import GatedMLP
from .norm import RMSNorm


class DecodeWorkspace:
    """Scratch shared by the plans of one model (layers run one after another), grown on
    demand, and the native description of the current step, built once per step."""

    def __init__(self):
        self.scratch = torch.empty(0, dtype=torch.float32)
        self.step_ctx: AttentionContext | None = None   # held: it keeps the tensors `step` points into
        self.step = None        # kt_decode_step of step_ctx

    def scratch_for(self, floats: int) -> torch.Tensor:
        if self.scratch.numel() < floats:
            with torch.inference_mode(False):     # a normal tensor: C writes it inside and outside inference mode
                self.scratch = torch.empty(max(floats, 2 * self.scratch.numel()), dtype=torch.float32)
        return self.scratch

    def step_for(self, ctx: AttentionContext, n: int, head_dim: int, ffi):
        if self.step_ctx is not ctx:
            self.step = _native_step(ctx, n, head_dim, ffi)
            self.step_ctx = ctx
        elif self.step.n != n:
            raise OpError(f"decode plan: {n} rows in a step of {self.step.n}")
        return self.step


def _native_step(ctx: AttentionContext, n: int, head_dim: int, ffi):
    contexts, rope, slots = ctx.decode, ctx.rope, ctx.slot_mapping
    if not (contexts is not None and contexts.offset.numel() == n and slots.numel() == n
            and slots.dtype == torch.int64 and slots.device.type == "cpu" and slots.is_contiguous()
            and tuple(rope.cos.shape) == tuple(rope.sin.shape) == (n, 1, head_dim)
            and rope.cos.dtype == rope.sin.dtype == torch.float32
            and rope.cos.is_contiguous() and rope.sin.is_contiguous()):
        raise OpError(f"decode plan: the step's contexts or rope tables do not fit {n} rows of head dim {head_dim}")
    step = ffi.new("kt_decode_step *")
    step.n = n
    step.cos, step.sin = (ffi.cast("const float *", t.data_ptr()) for t in (rope.cos, rope.sin))
    step.slot_mapping = ffi.cast("const int64_t *", slots.data_ptr())
    step.ctx_slots, step.ctx_offset, step.ctx_len = (ffi.cast("const int64_t *", t.data_ptr())
                                                     for t in (contexts.slots, contexts.offset, contexts.length))
    step.n_ctx_slots = contexts.slots.numel()
    return step


def check_hidden(h: torch.Tensor, hidden: int) -> None:
    if not (h.dim() == 2 and h.shape[1] == hidden and h.dtype == torch.float32 and h.is_contiguous()
            and h.device.type == "cpu" and h.shape[0] >= 1):
        raise OpError(f"decode plan: hidden states must be a contiguous float32 cpu [n, {hidden}] tensor")


def plan_for(layer, workspace: DecodeWorkspace) -> "DecodePlan | None":
    """A plan for this decoder layer when its attention half (and its MLP, if dense) runs
    on kt's CPU kernels in float32 (biases only on the attention projections); else None."""
    attn, mlp = layer.attn, layer.mlp
    if not (isinstance(attn, GQAAttention) and _norm_ok(layer.input_norm) and _norm_ok(layer.post_norm)):
        return None
    if attn.qk_norm is not None and not _norm_ok(attn.qk_norm):
        return None
    if not (all(_linear_ok(linear, biased=True) for linear in attn.qkv.linears)
            and _linear_ok(attn.o_proj, biased=True) and rope_dim_ok(attn.head_dim)):
        return None
    dense = (isinstance(mlp, GatedMLP) and mlp.act is F.silu and mlp.gate_up.fused
             and _linear_ok(mlp.gate_up.linears[0]) and _linear_ok(mlp.down))
    return DecodePlan(layer, dense, workspace)


def _norm_ok(norm) -> bool:
    return isinstance(norm, RMSNorm) and norm.f32_weight and norm.weight.device.type == "cpu"


def _linear_ok(linear, biased: bool = False) -> bool:
    """A CPU kernel layer; with a bias only where `biased` (the attention projections) and a
    float32 one of the layer's width."""
    if not (isinstance(linear, Linear) and linear.kernel is not None):
        return False
    b = linear.bias
    return b is None or (biased and b.dtype == torch.float32 and b.device.type == "cpu" and b.is_contiguous()
                         and tuple(b.shape) == (linear.rows,))


ACTS_PRECISION = ("int8", "int16", "f32")


def _layer_acts(layer, dense: bool) -> tuple[str, int]:
    """A kt_decode_layer gives all its projections one kind of activations: the most precise
    any of them takes (f32 > int16 > int8; Q4_K_M files keep some v and down projections in
    Q6_K, an I8 format), up to the fewest tokens any of them keeps it for (Linear.int16_until).
    The modules are set to the same, so both paths compute the same. -> (acts, until)"""
    linears = [*layer.attn.qkv.linears, layer.attn.o_proj]
    if dense:
        linears += [layer.mlp.gate_up.linears[0], layer.mlp.down]
    acts = max((linear.decode_acts for linear in linears), key=ACTS_PRECISION.index)
    until = min(linear.int16_until for linear in linears)
    for linear in linears:
        linear.decode_acts, linear.int16_until = acts, until
    return acts, until


def _joined_bias(linears: list) -> torch.Tensor | None:
    """The q, k and v biases side by side (zeros for a part without one), or None without any; a
    fused projection's own bias"""
    if len(linears) == 1:
        return linears[0].bias
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat([linear.bias if linear.bias is not None else torch.zeros(linear.rows) for linear in linears])


class DecodePlan:
    def __init__(self, layer, dense: bool, workspace: DecodeWorkspace):
        attn = layer.attn
        self.layer, self.dense, self.ws = layer, dense, workspace
        self.pool = ops.pool()
        self.ffi, self.lib = self.pool.kernels.ffi, self.pool.kernels.lib
        self.hidden, self.head_dim, self.cache_index = attn.o_proj.rows, attn.head_dim, attn.layer
        self.desc = self._describe(layer, dense)
        self.moe = None if dense else moe_plan_for(layer.mlp, layer.post_norm)
        self.acts_kinds = attn.o_proj.kernel.kinds      # dense_acts() name -> kt_acts_kind
        self.decode_acts, self.int16_until = _layer_acts(layer, dense)
        self.checked_caches = None
        self.scratch_floats = {}

    def _describe(self, layer, dense: bool):
        """The kt_decode_layer of this layer; the acts field is set per call."""
        attn, mlp, ffi = layer.attn, layer.mlp, self.ffi
        d = ffi.new("kt_decode_layer *")
        d.hidden, d.heads, d.kv_heads, d.head_dim = self.hidden, attn.num_heads, attn.num_kv_heads, attn.head_dim
        d.inter = mlp.down.cols if dense else 0
        d.in_norm, d.eps = ffi.cast("const float *", layer.input_norm.weight.data_ptr()), layer.input_norm.eps
        d.post_norm, d.post_eps = ffi.cast("const float *", layer.post_norm.weight.data_ptr()), layer.post_norm.eps
        if attn.qk_norm is not None:
            d.qk_norm, d.qk_eps = ffi.cast("const float *", attn.qk_norm.weight.data_ptr()), attn.qk_norm.eps
        d.scale, d.interleaved = attn.scale, int(attn.rotary.spec.interleaved)
        d.o_proj = attn.o_proj.kernel.desc
        if attn.qkv.fused:
            d.qkv = attn.qkv.linears[0].kernel.desc
        else:       # q, k and v in different formats (Q4_K_M's Q6_K v): three matrices
            d.q_proj, d.k_proj, d.v_proj = (linear.kernel.desc for linear in attn.qkv.linears)
        self.qkv_bias = _joined_bias(attn.qkv.linears)
        for field, bias in (("qkv_bias", self.qkv_bias), ("o_bias", attn.o_proj.bias)):
            if bias is not None:
                setattr(d, field, ffi.cast("const float *", bias.data_ptr()))
        if dense:
            d.gate_up, d.down = mlp.gate_up.linears[0].kernel.desc, mlp.down.kernel.desc
        if self.lib.kt_decode_scratch_floats(d, 1) < 0:
            raise OpError("decode plan: the native layer refused this layer's sizes")
        return d

    def __call__(self, h: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """h [n, hidden] f32 -> the layer's output [n, hidden]; ctx.decode must be set"""
        check_hidden(h, self.hidden)
        n = h.shape[0]
        step = self.ws.step_for(ctx, n, self.head_dim, self.ffi)
        k_cache, v_cache = self.caches(ctx)
        floats = self.scratch_floats.get(n) or self.scratch_floats.setdefault(
            n, self.lib.kt_decode_scratch_floats(self.desc, n))
        scratch = self.ws.scratch_for(floats)
        self.desc.acts = self.acts_kinds[dense_acts(n, self.decode_acts, until=self.int16_until)]
        out = torch.empty_like(h)
        cast = self.ffi.cast
        rc = self.lib.kt_decode_layer_f32(
            self.pool.handle, self.desc, step, cast("const float *", h.data_ptr()), cast("float *", out.data_ptr()),
            cast("float *", k_cache.data_ptr()), cast("float *", v_cache.data_ptr()), k_cache.shape[0],
            cast("float *", scratch.data_ptr()), scratch.numel())
        check_status(rc, "kt_decode_layer_f32")
        if self.dense:
            return out
        if self.moe is not None and self.moe.applies():
            self.moe(out, self.ws.scratch_for)
            return out
        return out + self.layer.mlp.forward(self.layer.post_norm.forward(out))

    def caches(self, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (k, v) cache tensors in ctx, checked the first time they are seen."""
        caches = ctx.kv.layers[self.cache_index]
        if caches is not self.checked_caches:
            k_cache, v_cache = caches
            head = (self.desc.kv_heads, self.head_dim)
            if not (k_cache.dtype == v_cache.dtype == torch.float32 and k_cache.device.type == "cpu"
                    and tuple(k_cache.shape[1:]) == tuple(v_cache.shape[1:]) == head
                    and k_cache.shape[0] == v_cache.shape[0] and k_cache.is_contiguous() and v_cache.is_contiguous()):
                raise OpError(f"decode plan: the KV cache does not hold float32 rows of {head[0]} heads of {head[1]}")
            self.checked_caches = caches
        return caches
