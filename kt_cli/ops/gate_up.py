"""An expert's gate and up projections as one matrix (kt.h kt_moe_desc.gate_up), so that
a task of the fused MoE operator streams its gate and up rows as one run.

Rows go KT_GATE_UP_CHUNK at a time: for c = 0, 16, 32, ... and n = min(16, inter - c),
rows [2c, 2c + n) of gate_up are gate's rows [c, c + n) and the next n rows are up's."""

import torch

from kt_weights.layout import QMatrix

GATE_UP_CHUNK = 16      # kt.h KT_GATE_UP_CHUNK


def wanted(interleave: bool | None, gate: QMatrix, up: QMatrix) -> bool:
    """Whether gate and up go into one matrix. interleave=None: quantized experts in the row
    layout, which the kernel layouts copy anyway; float experts stay apart, borrowing the
    checkpoint's mapping (interleaving copies them). True: float experts too. A kernel
    layout (tiled, row8) is never interleaved."""
    if gate.in_memory_layout or up.in_memory_layout:
        return False
    return gate.format.quantized if interleave is None else interleave


def interleave(gate: QMatrix, up: QMatrix) -> QMatrix:
    """gate and up (inter, cols) in the row layout -> gate_up (2 inter, cols), same format."""
    at_gate, at_up = _positions(gate.rows)

    def pick(name):
        g, u = getattr(gate, name), getattr(up, name)
        if g is None:
            return None
        return g.new_empty((2 * gate.rows,) + g.shape[1:]).index_copy_(0, at_gate, g).index_copy_(0, at_up, u)
    return QMatrix(gate.format, 2 * gate.rows, gate.cols, pick("data"), gate.group, pick("scale"), pick("min"))


def split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up's rows [2 inter, ...] (dequantized, say) -> gate [inter, ...], up [inter, ...]"""
    at_gate, at_up = _positions(rows.shape[0] // 2)
    return rows.index_select(0, at_gate), rows.index_select(0, at_up)


def _positions(inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where gate's and up's rows r lie in gate_up: r + c and r + c + n, c = r's chunk start,
    n = that chunk's rows"""
    r = torch.arange(inter)
    c = r // GATE_UP_CHUNK * GATE_UP_CHUNK
    n = (inter - c).clamp(max=GATE_UP_CHUNK)
    return r + c, r + c + n
