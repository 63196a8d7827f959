"""The kt weight layout "kt-q1": how one quantized matrix is laid out in memory
and on disk. native/include/kt.h describes the same layout for the C kernels;
`QMatrix.dequantize` is its plain torch definition, used as the reference.

A matrix W is (rows, cols); linear layers compute x @ W.T.
  F32 / BF16 / F16  data (rows, cols) in that dtype
  I8   data int8 (rows, cols);  w = scale*q (+ min)
  I4   data uint8 (rows, cols/2); every 32 weights of a row are one 16-byte block,
       byte j = q[j] | q[j+16] << 4, q in 0..15;
       w = scale*(q-8) without min, w = scale*q + min with it
  I6   in memory only, in the row8 layout below: 6-bit codes q in 0..63 (GGUF's Q6_K and Q5_K,
       which I8 holds in 8 bits); w = scale*(q-32) without min, w = scale*q + min with it
  scale, min: float32 (rows, cols/group); float16 in the row8 layout below when exact

In memory only (never on disk), an I8/I4 matrix may be `tiled` (kt.h,
KT_LAYOUT_TILES): the same bytes with every 4 rows interleaved in 64-byte chunks,
so the CPU kernels stream a row tile as one run (`tile_rows`, `untile_rows`).
An I4 or I8 matrix may instead be `row8` (kt.h, KT_LAYOUT_ROW8): every 8 rows' bytes
interleaved 4 at a time, and their scales (and mins) per group, so one load holds the
same columns of 8 rows (`to_row8`, `from_row8`). Its scale and min are
float16 instead when every value of both is exactly a half (GGUF's Q4_0 and Q4_1 store
theirs so): decode then streams 10-17% fewer bytes for the same weights; else uint8 subs
with float16 `scale_base`/`min_base` per 8 groups where they factor so (weights/k_scales.py:
GGUF's Q4_K and Q5_K), 23% fewer for Q4_K; int8 subs where they factor only with signs (Q6_K).
An I8 matrix whose codes fit 6 bits (-32..31, or 0..63 with mins) may become I6 in the row8
layout (`fits_i6`, `to_row8_i6`): kt.h's block of I4's low nibbles, then 64 bytes of the
codes' top 2 bits; Q6_K streams 6.625 bits a weight instead of 10, Q5_K 6.6 instead of 8.6.
"""

from dataclasses import dataclass
from enum import IntEnum

import torch

from . import k_scales
from .errors import WeightsError

LAYOUT_TAG = "kt-q1"
LAYOUT_VERSION = 1
I4_BLOCK = 32
TILE_ROWS = 4       # kt.h KT_TILE_ROWS
TILE_CHUNK = 64     # kt.h KT_TILE_CHUNK, bytes
ROW8_ROWS = 8       # kt.h KT_ROW8_ROWS


class Format(IntEnum):
    F32 = 0
    BF16 = 1
    F16 = 2
    I8 = 3
    I4 = 4
    I6 = 5      # in memory only, row8 layout only

    @property
    def quantized(self) -> bool:
        return self in (Format.I8, Format.I4, Format.I6)


_FLOAT_DTYPES = {Format.F32: torch.float32, Format.BF16: torch.bfloat16, Format.F16: torch.float16}


class LayoutError(WeightsError):
    pass


@dataclass
class QMatrix:
    format: Format
    rows: int
    cols: int
    data: torch.Tensor
    group: int = 0
    scale: torch.Tensor | None = None
    min: torch.Tensor | None = None
    tiled: bool = False
    row8: bool = False
    scale_base: torch.Tensor | None = None      # two-level scales (row8): float16 [rows, n_groups / 8]
    min_base: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.format = Format(self.format)
        self.validate()

    @property
    def n_groups(self) -> int:
        return self.cols // self.group if self.format.quantized else 0

    def validate(self) -> None:
        _check(self.rows > 0 and self.cols > 0, f"empty matrix {self.rows}x{self.cols}")
        if self.format.quantized:
            _validate_quantized(self)
        else:
            _expect(self.data, _FLOAT_DTYPES[self.format], (self.rows, self.cols), "data")
        _check(not self.tiled or can_tile(self), f"a {self.format.name} {self.rows}x{self.cols} matrix cannot be tiled")
        _check(not self.row8 or can_row8(self), f"a {self.format.name} {self.rows}x{self.cols} matrix cannot be row8")
        _check(not (self.tiled and self.row8), "a matrix is tiled or row8, not both")

    @property
    def in_memory_layout(self) -> bool:
        """Whether the codes are in a kernel layout (tiled or row8) that is never written to disk."""
        return self.tiled or self.row8

    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding the matrix: codes (or values), then scale and min where present."""
        return [t for t in (self.data, self.scale, self.min, self.scale_base, self.min_base) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """dequantize()[rows] for rows [n] int64, [n, cols] float32, reading only those rows
        (of a matrix in the row layout; a kernel layout is dequantized whole first)."""
        if self.in_memory_layout:
            return self.dequantize().index_select(0, rows)
        if not self.format.quantized:
            return self.data.index_select(0, rows).float()
        pick = (lambda t: None if t is None else t.index_select(0, rows))
        return self._dequantize_codes(pick(self.data), pick(self.scale), pick(self.min))

    def dequantize(self) -> torch.Tensor:
        if not self.format.quantized:
            return self.data.float()
        if self.tiled:
            return untile_rows(self).dequantize()
        if self.row8:
            return from_row8(self).dequantize()
        return self._dequantize_codes(self.data, self.scale, self.min)

    def _dequantize_codes(self, data: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
        """Row-layout codes [n, ...] with their scale (and min) [n, n_groups] -> [n, cols] float32"""
        n = data.shape[0]
        q = (unpack_i4(data, self.cols) if self.format == Format.I4 else data.float()).view(n, self.n_groups, -1)
        s = scale[:, :, None]
        if mins is not None:
            return (q * s + mins[:, :, None]).view(n, self.cols)
        return ((q - 8.0) * s if self.format == Format.I4 else q * s).view(n, self.cols)


# float32, and in the row8 layout kt.h KT_SCALE_F16, KT_SCALE_K and KT_SCALE_KS (uint8 or int8 subs
# with float16 bases)
_ROW8_SCALE_DTYPES = (torch.float32, torch.float16, torch.uint8, torch.int8)
_TWO_LEVEL_DTYPES = (torch.uint8, torch.int8)
I6_BLOCK_BYTES = 192    # kt.h KT_I6 in KT_LAYOUT_ROW8: 8 rows x 32 columns


def _validate_quantized(m: QMatrix) -> None:
    block = I4_BLOCK if m.format == Format.I4 else 16
    _check(m.group > 0 and m.group % block == 0, f"group {m.group} is not a multiple of {block}")
    _check(m.cols % m.group == 0, f"cols {m.cols} is not a multiple of group {m.group}")
    if m.format == Format.I4:
        _expect(m.data, torch.uint8, (m.rows, m.cols // 2), "data")
    elif m.format == Format.I6:
        _check(m.row8, "an I6 matrix exists only in the row8 layout")
        _check(m.group == 16 or m.group % 32 == 0, f"I6 group {m.group} is neither 16 nor a multiple of 32")
        _expect(m.data, torch.uint8, (m.rows, m.cols // 4 * 3), "data")
    else:
        _expect(m.data, torch.int8, (m.rows, m.cols), "data")
    scale_dtype = m.scale.dtype if m.row8 and m.scale is not None else torch.float32
    _check(scale_dtype in _ROW8_SCALE_DTYPES, f"scale has dtype {scale_dtype}, expected one of {_ROW8_SCALE_DTYPES}")
    _expect(m.scale, scale_dtype, (m.rows, m.n_groups), "scale")
    if m.min is not None:
        _expect(m.min, scale_dtype, (m.rows, m.n_groups), "min")
    if scale_dtype not in _TWO_LEVEL_DTYPES:
        _check(m.scale_base is None and m.min_base is None, "scale_base and min_base go with uint8 (two-level) scales")
        return
    _check(m.n_groups % k_scales.GROUPS == 0, f"{m.n_groups} groups are not a multiple of {k_scales.GROUPS}")
    _expect(m.scale_base, torch.float16, (m.rows, m.n_groups // k_scales.GROUPS), "scale_base")
    if m.min is not None:
        _expect(m.min_base, torch.float16, (m.rows, m.n_groups // k_scales.GROUPS), "min_base")
    else:
        _check(m.min_base is None, "min_base without min")


def _expect(t: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, int], what: str) -> None:
    _check(t is not None, f"{what} is missing")
    _check(t.dtype == dtype, f"{what} has dtype {t.dtype}, expected {dtype}")
    _check(tuple(t.shape) == shape, f"{what} has shape {tuple(t.shape)}, expected {shape}")
    _check(t.is_contiguous(), f"{what} is not contiguous")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise LayoutError(message)


def can_tile(m: QMatrix) -> bool:
    """Whether m's shape allows the tiled layout (kt.h KT_LAYOUT_TILES)."""
    return m.format.quantized and m.rows % TILE_ROWS == 0 and m.data.shape[1] % TILE_CHUNK == 0


def tile_rows(m: QMatrix) -> QMatrix:
    """m in the tiled layout (a copy of the codes; scale and min shared): byte b of
    row r moves to (r // 4) * 4 * row_bytes + ((b // 64) * 4 + r % 4) * 64 + b % 64."""
    _check(not m.in_memory_layout, "the matrix is in a kernel layout already")
    _check(can_tile(m), f"a {m.format.name} {m.rows}x{m.cols} matrix cannot be tiled")
    rows, nbytes = m.data.shape
    chunks = m.data.reshape(rows // TILE_ROWS, TILE_ROWS, nbytes // TILE_CHUNK, TILE_CHUNK)
    data = chunks.transpose(1, 2).contiguous().reshape(rows, nbytes)
    return QMatrix(m.format, m.rows, m.cols, data, m.group, m.scale, m.min, tiled=True)


def untile_rows(m: QMatrix) -> QMatrix:
    """The inverse of tile_rows: m back in the row layout."""
    _check(m.tiled, "the matrix is not tiled")
    rows, nbytes = m.data.shape
    chunks = m.data.reshape(rows // TILE_ROWS, nbytes // TILE_CHUNK, TILE_ROWS, TILE_CHUNK)
    data = chunks.transpose(1, 2).contiguous().reshape(rows, nbytes)
    return QMatrix(m.format, m.rows, m.cols, data, m.group, m.scale, m.min)


def can_row8(m: QMatrix) -> bool:
    """Whether m's shape allows the row8 layout (kt.h KT_LAYOUT_ROW8)."""
    fits = m.rows % ROW8_ROWS == 0 and m.cols % 64 == 0
    return fits and (m.format in (Format.I4, Format.I6) or (m.format == Format.I8 and m.group % 32 == 0))


def to_row8(m: QMatrix) -> QMatrix:
    """m in the row8 layout (copies of codes, scale and min): the 4 bytes 4i..4i+3 of
    row r move to (r // 8) * 8 * row_bytes + i * 32 + (r % 8) * 4 (for I4 bytes 4j..4j+3
    of row r's block b, at b * 128 + j * 32 + ...; for I8 at b * 256 + j * 32 + ...), the
    scale of row r, group g to (r // 8) * 8 * n_groups + g * 8 + r % 8."""
    _check(not m.in_memory_layout, "the matrix is in a kernel layout already")
    _check(can_row8(m), f"a {m.format.name} {m.rows}x{m.cols} matrix cannot be row8")
    row_bytes = m.data.shape[1]
    words = _words(m.data).reshape(m.rows // ROW8_ROWS, ROW8_ROWS, row_bytes // 4)    # [G, r, i]
    data = words.transpose(1, 2).contiguous().view(m.data.dtype).reshape(m.rows, row_bytes)
    scale, mins, scale_base, min_base = _row8_scales(m)
    return QMatrix(m.format, m.rows, m.cols, data, m.group, scale, mins, row8=True, scale_base=scale_base,
                   min_base=min_base)


def _row8_scales(m: QMatrix) -> tuple:
    """(scale, min, scale_base, min_base) of m in the row8 layout: float16 where every value is a
    half, else two-level where every value factors so (k_scales; uint8 subs, else int8 ones), else
    float32"""
    if _exact_halves(m.scale, m.min):
        return _groups_by_8(m.scale, torch.float16), _groups_by_8(m.min, torch.float16), None, None
    for signed in (False, True):
        scale = k_scales.factor(m.scale, signed)
        mins = k_scales.factor(m.min, signed) if scale is not None and m.min is not None else None
        if scale is not None and (m.min is None or mins is not None):
            (sub, base), (min_sub, min_base) = scale, mins or (None, None)
            return (_groups_by_8(sub, sub.dtype), _groups_by_8(min_sub, sub.dtype), _groups_by_8(base, torch.float16),
                    _groups_by_8(min_base, torch.float16))
    return _groups_by_8(m.scale, torch.float32), _groups_by_8(m.min, torch.float32), None, None


def fits_i6(m: QMatrix) -> bool:
    """Whether I8 matrix m (row layout) can become I6 in the row8 layout (kt.h KT_I6): its shape
    fits, its group is 16 or a multiple of 32, and its codes lie in -32..31 (0..63 with mins)"""
    if m.format != Format.I8 or m.in_memory_layout or m.rows % ROW8_ROWS or m.cols % 64:
        return False
    if m.group != 16 and m.group % 32:
        return False
    low, high = (0, 63) if m.min is not None else (-32, 31)
    return int(m.data.min()) >= low and int(m.data.max()) <= high


def to_row8_i6(m: QMatrix) -> QMatrix:
    """I8 matrix m whose codes fit 6 bits (fits_i6) as I6 in the row8 layout. Per 8-row group and
    32-column block (kt.h): 128 bytes as I4's row8 block of the codes' low nibbles (byte n = 32 j
    + 4 r + i holds columns 4j + i and 16 + 4j + i of row r), then 64 bytes whose byte p holds
    the top 2 bits of byte p's two codes (bits 0-3), then of byte p + 64's (bits 4-7)."""
    _check(fits_i6(m), f"an I8 {m.rows}x{m.cols} matrix with group {m.group} does not fit I6")
    codes = m.data.to(torch.int16) + (0 if m.min is not None else 32)
    nb = m.cols // 32
    # [G, r, b, half, j, i] -> [G, b, half, j, r, i]: each half's 128 codes in nibble-byte order
    u = codes.to(torch.uint8).reshape(m.rows // ROW8_ROWS, ROW8_ROWS, nb, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
    u = u.reshape(m.rows // ROW8_ROWS, nb, 2, 128)
    low, high = u[:, :, 0], u[:, :, 1]
    nibbles = (low & 0x0F) | ((high & 0x0F) << 4)
    top = (low >> 4) | ((high >> 4) << 2)                   # 4 bits a nibble byte
    tops = top[..., :64] | (top[..., 64:] << 4)
    data = torch.cat([nibbles, tops], dim=2).reshape(m.rows, m.cols // 4 * 3)
    scale, mins, scale_base, min_base = _row8_scales(m)
    return QMatrix(Format.I6, m.rows, m.cols, data.contiguous(), m.group, scale, mins, row8=True,
                   scale_base=scale_base, min_base=min_base)


def _i6_codes(m: QMatrix) -> torch.Tensor:
    """The inverse of to_row8_i6's packing: I6 row8 m's codes as I8 codes [rows, cols] in row order"""
    nb = m.cols // 32
    blocks = m.data.reshape(m.rows // ROW8_ROWS, nb, I6_BLOCK_BYTES)
    nibbles, tops = blocks[..., :128], blocks[..., 128:]
    top = torch.cat([tops & 0x0F, tops >> 4], dim=2)
    low = (nibbles & 0x0F) | ((top & 3) << 4)
    high = (nibbles >> 4) | ((top >> 2) << 4)
    u = torch.stack([low, high], dim=2).reshape(m.rows // ROW8_ROWS, nb, 2, 4, ROW8_ROWS, 4)
    codes = u.permute(0, 4, 1, 2, 3, 5).reshape(m.rows, m.cols).to(torch.int16)
    return (codes - (0 if m.min is not None else 32)).to(torch.int8)


def from_row8(m: QMatrix) -> QMatrix:
    """The inverse of to_row8 (and of to_row8_i6: an I6 matrix comes back I8): m in the row layout."""
    _check(m.row8, "the matrix is not row8")
    if m.format == Format.I6:
        return QMatrix(Format.I8, m.rows, m.cols, _i6_codes(m), m.group, _row8_values(m.scale, m.scale_base),
                       _row8_values(m.min, m.min_base))
    row_bytes = m.data.shape[1]
    words = _words(m.data).reshape(m.rows // ROW8_ROWS, row_bytes // 4, ROW8_ROWS)    # [G, i, r]
    data = words.transpose(1, 2).contiguous().view(m.data.dtype).reshape(m.rows, row_bytes)
    return QMatrix(m.format, m.rows, m.cols, data, m.group, _row8_values(m.scale, m.scale_base),
                   _row8_values(m.min, m.min_base))


def _row8_values(t: torch.Tensor | None, base: torch.Tensor | None) -> torch.Tensor | None:
    """A row8 scale (or min) back in row order as float32, two-level ones multiplied out"""
    if t is None:
        return None
    values = _rows_by_8(t)
    return values.float() if base is None else k_scales.expand(values, _rows_by_8(base))


def _exact_halves(*tensors: torch.Tensor | None) -> bool:
    """Whether every value of the tensors converts to float16 and back unchanged"""
    return all(t is None or torch.equal(t.half().float(), t) for t in tensors)


def _words(codes: torch.Tensor) -> torch.Tensor:
    """I4/I8 codes as 4-byte words (one word: 4 bytes of one row, the unit row8 moves),
    through an aligned copy when the codes do not start on a 4-byte boundary"""
    if codes.storage_offset() % 4 or codes.data_ptr() % 4:
        codes = codes.clone()
    return codes.view(torch.int32)


def _groups_by_8(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """(rows, n_groups) row-major -> the same shape holding [rows/8][n_groups][8] in dtype, in one
    copy (no temporaries between the copies a model's experts make, so they stay few mappings)"""
    if t is None:
        return None
    rows, groups = t.shape
    out = torch.empty((rows, groups), dtype=dtype)
    out.view(rows // ROW8_ROWS, groups, ROW8_ROWS).copy_(t.view(rows // ROW8_ROWS, ROW8_ROWS, groups).transpose(1, 2))
    return out


def _rows_by_8(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    rows, groups = t.shape
    return t.reshape(rows // ROW8_ROWS, groups, ROW8_ROWS).transpose(1, 2).contiguous().reshape(rows, groups)


def pack_i4(q: torch.Tensor) -> torch.Tensor:
    """q (rows, cols) integers in 0..15 -> packed uint8 (rows, cols/2)."""
    rows, cols = q.shape
    blocks = q.to(torch.uint8).reshape(rows, cols // I4_BLOCK, 2, I4_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()


def unpack_i4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """packed uint8 (rows, cols/2) -> float q (rows, cols) in 0..15."""
    rows = packed.shape[0]
    blocks = packed.reshape(rows, cols // I4_BLOCK, I4_BLOCK // 2)
    low, high = blocks & 0x0F, blocks >> 4
    return torch.cat([low, high], dim=2).reshape(rows, cols).float()


def quantize_reference(w: torch.Tensor, fmt: Format, group: int, symmetric: bool = True) -> QMatrix:
    """Round-to-nearest quantization in plain torch: the reference the native
    quantizer is tested against, and the fallback for tiny tensors."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // group, group)
    if fmt == Format.I8:
        return _quantize_i8(g, rows, cols, group, symmetric)
    return _quantize_i4(g, rows, cols, group, symmetric)


def _quantize_i8(g, rows, cols, group, symmetric):
    if symmetric:
        scale = g.abs().amax(dim=2) / 127.0
        q = torch.round(g / _nonzero(scale)[..., None]).clamp(-127, 127)
        return QMatrix(Format.I8, rows, cols, q.to(torch.int8).reshape(rows, cols), group,
                       scale.contiguous())
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = (hi - lo) / 255.0
    mn = lo + 128.0 * scale
    q = torch.round((g - mn[..., None]) / _nonzero(scale)[..., None]).clamp(-128, 127)
    return QMatrix(Format.I8, rows, cols, q.to(torch.int8).reshape(rows, cols), group,
                   scale.contiguous(), mn.contiguous())


def _quantize_i4(g, rows, cols, group, symmetric):
    if symmetric:
        scale = _nearest_half(_signed_absmax(g) / -8.0)
        q = torch.round(g / _nonzero(scale)[..., None] + 8.0).clamp(0, 15)
        return QMatrix(Format.I4, rows, cols, pack_i4(q.reshape(rows, cols)), group,
                       scale.contiguous())
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = (hi - lo) / 15.0
    q = torch.round((g - lo[..., None]) / _nonzero(scale)[..., None]).clamp(0, 15)
    return QMatrix(Format.I4, rows, cols, pack_i4(q.reshape(rows, cols)), group,
                   scale.contiguous(), lo.contiguous())


def _signed_absmax(g: torch.Tensor) -> torch.Tensor:
    # Q4_0 style: the value of largest magnitude maps to q = 0 (i.e. -8), so the
    # full range -8..7 is used on the side that needs it.
    idx = g.abs().argmax(dim=2, keepdim=True)
    return torch.gather(g, 2, idx).squeeze(2)


def _nearest_half(t: torch.Tensor) -> torch.Tensor:
    """t rounded to the nearest float16 value (ties to even) where float16 holds it: symmetric I4
    scales, so the row8 layout keeps them in 16 bits. A weight moves by at most scale/256, or by 2^-22
    where the scale is below 2^-14 (a subnormal half)"""
    halves = t.half().float()
    return torch.where(torch.isfinite(halves), halves, t)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)
