"""Where kt keeps models: $KT_HOME/models (default ~/.cache/kt/models)."""

from pathlib import Path

from .hardware import kt_home

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def models_dir() -> Path:
    return kt_home() / "models"


def default_model_path() -> Path:
    return models_dir() / DEFAULT_MODEL_FILE
