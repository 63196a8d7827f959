"""Builders shared by several architectures (HF weight names under model.layers.{i})."""

import torch

from ..layers.attention import GQAAttention
from ..layers.moe import MoEBlock, SharedExpert
from ..layers.router import SoftmaxTopK
from .decoder import CausalLM
from .loader import Weights


def prefix(layer: int) -> str:
    return f"model.layers.{layer}"


def gqa_attention(model: CausalLM, w: Weights, layer: int, qkv_bias: bool, o_bias: bool,
                  qk_norm: bool = False) -> GQAAttention:
    c, p = model.config, f"{prefix(layer)}.self_attn"
    qkv = w.fused([f"{p}.{k}_proj" for k in ("q", "k", "v")], qkv_bias)
    norms = (w.norm(f"{p}.q_norm", c.rms_norm_eps), w.norm(f"{p}.k_norm", c.rms_norm_eps)) if qk_norm else None
    return GQAAttention(layer, c.num_heads, c.num_kv_heads, c.head_dim, qkv, w.linear(f"{p}.o_proj", o_bias),
                        model.rotary, norms)


def softmax_moe(model: CausalLM, w: Weights, layer: int, router: str,
                shared: SharedExpert | None = None) -> MoEBlock:
    c = model.config
    gate = SoftmaxTopK(w.exact(router), c.moe.top_k, c.moe.norm_topk_prob)
    return moe_block(model, w, layer, gate, shared)


def moe_block(model: CausalLM, w: Weights, layer: int, router: torch.nn.Module,
              shared: SharedExpert | None) -> MoEBlock:
    on_device = model.options.device_experts.get(layer)
    return MoEBlock(router, w.experts(layer), w.target, shared, on_device, model.config.hidden_act)
