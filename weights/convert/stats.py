"""Quantization error per tensor kind: max over tensors of
max|dequantized - source| / max|source|, measured on up to SAMPLE_ROWS evenly
spaced rows of each matrix (the full check would cost as much as the conversion)."""

import re

import numpy as np
import torch

_KINDS = [
    (re.compile(r"\.experts\."), "experts"),
    (re.compile(r"shared_expert"), "shared"),
    (re.compile(r"self_attn\.(q_proj|q_a_proj|q_b_proj)\."), "q"),
    (re.compile(r"self_attn\.k_proj\."), "k"),
    (re.compile(r"self_attn\.v_proj\."), "v"),
    (re.compile(r"self_attn\.(kv_a_proj_with_mqa|kv_b_proj)\."), "kv"),
    (re.compile(r"self_attn\.o_proj\."), "o"),
    (re.compile(r"mlp\.(gate|up|down)_proj\."), "dense"),
    (re.compile(r"^lm_head\."), "lm_head"),
    (re.compile(r"embed_tokens"), "embed"),
]


def kind_of(name: str) -> str:
    for pattern, kind in _KINDS:
        if pattern.search(name):
            return kind
    return "other"


SAMPLE_ROWS = 64


def matrix_error(m, w: torch.Tensor) -> float:
    """m: QMatrix quantized from w [rows, cols] f32."""
    from ..layout import QMatrix

    idx = torch.linspace(0, m.rows - 1, min(m.rows, SAMPLE_ROWS)).long()
    part = QMatrix(m.format, len(idx), m.cols, m.data[idx], m.group, None if m.scale is None else m.scale[idx],
                   None if m.min is None else m.min[idx])
    return relative_error(part.dequantize(), w[idx])


def relative_error(got, ref) -> float:
    if isinstance(got, np.ndarray):
        got, ref = torch.from_numpy(got), torch.from_numpy(ref)
    scale = ref.abs().max().item()
    if scale == 0.0:
        return float((got - ref).abs().max().item() > 0)
    return (got.float() - ref.float()).abs().max().item() / scale


class ErrorStats:
    def __init__(self, initial: dict[str, float] | None = None) -> None:
        self.max_rel: dict[str, float] = dict(initial or {})

    def add(self, name: str, rel: float) -> None:
        kind = kind_of(name)
        self.max_rel[kind] = max(self.max_rel.get(kind, 0.0), rel)

    def merge(self, other: dict[str, float]) -> None:
        for kind, rel in other.items():
            self.max_rel[kind] = max(self.max_rel.get(kind, 0.0), rel)
