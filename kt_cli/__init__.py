"""kt: Mixture-of-Experts inference on a commodity CPU, plus a GPU when there is one."""

__version__ = "0.2.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # imported on first use, so `kt doctor` and `kt chat --url` start without loading torch
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name == "SamplingParams":
        from .engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'kt_cli' has no attribute {name!r}")
