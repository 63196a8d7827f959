from ..layers.router import DeepseekV3Router, GroupLimit
from .config import ModelConfig
from .deepseek_v2 import DeepseekV2ForCausalLM, deepseek_config


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1: V2's latent attention and layer layout, with sigmoid expert
    scores, e_score_correction_bias and group-limited top-k (noaux_tc)."""

    @classmethod
    def parse_config(cls, hf: dict) -> ModelConfig:
        interleaved = bool(hf.get("rope_interleave", True))
        return deepseek_config(hf, "DeepseekV3ForCausalLM", interleaved_rope=interleaved)

    def build_router(self, w, name: str):
        moe = self.config.moe
        return DeepseekV3Router(w.exact(f"{name}.weight"), w.exact(f"{name}.e_score_correction_bias"),
                                moe.top_k, GroupLimit(moe.n_group, moe.topk_group),
                                moe.norm_topk_prob, moe.routed_scaling_factor)
