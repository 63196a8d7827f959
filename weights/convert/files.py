"""Output files written safely: temporary names then rename, running sha256,
atomic JSON, and a streaming safetensors writer whose header is planned before
any data exists, so a file is written tensor by tensor without holding it."""

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import WeightsError

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8",
             torch.uint8: "U8"}
ST_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1}
CHUNK = 1 << 22


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ST_ITEMSIZE[self.dtype]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


class SafetensorsStream:
    """Writes `specs` in order to `path` + ".tmp"; finish() renames it to `path`
    and returns (sha256, size)."""

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str]) -> None:
        self.path, self.specs, self.next = Path(path), specs, 0
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.digest = hashlib.sha256()
        self.f = open(self.tmp, "wb")
        self._put(_header(specs, metadata))

    def write(self, name: str, t: torch.Tensor) -> None:
        spec = self.specs[self.next] if self.next < len(self.specs) else None
        if spec is None or spec.name != name or ST_DTYPES.get(t.dtype) != spec.dtype \
                or tuple(t.shape) != spec.shape:
            raise WeightsError(f"{self.path}: internal error: tensor {name!r} {t.dtype} {list(t.shape)} "
                               f"does not match the planned {spec}")
        self._put(tensor_bytes(t))
        self.next += 1

    def finish(self) -> tuple[str, int]:
        if self.next != len(self.specs):
            raise WeightsError(f"{self.path}: internal error: {len(self.specs) - self.next} tensors unwritten")
        self.f.flush()
        os.fsync(self.f.fileno())
        size = self.f.tell()
        self.f.close()
        os.replace(self.tmp, self.path)
        return self.digest.hexdigest(), size

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)

    def _put(self, data) -> None:
        self.digest.update(data)
        self.f.write(data)


def _header(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def planned_size(specs: list[TensorSpec], metadata: dict[str, str]) -> int:
    return len(_header(specs, metadata)) + sum(s.nbytes for s in specs)
