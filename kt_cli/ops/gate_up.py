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
    def pick(name):
        rows = getattr(gate, name)
        return None if rows is None else _interleave_rows(rows, getattr(up, name))
    return QMatrix(gate.format, 2 * gate.rows, gate.cols, pick("data"), gate.group, pick("scale"), pick("min"))


def split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up's rows [2 inter, ...] (dequantized, say) -> gate [inter, ...], up [inter, ...]"""
    inter = rows.shape[0] // 2
    gate, up = rows.new_empty((inter,) + rows.shape[1:]), rows.new_empty((inter,) + rows.shape[1:])
    full, rest = _paired(rows, inter), inter % GATE_UP_CHUNK
    if full is not None:
        gate[:len(full) * GATE_UP_CHUNK] = full[:, 0].flatten(0, 1)
        up[:len(full) * GATE_UP_CHUNK] = full[:, 1].flatten(0, 1)
    if rest:
        gate[inter - rest:] = rows[2 * inter - 2 * rest:2 * inter - rest]
        up[inter - rest:] = rows[2 * inter - rest:]
    return gate, up


def _interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    inter = gate.shape[0]
    out = gate.new_empty((2 * inter,) + gate.shape[1:])
    full, rest = _paired(out, inter), inter % GATE_UP_CHUNK
    if full is not None:
        full[:, 0] = gate[:len(full) * GATE_UP_CHUNK].unflatten(0, (len(full), GATE_UP_CHUNK))
        full[:, 1] = up[:len(full) * GATE_UP_CHUNK].unflatten(0, (len(full), GATE_UP_CHUNK))
    if rest:
        out[2 * inter - 2 * rest:2 * inter - rest] = gate[inter - rest:]
        out[2 * inter - rest:] = up[inter - rest:]
    return out


def _paired(rows: torch.Tensor, inter: int) -> torch.Tensor | None:
    """gate_up's whole chunks as a view [chunks, 2 (gate, up), CHUNK, ...], or None if there are none"""
    chunks = inter // GATE_UP_CHUNK
    if chunks == 0:
        return None
    return rows[:2 * chunks * GATE_UP_CHUNK].unflatten(0, (chunks, 2, GATE_UP_CHUNK))
