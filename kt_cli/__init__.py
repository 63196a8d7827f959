"""kt: Mixture-of-Experts inference on a commodity CPU, plus a GPU when there is one."""

import os

__version__ = "0.2.0"

# torch's OpenMP (libgomp) workers poll for about 300k rounds (milliseconds) after
# every parallel region, on the cores kt's kernels need next; 20k rounds keep
# torch's back-to-back ops cheap and hand the cores back in well under a
# millisecond (prefill, 2 cores: SmolLM2 pp128 ~240 -> ~355-430 tok/s together
# with kt's workers sleeping in wide steps; the scaled Qwen3-MoE pp512 not slower).
# libgomp reads it when torch loads, so only before torch's first import counts.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")
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
