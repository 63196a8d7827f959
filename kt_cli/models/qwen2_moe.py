from ..layers.moe import SharedExpert
from .common import gqa_attention, prefix, softmax_moe
from .config import MoEConfig, ModelConfig, base_fields, get, num_experts, qwen_dense_layers, rope_spec
from .decoder import CausalLM


class Qwen2MoeForCausalLM(CausalLM):
    """Qwen1.5/Qwen2-MoE: GQA with q/k/v bias, softmax top-k experts plus a shared
    expert scaled by sigmoid(shared_expert_gate(x))."""

    @classmethod
    def parse_config(cls, hf: dict) -> ModelConfig:
        fields = base_fields(hf, "Qwen2MoeForCausalLM")
        fields["attention_bias"] = bool(get(hf, "qkv_bias", default=True))
        moe = MoEConfig(num_experts=num_experts(hf), top_k=get(hf, "num_experts_per_tok", required=True),
                        intermediate_size=get(hf, "moe_intermediate_size", required=True),
                        norm_topk_prob=bool(get(hf, "norm_topk_prob", default=False)),
                        shared_intermediate_size=get(hf, "shared_expert_intermediate_size", default=0),
                        shared_expert_gate=True,
                        dense_layers=qwen_dense_layers(hf, fields["num_layers"]))
        return ModelConfig(**fields, rope=rope_spec(hf, fields["head_dim"]), moe=moe)

    def build_attention(self, w, layer):
        return gqa_attention(self, w, layer, qkv_bias=self.config.attention_bias, o_bias=False)

    def build_mlp(self, w, layer):
        p, act = f"{prefix(layer)}.mlp", self.config.hidden_act
        if not self.config.is_moe_layer(layer):
            return w.mlp(p, act)
        shared = None
        if self.config.moe.shared_intermediate_size:
            shared = SharedExpert(w.mlp(f"{p}.shared_expert", act), w.linear(f"{p}.shared_expert_gate"))
        return softmax_moe(self, w, layer, f"{p}.gate.weight", shared)
