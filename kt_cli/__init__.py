"""kt: Mixture-of-Experts inference on a commodity CPU, plus a GPU when there is one."""

__version__ = "0.1.0"
