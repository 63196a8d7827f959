"""A minimal GGUF (v2/v3, little-endian) parser: metadata as Python values and
tensors as numpy views of one copy-on-write memory map. gguf's own GGUFReader
builds a numpy view per array item, which takes seconds on a 50k-token vocab;
this reads the header with struct and validates every tensor against the file.

Layout: "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv x (string key,
u32 type, value); n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 type,
u64 offset); padding to general.alignment (default 32); tensor data. ne[0] is
the contiguous dimension, so the numpy shape is ne reversed. Strings are a u64
length then UTF-8 bytes.
"""

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import WeightsError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY_ELEMENT = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                  "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: np.ndarray, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise WeightsError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise WeightsError(f"{self.path}: truncated GGUF header (string of {n} bytes at {self.pos})")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise WeightsError(f"{self.path}: unknown GGUF metadata type {kind} at byte {self.pos}")

    def array(self):
        kind, count = self.unpack("<I"), self.unpack("<Q")
        if kind in _SCALARS:
            dtype = np.dtype(_SCALARS[kind])
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise WeightsError(f"{self.path}: truncated GGUF metadata array at byte {self.pos}")
            values = np.frombuffer(self.buf[self.pos:end].tobytes(), dtype=dtype)
            self.pos = end
            return values.tolist()
        return [self.value(kind) for _ in range(count)]


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 24:
            raise WeightsError(f"{self.path}: not a GGUF file ({size} bytes)")
        try:
            self._buf = np.memmap(self.path, dtype=np.uint8, mode="c")
        except (OSError, ValueError) as err:
            raise WeightsError(f"{self.path}: cannot map the file ({err})") from None
        cursor = _Cursor(self._buf, self.path)
        n_tensors, n_kv = self._read_preamble(cursor)
        self.metadata = {cursor.string(): cursor.value(cursor.unpack("<I")) for _ in range(n_kv)}
        infos = [self._read_tensor_info(cursor) for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cursor.pos // alignment) * alignment
        self.tensors = {info[0]: self._tensor(data_start, *info) for info in infos}

    def _read_preamble(self, cursor: _Cursor) -> tuple[int, int]:
        if len(self._buf) < 24 or bytes(self._buf[:4]) != b"GGUF":
            raise WeightsError(f"{self.path}: not a GGUF file (bad magic)")
        cursor.pos = 4
        version = cursor.unpack("<I")
        if version not in (2, 3):
            endian = " (big-endian files are not supported)" if version >= 1 << 16 else ""
            raise WeightsError(f"{self.path}: unsupported GGUF version {version}{endian}")
        return cursor.unpack("<Q"), cursor.unpack("<Q")

    def _read_tensor_info(self, cursor: _Cursor):
        name = cursor.string()
        n_dims = cursor.unpack("<I")
        if not 1 <= n_dims <= 4:
            raise WeightsError(f"{self.path}: tensor {name!r} has {n_dims} dimensions")
        ne = [cursor.unpack("<Q") for _ in range(n_dims)]
        type_id, offset = cursor.unpack("<I"), cursor.unpack("<Q")
        try:
            type_name = GGMLQuantizationType(type_id).name
        except ValueError:
            raise WeightsError(f"{self.path}: tensor {name!r} has unknown GGML type id {type_id}") from None
        return name, type_name, type_id, tuple(reversed(ne)), offset

    def _tensor(self, data_start: int, name: str, type_name: str, type_id: int,
                shape: tuple[int, ...], offset: int) -> GGUFTensor:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        if shape[-1] % block:
            raise WeightsError(f"{self.path}: tensor {name!r} row of {shape[-1]} is not a multiple "
                               f"of the {type_name} block of {block}")
        nbytes = int(np.prod(shape)) // block * block_bytes
        begin = data_start + offset
        if begin + nbytes > len(self._buf):
            raise WeightsError(f"{self.path}: tensor {name!r} data [{begin}, {begin + nbytes}) is beyond "
                               f"the end of the file ({len(self._buf)} bytes): truncated")
        raw = self._buf[begin:begin + nbytes]
        if type_name in _NUMPY_ELEMENT:
            data = raw.view(_NUMPY_ELEMENT[type_name]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], shape[-1] // block * block_bytes)
        return GGUFTensor(name, type_name, shape, data)
