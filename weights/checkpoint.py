"""Checkpoints the engine loads from: `open_checkpoint(path)` takes a Hugging Face
model directory, a kt directory written by `kt convert` (weights/ktformat.py), a
.gguf file or a HF repo id already in the local cache, and
returns a Checkpoint that hands out tensors under HF names:

  tensor(name)          float32 copy in HF shape (small tensors, references)
  matrix(name)          QMatrix in the stored format, zero-copy where possible
  experts(layer, proj)  routed experts of one layer as QMatrix (out, in)
"""

import json
from pathlib import Path

import torch

from .errors import WeightsError
from .layout import QMatrix

EXPERT_PROJS = ("gate", "up", "down")
MIXTRAL_EXPERT_KEYS = {"gate": "w1", "up": "w3", "down": "w2"}


class Checkpoint:
    """The API the model code reads weights through; subclasses supply the
    storage (`_load_tensor`, `_load_matrix`, `_stacked_experts`)."""

    path: Path
    config: dict
    architecture: str

    def names(self) -> list[str]:
        return list(self._names)

    def has(self, name: str) -> bool:
        return name in self._names

    def tensor(self, name: str) -> torch.Tensor:
        self._require(name)
        return self._load_tensor(name)

    def matrix(self, name: str) -> QMatrix:
        self._require(name)
        return self._load_matrix(name)

    def experts(self, layer: int, proj: str) -> list[QMatrix]:
        if proj not in EXPERT_PROJS:
            raise WeightsError(f"{self.path}: expert projection {proj!r} is not one of {EXPERT_PROJS}")
        per_expert = self._per_expert_names(layer, proj)
        if per_expert:
            return [self._load_matrix(name) for name in per_expert]
        stacked = self._stacked_experts(layer, proj)
        if stacked is None:
            raise WeightsError(f"{self.path}: layer {layer} has no routed experts for {proj!r}")
        return stacked

    def tokenizer(self):
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _require(self, name: str) -> None:
        if name not in self._names:
            raise WeightsError(f"{self.path}: no tensor named {name!r} in the checkpoint")

    def _per_expert_names(self, layer: int, proj: str) -> list[str]:
        for template in _expert_name_templates(layer, proj):
            names = []
            while self.has(template.format(E=len(names))):
                names.append(template.format(E=len(names)))
            if names:
                return names
        return []

    def _stacked_experts(self, layer: int, proj: str) -> list[QMatrix] | None:
        return None

    def _load_tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def _load_matrix(self, name: str) -> QMatrix:
        raise NotImplementedError


def _expert_name_templates(layer: int, proj: str) -> list[str]:
    return [
        f"model.layers.{layer}.mlp.experts.{{E}}.{proj}_proj.weight",
        f"model.layers.{layer}.block_sparse_moe.experts.{{E}}.{MIXTRAL_EXPERT_KEYS[proj]}.weight",
    ]


def architecture_of(config: dict, where: Path) -> str:
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise WeightsError(f"{where}: config.json has no 'architectures' list")
    return archs[0]


def open_checkpoint(path: str | Path) -> Checkpoint:
    local = Path(path).expanduser()
    if local.is_file():
        return _gguf_file(local)
    if local.is_dir():
        if (local / "kt_format.json").exists():
            return _kt_directory(local)
        return _hf_directory(local) if (local / "config.json").exists() else _single_gguf(local)
    if _looks_like_repo_id(str(path)):
        return open_checkpoint(_resolve_cached_repo(str(path)))
    raise WeightsError(f"{path}: no such file or directory (and not a cached Hugging Face repo id)")


def _hf_directory(directory: Path) -> Checkpoint:
    from .hf_checkpoint import HFCheckpoint

    return HFCheckpoint(directory)


def _kt_directory(directory: Path) -> Checkpoint:
    from .ktformat import KTCheckpoint

    return KTCheckpoint(directory)


def _gguf_file(path: Path) -> Checkpoint:
    from .gguf_checkpoint import GGUFCheckpoint

    if path.suffix != ".gguf":
        raise WeightsError(f"{path}: not a .gguf file; give the model directory for safetensors")
    return GGUFCheckpoint(path)


def _single_gguf(directory: Path) -> Checkpoint:
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) == 1:
        return _gguf_file(ggufs[0])
    raise WeightsError(f"{directory}: missing config.json (not a Hugging Face model directory)")


def _looks_like_repo_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~"))


def _resolve_cached_repo(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as err:  # the hub raises several types for "not cached" and bad ids
        raise WeightsError(f"{repo_id}: not found in the local Hugging Face cache "
                           f"({type(err).__name__}); download it first") from None


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise WeightsError(f"{directory}: missing config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{path}: not a JSON object")
    return config
