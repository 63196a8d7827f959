from .common import gqa_attention, prefix
from .config import ModelConfig, base_fields, rope_spec
from .decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    """Llama 2/3, SmolLM2: GQA with halves-layout rope (llama3 scaling), dense SwiGLU MLP."""

    @classmethod
    def parse_config(cls, hf: dict) -> ModelConfig:
        fields = base_fields(hf, "LlamaForCausalLM")
        return ModelConfig(**fields, rope=rope_spec(hf, fields["head_dim"]))

    def build_attention(self, w, layer):
        bias = self.config.attention_bias
        return gqa_attention(self, w, layer, qkv_bias=bias, o_bias=bias)

    def build_mlp(self, w, layer):
        return w.mlp(f"{prefix(layer)}.mlp", self.config.hidden_act, self.config.mlp_bias)
