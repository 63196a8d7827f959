from ..layers.mla import MLADims, MLAttention, MLAWeights
from ..layers.moe import SharedExpert
from ..layers.rope import softmax_scale_factor
from ..layers.router import DeepseekV2Router, GroupLimit
from .common import moe_block, prefix
from .config import MLAConfig, MoEConfig, ModelConfig, base_fields, get, rope_spec
from .decoder import CausalLM


def deepseek_config(hf: dict, architecture: str, interleaved_rope: bool) -> ModelConfig:
    fields = base_fields(hf, architecture)
    mla = MLAConfig(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=get(hf, "kv_lora_rank", required=True),
                    qk_nope_head_dim=get(hf, "qk_nope_head_dim", required=True),
                    qk_rope_head_dim=get(hf, "qk_rope_head_dim", required=True),
                    v_head_dim=get(hf, "v_head_dim", required=True))
    fields.update(num_kv_heads=fields["num_heads"], head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    return ModelConfig(**fields, rope=rope_spec(hf, mla.qk_rope_head_dim, interleaved_rope),
                       moe=deepseek_moe(hf, fields["num_layers"]), mla=mla)


def deepseek_moe(hf: dict, num_layers: int) -> MoEConfig:
    first_dense = get(hf, "first_k_dense_replace", default=0)
    freq = get(hf, "moe_layer_freq", default=1)
    inter = get(hf, "moe_intermediate_size", required=True)
    return MoEConfig(
        num_experts=get(hf, "n_routed_experts", "num_experts", "num_local_experts", required=True),
        top_k=get(hf, "num_experts_per_tok", required=True), intermediate_size=inter,
        norm_topk_prob=bool(get(hf, "norm_topk_prob", default=False)),
        shared_intermediate_size=inter * get(hf, "n_shared_experts", default=0),
        n_group=get(hf, "n_group", default=1), topk_group=get(hf, "topk_group", default=1),
        topk_method=get(hf, "topk_method", default="greedy"),
        routed_scaling_factor=float(get(hf, "routed_scaling_factor", default=1.0)),
        dense_layers=frozenset(i for i in range(num_layers) if i < first_dense or i % freq))


class DeepseekV2ForCausalLM(CausalLM):
    """DeepSeek-V2 / V2-Lite: multi-head latent attention (q_lora_rank None on Lite),
    interleaved-pair rope with YaRN, softmax greedy or group-limited top-k experts
    plus shared experts; the first first_k_dense_replace layers are dense."""

    @classmethod
    def parse_config(cls, hf: dict) -> ModelConfig:
        return deepseek_config(hf, "DeepseekV2ForCausalLM", interleaved_rope=True)

    def build_attention(self, w, layer):
        c, p = self.config, f"{prefix(layer)}.self_attn"
        m, eps, bias = c.mla, c.rms_norm_eps, c.attention_bias
        lora = m.q_lora_rank is not None
        q_in = (f"{p}.q_a_proj", bias) if lora else (f"{p}.q_proj", False)
        weights = MLAWeights(
            q_kv_a=w.fused([q_in[0], f"{p}.kv_a_proj_with_mqa"], [q_in[1], bias]),
            q_a_norm=w.norm(f"{p}.q_a_layernorm", eps) if lora else None,
            q_b_proj=w.linear(f"{p}.q_b_proj") if lora else None,
            kv_a_norm=w.norm(f"{p}.kv_a_layernorm", eps),
            kv_b=w.dense(f"{p}.kv_b_proj.weight"),
            o_proj=w.linear(f"{p}.o_proj", bias))
        dims = MLADims(c.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)
        scale = c.head_dim ** -0.5 * softmax_scale_factor(c.rope)
        return MLAttention(layer, dims, weights, self.rotary, scale)

    def build_mlp(self, w, layer):
        p, act = f"{prefix(layer)}.mlp", self.config.hidden_act
        if not self.config.is_moe_layer(layer):
            return w.mlp(p, act)
        shared = SharedExpert(w.mlp(f"{p}.shared_experts", act)) if self.config.moe.shared_intermediate_size else None
        return moe_block(self, w, layer, self.build_router(w, f"{p}.gate"), shared)

    def build_router(self, w, name: str):
        moe = self.config.moe
        groups = GroupLimit(moe.n_group, moe.topk_group) if moe.topk_method == "group_limited_greedy" else None
        return DeepseekV2Router(w.exact(f"{name}.weight"), moe.top_k, groups, moe.routed_scaling_factor)
