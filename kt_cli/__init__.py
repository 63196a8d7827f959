"""kt: Mixture-of-Experts inference on a commodity CPU, plus a GPU when there is one."""

__version__ = "0.1.0"

from .llm import LLM, SamplingParams  # noqa: E402
