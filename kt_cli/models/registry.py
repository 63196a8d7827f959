"""Maps Hugging Face architecture names to kt model classes."""

from ..errors import ModelError
from .decoder import CausalLM
from .deepseek_v2 import DeepseekV2ForCausalLM
from .deepseek_v3 import DeepseekV3ForCausalLM
from .llama import LlamaForCausalLM
from .mixtral import MixtralForCausalLM
from .options import ModelOptions
from .qwen2_moe import Qwen2MoeForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

__all__ = ["SUPPORTED", "CausalLM", "ModelOptions", "build_model", "model_class"]

SUPPORTED: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    if architecture not in SUPPORTED:
        raise ModelError(f"unsupported architecture {architecture}; supported: {', '.join(SUPPORTED)}")
    return SUPPORTED[architecture]


def build_model(ckpt, options: ModelOptions | None = None) -> CausalLM:
    model = model_class(ckpt.architecture).from_checkpoint(ckpt, options or ModelOptions())
    return model.eval()
