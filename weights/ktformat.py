"""The kt checkpoint directory written by `kt convert --to int8|int4|bf16`, and
its reader. The engine loads it through open_checkpoint like any other.

  kt_format.json    {"layout": "kt-q1", "version": 1, "format": "int4", "group_size": 64,
                     "symmetric": true, "experts_only": false, "architecture": ...,
                     "files": ["globals.safetensors", "layers/layer-00000.safetensors", ...]}
  manifest.json     {"files": {relative path: {"sha256": hex, "size": bytes}}}
  config.json       the source's (minus its quantization_config), tokenizer files copied
  *.safetensors     one file for the non-layer weights, one per decoder layer

Inside a safetensors file a matrix stored in kt-q1 is up to three tensors:
`NAME` (data), `NAME.scale`, `NAME.min`, all in the layout of weights/layout.py; the
file's `__metadata__["kt_matrices"]` (JSON) maps NAME -> {format, rows, cols, group}.
Tensors not in that table are plain float tensors. Routed experts are stored one
matrix per expert under `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`.
Nothing depends on the converting machine's thread or NUMA count.
"""

import json
from pathlib import Path

import torch

from .checkpoint import Checkpoint, architecture_of, read_config
from .errors import WeightsError
from .layout import LAYOUT_TAG, LAYOUT_VERSION, Format, QMatrix
from .safetensors_file import SafetensorsFile

FORMAT_FILE = "kt_format.json"
MANIFEST_FILE = "manifest.json"
MATRICES_KEY = "kt_matrices"
COMPANIONS = ("scale", "min")
EXPERT_NAME = "model.layers.{L}.mlp.experts.{E}.{P}_proj.weight"
FORMAT_NAMES = {"int8": Format.I8, "int4": Format.I4, "bf16": Format.BF16}


def is_kt_directory(path: Path) -> bool:
    return (Path(path) / FORMAT_FILE).is_file()


def read_format_file(directory: Path) -> dict:
    path = Path(directory) / FORMAT_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("layout") != LAYOUT_TAG:
        raise WeightsError(f"{path}: not a kt checkpoint (layout tag is not {LAYOUT_TAG!r})")
    if meta.get("version") != LAYOUT_VERSION:
        raise WeightsError(f"{path}: kt layout version {meta.get('version')!r} is not supported "
                           f"(this kt reads version {LAYOUT_VERSION}); convert the model again")
    if not isinstance(meta.get("files"), list) or not all(isinstance(f, str) for f in meta["files"]):
        raise WeightsError(f"{path}: has no 'files' list")
    return meta


def matrix_entry(m: QMatrix) -> dict:
    if m.in_memory_layout:
        raise WeightsError("a tiled or row8 matrix is an in-memory layout: bring it back to rows before writing")
    return {"format": m.format.name, "rows": m.rows, "cols": m.cols, "group": m.group}


class KTCheckpoint(Checkpoint):
    def __init__(self, directory: Path) -> None:
        self.path = Path(directory)
        self.meta = read_format_file(self.path)
        self.config = read_config(self.path)
        self.architecture = architecture_of(self.config, self.path / "config.json")
        self._files = [_open_part(self.path, rel) for rel in self.meta["files"]]
        self._matrices: dict[str, tuple[SafetensorsFile, dict]] = {}
        self._plain: dict[str, SafetensorsFile] = {}
        for f in self._files:
            self._index(f)
        self._names = dict.fromkeys([*self._matrices, *self._plain])

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as err:
            raise WeightsError(f"{self.path}: cannot load the tokenizer ({err})") from None

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files, self._matrices, self._plain, self._names = [], {}, {}, {}

    def _index(self, f: SafetensorsFile) -> None:
        table = _matrix_table(f)
        companions = {f"{name}.{c}" for name in table for c in COMPANIONS}
        for name, entry in table.items():
            if name not in f.entries:
                raise WeightsError(f"{f.path}: matrix {name!r} is listed but its data is missing")
            self._matrices[name] = (f, entry)
        for name in f.names():
            if name not in table and name not in companions:
                self._plain[name] = f

    def _load_tensor(self, name: str) -> torch.Tensor:
        if name in self._plain:
            return self._plain[name].tensor(name).float()
        return self._load_matrix(name).dequantize()

    def _load_matrix(self, name: str) -> QMatrix:
        if name not in self._matrices:
            return _float_matrix(self._plain[name], name)
        f, entry = self._matrices[name]
        parts = {c: f.tensor(f"{name}.{c}") if f"{name}.{c}" in f.entries else None for c in COMPANIONS}
        try:
            return QMatrix(Format[entry["format"]], entry["rows"], entry["cols"], f.tensor(name),
                           entry["group"], parts["scale"], parts["min"])
        except (KeyError, TypeError, WeightsError) as err:
            raise WeightsError(f"{f.path}: matrix {name!r} does not match its kt-q1 entry ({err})") from None


def _float_matrix(f: SafetensorsFile, name: str) -> QMatrix:
    t = f.tensor(name)
    formats = {torch.float32: Format.F32, torch.bfloat16: Format.BF16, torch.float16: Format.F16}
    if t.dim() != 2 or t.dtype not in formats:
        raise WeightsError(f"{f.path}: tensor {name!r} ({t.dtype}, {list(t.shape)}) is not a matrix")
    return QMatrix(formats[t.dtype], t.shape[0], t.shape[1], t)


def _matrix_table(f: SafetensorsFile) -> dict:
    raw = f.metadata.get(MATRICES_KEY, "{}")
    try:
        table = json.loads(raw)
    except (TypeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{f.path}: metadata {MATRICES_KEY!r} is not valid JSON ({err})") from None
    if not isinstance(table, dict):
        raise WeightsError(f"{f.path}: metadata {MATRICES_KEY!r} is not a JSON object")
    return table


def _open_part(directory: Path, rel: str) -> SafetensorsFile:
    path = directory / rel
    if not path.is_file():
        raise WeightsError(f"{directory}: kt checkpoint file {rel} listed in {FORMAT_FILE} is missing")
    return SafetensorsFile(path)
