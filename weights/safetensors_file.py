"""One .safetensors file, memory-mapped: tensors are views of the mapping, never
copies. The header is validated against the file size before anything is read.

File layout: u64 little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}},
then the data; offsets are relative to the first byte after the header.
"""

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import WeightsError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_ITEMSIZE = {name: torch.empty(0, dtype=dt).element_size() for name, dt in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        size = _file_size(self.path)
        header_len = _read_header_length(self.path, size)
        self.entries, self.metadata = _parse_header(self.path, header_len, size - 8 - header_len)
        self._data_start = 8 + header_len
        self._bytes = np.memmap(self.path, dtype=np.uint8, mode="c") if size > 0 else None

    def names(self) -> list[str]:
        return list(self.entries)

    def tensor(self, name: str) -> torch.Tensor:
        """A view of the mapping in the stored dtype and shape (copy-on-write:
        writing to it never touches the file)."""
        entry = self.entries[name]
        if entry.end == entry.begin:
            return torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
        raw = self._bytes[self._data_start + entry.begin:self._data_start + entry.end]
        return torch.from_numpy(raw).view(DTYPES[entry.dtype]).reshape(entry.shape)

    def read(self, name: str) -> torch.Tensor:
        """A private copy of the tensor read with pread: unlike views of the
        mapping, it leaves no file pages in this process's resident set."""
        entry = self.entries[name]
        out = torch.empty(entry.end - entry.begin, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self._data_start + entry.begin)
            got = f.readinto(out.numpy())
        if got != entry.end - entry.begin:
            raise WeightsError(f"{self.path}: tensor {name!r} is cut short ({got} of "
                               f"{entry.end - entry.begin} bytes; file truncated?)")
        return out.view(DTYPES[entry.dtype]).reshape(entry.shape)

    def close(self) -> None:
        self._bytes = None


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as err:
        raise WeightsError(f"{path}: cannot read ({err.strerror})") from None


def _read_header_length(path: Path, size: int) -> int:
    if size < 8:
        raise WeightsError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    if header_len > size - 8:
        raise WeightsError(f"{path}: truncated safetensors file: header length {header_len} "
                           f"is beyond the file size {size}")
    return header_len


def _parse_header(path: Path, header_len: int, data_size: int) -> tuple[dict[str, TensorEntry], dict]:
    with open(path, "rb") as f:
        f.seek(8)
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{path}: safetensors header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise WeightsError(f"{path}: safetensors __metadata__ is not a JSON object")
    return {name: _entry(path, name, info, data_size) for name, info in header.items()}, metadata


def _entry(path: Path, name: str, info, data_size: int) -> TensorEntry:
    try:
        dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        ints_ok = all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end))
    except (KeyError, TypeError, ValueError):
        raise WeightsError(f"{path}: tensor {name!r} has a malformed header entry") from None
    if dtype not in DTYPES:
        raise WeightsError(f"{path}: tensor {name!r} has unsupported dtype {dtype} "
                           f"(supported: {', '.join(DTYPES)})")
    if not ints_ok or begin > end or end > data_size:
        raise WeightsError(f"{path}: tensor {name!r} data offsets [{begin}, {end}] are out of "
                           f"range (data section is {data_size} bytes; file truncated?)")
    if end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
        raise WeightsError(f"{path}: tensor {name!r} dtype/shape mismatch: {dtype} {list(shape)} "
                           f"needs {math.prod(shape) * _ITEMSIZE[dtype]} bytes, entry has {end - begin}")
    return TensorEntry(dtype, shape, begin, end)
