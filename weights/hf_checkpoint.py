"""A Hugging Face model directory: config.json plus model.safetensors, or shards
listed in model.safetensors.index.json. FP8 weights with block
`weight_scale_inv` (or per-channel `weight_scale`) are dequantized on read; the
scale tensors are not listed among the names. streaming=True reads private
copies (pread) instead of views of the mapping, so a converter that walks the
whole model keeps only what it holds resident."""

import json
from pathlib import Path

import torch

from .checkpoint import Checkpoint, architecture_of, read_config
from .errors import WeightsError
from .fp8 import block_size_from_config, dequantize_fp8_blocks, dequantize_fp8_channels
from .layout import Format, QMatrix
from .safetensors_file import SafetensorsFile, TensorEntry

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP8_SCALE_SUFFIX = "_scale_inv"
FP8_CHANNEL_SCALE_SUFFIX = "_scale"
_MATRIX_FORMATS = {"F32": Format.F32, "BF16": Format.BF16, "F16": Format.F16}
_FP8_DTYPES = ("F8_E4M3",)


class HFCheckpoint(Checkpoint):
    def __init__(self, directory: Path, streaming: bool = False) -> None:
        self.path = Path(directory)
        self.streaming = streaming
        self.config = read_config(self.path)
        self.architecture = architecture_of(self.config, self.path / "config.json")
        self._files = _open_files(self.path)
        self._owner = _tensor_owners(self.path, self._files)
        self._names = {n: None for n in self._owner if not _is_fp8_scale(n, self._owner)}
        self._fp8_block = None

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as err:
            raise WeightsError(f"{self.path}: cannot load the tokenizer ({err})") from None

    def entry(self, name: str) -> TensorEntry:
        """dtype and shape as stored (FP8 scales not included)."""
        self._require(name)
        return self._owner[name].entries[name]

    def stored_bytes(self, name: str) -> int:
        """Bytes of the tensor in its files, its FP8 scale tensors included."""
        total = 0
        for full in (name, name + FP8_SCALE_SUFFIX, name + FP8_CHANNEL_SCALE_SUFFIX):
            if full in self._owner:
                entry = self._owner[full].entries[full]
                total += entry.end - entry.begin
        return total

    def files(self) -> list[Path]:
        return [f.path for f in self._files.values()]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files, self._owner, self._names = {}, {}, {}

    def _raw(self, name: str) -> torch.Tensor:
        owner = self._owner[name]
        return owner.read(name) if self.streaming else owner.tensor(name)

    def _dtype(self, name: str) -> str:
        return self._owner[name].entries[name].dtype

    def _load_tensor(self, name: str) -> torch.Tensor:
        if self._dtype(name) in _FP8_DTYPES:
            return self._dequantize_fp8(name, torch.float32)
        return self._raw(name).float()

    def _load_matrix(self, name: str) -> QMatrix:
        dtype, shape = self._dtype(name), self._owner[name].entries[name].shape
        where = f"{self._owner[name].path}: tensor {name!r}"
        if len(shape) != 2:
            raise WeightsError(f"{where} has shape {list(shape)}, a matrix must be 2-D")
        if dtype in _FP8_DTYPES:
            return QMatrix(Format.BF16, *shape, self._dequantize_fp8(name, torch.bfloat16))
        if dtype not in _MATRIX_FORMATS:
            raise WeightsError(f"{where} has dtype {dtype}, not a supported matrix format "
                               f"({', '.join([*_MATRIX_FORMATS, *_FP8_DTYPES])})")
        return QMatrix(_MATRIX_FORMATS[dtype], *shape, self._raw(name))

    def _dequantize_fp8(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        scale_name = name + FP8_SCALE_SUFFIX
        if scale_name not in self._owner and name + FP8_CHANNEL_SCALE_SUFFIX in self._owner:
            return self._dequantize_fp8_channels(name, dtype)
        if scale_name not in self._owner:
            raise WeightsError(f"{self._owner[name].path}: FP8 tensor {name!r} has no {scale_name!r}")
        if self._fp8_block is None:
            self._fp8_block = block_size_from_config(self.config)
        try:
            return dequantize_fp8_blocks(self._raw(name), self._raw(scale_name), self._fp8_block, dtype)
        except WeightsError as err:
            raise WeightsError(f"{self._owner[name].path}: tensor {name!r}: {err}") from None

    def _dequantize_fp8_channels(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        try:
            return dequantize_fp8_channels(self._raw(name), self._raw(name + FP8_CHANNEL_SCALE_SUFFIX), dtype)
        except WeightsError as err:
            raise WeightsError(f"{self._owner[name].path}: tensor {name!r}: {err}") from None

    def _stacked_experts(self, layer: int, proj: str) -> list[QMatrix] | None:
        prefix = f"model.layers.{layer}.mlp.experts."
        name = prefix + ("down_proj" if proj == "down" else "gate_up_proj")
        if name not in self._owner:
            return None
        stacked = self._stacked_tensor(name)
        if proj == "down":
            return [_as_matrix(stacked[e], name) for e in range(stacked.shape[0])]
        half = _gate_up_half(stacked, name, self._owner[name].path)
        rows = slice(0, half) if proj == "gate" else slice(half, 2 * half)
        return [_as_matrix(stacked[e, rows], name) for e in range(stacked.shape[0])]

    def _stacked_tensor(self, name: str) -> torch.Tensor:
        if self._dtype(name) in _FP8_DTYPES:
            return self._dequantize_fp8(name, torch.bfloat16)
        if len(self._owner[name].entries[name].shape) != 3:
            raise WeightsError(f"{self._owner[name].path}: fused experts {name!r} are not 3-D")
        return self._raw(name)


def _gate_up_half(stacked: torch.Tensor, name: str, path: Path) -> int:
    # transformers' fused experts: gate_up_proj [E, 2I, H], gate = rows [0, I), up = [I, 2I)
    if stacked.shape[1] % 2:
        raise WeightsError(f"{path}: fused {name!r} has an odd row count {stacked.shape[1]}")
    return stacked.shape[1] // 2


def _as_matrix(t: torch.Tensor, name: str) -> QMatrix:
    formats = {torch.float32: Format.F32, torch.bfloat16: Format.BF16, torch.float16: Format.F16}
    if t.dtype not in formats:
        raise WeightsError(f"fused experts {name!r} have dtype {t.dtype}, not a matrix format")
    return QMatrix(formats[t.dtype], t.shape[0], t.shape[1], t)


def _open_files(directory: Path) -> dict[str, SafetensorsFile]:
    index = directory / INDEX_FILE
    if index.is_file():
        shards = sorted(set(_read_weight_map(index).values()))
    elif (directory / SINGLE_FILE).is_file():
        shards = [SINGLE_FILE]
    else:
        shards = sorted(p.name for p in directory.glob("*.safetensors"))
    if not shards:
        raise WeightsError(f"{directory}: no {SINGLE_FILE}, {INDEX_FILE} or other .safetensors file")
    for shard in shards:
        if not (directory / shard).is_file():
            raise WeightsError(f"{index}: missing shard {shard} listed in the index")
    return {shard: SafetensorsFile(directory / shard) for shard in shards}


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        raise WeightsError(f"{index}: not a valid safetensors index ({err})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightsError(f"{index}: has no 'weight_map' of tensor name -> shard file")
    return weight_map


def _tensor_owners(directory: Path, files: dict[str, SafetensorsFile]) -> dict[str, SafetensorsFile]:
    owners: dict[str, SafetensorsFile] = {}
    for f in files.values():
        for name in f.names():
            owners.setdefault(name, f)
    index = directory / INDEX_FILE
    if index.is_file():
        for name, shard in _read_weight_map(index).items():
            if name not in files[shard].entries:
                raise WeightsError(f"{directory / shard}: tensor {name!r} listed in the index is missing")
    return owners


def _is_fp8_scale(name: str, owners: dict) -> bool:
    for suffix in (FP8_SCALE_SUFFIX, FP8_CHANNEL_SCALE_SUFFIX):
        if name.endswith(suffix) and name[: -len(suffix)] in owners:
            return owners[name[: -len(suffix)]].entries[name[: -len(suffix)]].dtype in _FP8_DTYPES
    return name.endswith(".input_scale")
