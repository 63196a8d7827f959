"""Native round-to-nearest quantization: weights into the kt-q1 I8/I4 formats
(bit-identical to kt_weights.layout.quantize_reference) and activations into
per-row symmetric int8."""

import torch

from kt_weights.layout import I4_BLOCK, Format, QMatrix

from .ffi_args import check, check_status, kt_matrix, matrix_2d, pointer
from .pool import Pool


def quantize(pool: Pool, w: torch.Tensor, fmt: Format, group: int, symmetric: bool = True) -> QMatrix:
    rows, cols = matrix_2d(w, torch.float32, "w")
    fmt = _quantized_format(fmt)
    block = I4_BLOCK if fmt == Format.I4 else 16
    check(isinstance(group, int) and group > 0 and group % block == 0,
          f"group {group!r} is not a positive multiple of {block}")
    check(cols % group == 0, f"cols {cols} is not a multiple of group {group}")
    data = torch.empty(rows, cols // 2 if fmt == Format.I4 else cols,
                       dtype=torch.uint8 if fmt == Format.I4 else torch.int8)
    scale = torch.empty(rows, cols // group, dtype=torch.float32)
    mn = None if symmetric else torch.empty(rows, cols // group, dtype=torch.float32)
    out = QMatrix(fmt, rows, cols, data, group, scale, mn)
    ffi = pool.kernels.ffi
    rc = pool.kernels.lib.kt_quantize_matrix_f32(pool.handle, kt_matrix(ffi, out, "destination"),
                                                 pointer(ffi, w, "const float *"))
    check_status(rc, "kt_quantize_matrix_f32")
    return out


def quantize_rows_i8(kernels, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = matrix_2d(x, torch.float32, "x")
    q = torch.empty(rows, n, dtype=torch.int8)
    scale = torch.empty(rows, dtype=torch.float32)
    ffi = kernels.ffi
    rc = kernels.lib.kt_quantize_rows_f32_i8(pointer(ffi, q, "int8_t *"), pointer(ffi, scale, "float *"),
                                             pointer(ffi, x, "const float *"), rows, n)
    check_status(rc, "kt_quantize_rows_f32_i8")
    return q, scale


def _quantized_format(fmt) -> Format:
    try:
        parsed = Format(fmt)
    except ValueError:
        parsed = None
    check(parsed is not None and parsed.quantized, f"quantize: format must be I8 or I4, got {fmt!r}")
    return parsed
