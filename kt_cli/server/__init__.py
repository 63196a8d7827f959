"""`kt run`: an OpenAI-compatible HTTP server over kt's engine (see launch.py for the flow)."""

from .launch import serve
from .options import ServeOptions

__all__ = ["ServeOptions", "serve"]
