from .common import gqa_attention, prefix, softmax_moe
from .config import MoEConfig, ModelConfig, base_fields, get, num_experts, qwen_dense_layers, rope_spec
from .decoder import CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE: GQA with per-head RMSNorm on q and k before rope; softmax top-k
    experts (renormalised when norm_topk_prob), no shared expert."""

    @classmethod
    def parse_config(cls, hf: dict) -> ModelConfig:
        fields = base_fields(hf, "Qwen3MoeForCausalLM")
        moe = MoEConfig(num_experts=num_experts(hf), top_k=get(hf, "num_experts_per_tok", required=True),
                        intermediate_size=get(hf, "moe_intermediate_size", required=True),
                        norm_topk_prob=bool(get(hf, "norm_topk_prob", default=False)),
                        dense_layers=qwen_dense_layers(hf, fields["num_layers"]))
        return ModelConfig(**fields, rope=rope_spec(hf, fields["head_dim"]), moe=moe, qk_norm=True)

    def build_attention(self, w, layer):
        bias = self.config.attention_bias
        return gqa_attention(self, w, layer, qkv_bias=bias, o_bias=bias, qk_norm=True)

    def build_mlp(self, w, layer):
        p = f"{prefix(layer)}.mlp"
        if not self.config.is_moe_layer(layer):
            return w.mlp(p, self.config.hidden_act)
        return softmax_moe(self, w, layer, f"{p}.gate.weight")
