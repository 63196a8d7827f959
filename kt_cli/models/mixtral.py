from .common import gqa_attention, prefix, softmax_moe
from .config import MoEConfig, ModelConfig, base_fields, get, num_experts, rope_spec
from .decoder import CausalLM


class MixtralForCausalLM(CausalLM):
    """Mixtral: GQA, every layer a sparse MoE with renormalised softmax top-k, no shared expert."""

    @classmethod
    def parse_config(cls, hf: dict) -> ModelConfig:
        fields = base_fields(hf, "MixtralForCausalLM")
        moe = MoEConfig(num_experts=num_experts(hf), top_k=get(hf, "num_experts_per_tok", default=2),
                        intermediate_size=fields["intermediate_size"], norm_topk_prob=True)
        return ModelConfig(**fields, rope=rope_spec(hf, fields["head_dim"]), moe=moe)

    def build_attention(self, w, layer):
        return gqa_attention(self, w, layer, qkv_bias=False, o_bias=False)

    def build_mlp(self, w, layer):
        return softmax_moe(self, w, layer, f"{prefix(layer)}.block_sparse_moe.gate.weight")
