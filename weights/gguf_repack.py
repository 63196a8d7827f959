"""GGUF block formats -> kt layout (weights/layout.py), vectorised over all
blocks of a matrix at once. Every repack is lossless: the kt matrix
dequantizes to exactly the values ggml's dequantization gives.

raw is the stored bytes of a matrix, uint8 (rows, bytes_per_row); a row is a
sequence of blocks. Block layouts (little-endian, f16 = IEEE half):
  Q8_0  34 B / 32 w : d f16, q int8[32]                   w = d*q
  Q4_0  18 B / 32 w : d f16, qs[16]                       w = d*(q-8)
  Q4_1  20 B / 32 w : d f16, m f16, qs[16]                w = d*q + m
        qs byte j holds q[j] (low nibble) and q[j+16] (high): already kt's I4 block.
  Q4_K 144 B / 256 w: d, dmin f16; 12 B of 6-bit (sc, m) for 8 sub-blocks of 32;
        qs[128] in 4 chunks of 32 B: sub-block 2c = low nibbles of chunk c,
        sub-block 2c+1 = high nibbles                      w = d*sc*q - dmin*m
  Q5_K 176 B / 256 w: as Q4_K plus qh[32] before qs: bit i of qh[j] is bit 4 of
        element j of sub-block i                           w = d*sc*q - dmin*m, q 0..31
  Q6_K 210 B / 256 w: ql[128], qh[64], scales int8[16], d f16; 16 sub-blocks of 16.
        ql in 2 halves of 64 B, each: low nibbles = sub-blocks 0-1 (32 w), high
        nibbles = 2-3; qh in 2 halves of 32 B, bits 2k..2k+1 = top bits of
        sub-block pair k of that half                      w = d*sc*(q-32)
"""

import numpy as np
import torch

from .errors import WeightsError
from .layout import Format, QMatrix

QK = 32
QK_K = 256


def _f16(raw: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...) float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _matrix(fmt: Format, rows: int, cols: int, data: np.ndarray, group: int,
            scale: np.ndarray, mn: np.ndarray | None = None) -> QMatrix:
    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a))
    return QMatrix(fmt, rows, cols, t(data), group, t(scale.reshape(rows, -1)),
                   None if mn is None else t(mn.reshape(rows, -1)))


def _blocks(raw: np.ndarray, cols: int, block_weights: int, block_bytes: int) -> np.ndarray:
    rows = raw.shape[0]
    if cols % block_weights or raw.shape[1] != cols // block_weights * block_bytes:
        raise WeightsError(f"row of {raw.shape[1]} bytes does not hold {cols} weights "
                           f"in blocks of {block_weights}")
    return raw.reshape(rows, cols // block_weights, block_bytes)


def repack_q8_0(raw: np.ndarray, cols: int) -> QMatrix:
    b = _blocks(raw, cols, QK, 34)
    q = b[..., 2:].view(np.int8).reshape(raw.shape[0], cols)
    return _matrix(Format.I8, raw.shape[0], cols, q, QK, _f16(b[..., 0:2]))


def repack_q4_0(raw: np.ndarray, cols: int) -> QMatrix:
    b = _blocks(raw, cols, QK, 18)
    qs = b[..., 2:].reshape(raw.shape[0], cols // 2)
    return _matrix(Format.I4, raw.shape[0], cols, qs, QK, _f16(b[..., 0:2]))


def repack_q4_1(raw: np.ndarray, cols: int) -> QMatrix:
    b = _blocks(raw, cols, QK, 20)
    qs = b[..., 4:].reshape(raw.shape[0], cols // 2)
    return _matrix(Format.I4, raw.shape[0], cols, qs, QK, _f16(b[..., 0:2]), _f16(b[..., 2:4]))


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(..., 12) uint8 -> 8 six-bit scales and 8 six-bit mins, each (..., 8).
    Bytes 0-3: low 6 bits = sc[0..3]; 4-7: low 6 bits = m[0..3];
    8-11: low nibble = low bits of sc[4..7], high nibble = low bits of m[4..7];
    the top 2 bits of bytes 0-3 / 4-7 are bits 4-5 of sc[4..7] / m[4..7]."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _k_scale_min(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales_mins(b[..., 4:16])
    return d[..., None] * sc.astype(np.float32), -(dmin[..., None] * mn.astype(np.float32))


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    """(rows, n, 128) -> (rows, n, 8, 32) values: chunk c gives sub-blocks 2c, 2c+1."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _pack_kt_i4(q: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """values (..., 32) in 0..15 -> kt I4 bytes: byte j = q[j] | q[j+16] << 4."""
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(rows, cols // 2)


def repack_q4_k(raw: np.ndarray, cols: int) -> QMatrix:
    rows = raw.shape[0]
    b = _blocks(raw, cols, QK_K, 144)
    scale, mn = _k_scale_min(b)
    q = _low_high_nibbles(b[..., 16:144])
    return _matrix(Format.I4, rows, cols, _pack_kt_i4(q, rows, cols), QK, scale, mn)


def repack_q5_k(raw: np.ndarray, cols: int) -> QMatrix:
    rows = raw.shape[0]
    b = _blocks(raw, cols, QK_K, 176)
    scale, mn = _k_scale_min(b)
    low = _low_high_nibbles(b[..., 48:176])
    bit = np.arange(8, dtype=np.uint8).reshape(8, 1)
    high = (b[..., None, 16:48] >> bit) & 1
    q = (low | (high << 4)).astype(np.int8).reshape(rows, cols)
    return _matrix(Format.I8, rows, cols, q, QK, scale, mn)


def repack_q6_k(raw: np.ndarray, cols: int) -> QMatrix:
    rows = raw.shape[0]
    b = _blocks(raw, cols, QK_K, 210)
    n = b.shape[1]
    ql = b[..., 0:128].reshape(rows, n, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2).reshape(rows, n, 2, 4, 32)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    high = (b[..., 128:192].reshape(rows, n, 2, 1, 32) >> shifts) & 3
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(rows, cols)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    scale = _f16(b[..., 208:210])[..., None] * sc
    return _matrix(Format.I8, rows, cols, q, 16, scale)


REPACKERS = {
    "Q8_0": repack_q8_0, "Q4_0": repack_q4_0, "Q4_1": repack_q4_1,
    "Q4_K": repack_q4_k, "Q5_K": repack_q5_k, "Q6_K": repack_q6_k,
}
FLOAT_TYPES = {"F32": (Format.F32, torch.float32), "F16": (Format.F16, torch.float16),
               "BF16": (Format.BF16, torch.bfloat16)}
SUPPORTED_TYPES = (*FLOAT_TYPES, *REPACKERS)


def float_view(data: np.ndarray, type_name: str) -> torch.Tensor:
    """The stored float data as a torch view (no copy), numpy shape."""
    _, dtype = FLOAT_TYPES[type_name]
    t = torch.from_numpy(data)
    if type_name == "BF16":
        t = t.view(torch.bfloat16)
    return t
