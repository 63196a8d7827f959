"""The progress journal of one conversion: which units are complete, with the
checksum of what they wrote, so --resume can verify them and continue from
there. Also the destination rules: refuse to overwrite without --force, replace
atomically at the end, check free disk first."""

import json
import os
import shutil
from pathlib import Path

from ..errors import WeightsError
from .files import write_json_atomic

DISK_MARGIN = 16 << 20


class Journal:
    def __init__(self, path: Path, fingerprint: dict, units: dict | None = None, extra: dict | None = None):
        self.path, self.fingerprint = path, fingerprint
        self.units: dict[str, dict] = units or {}
        self.extra: dict = extra or {}

    @classmethod
    def load(cls, path: Path, fingerprint: dict) -> "Journal":
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return cls(path, fingerprint)
        if not isinstance(data, dict) or data.get("fingerprint") != fingerprint:
            raise WeightsError(f"{path}: the interrupted conversion used another source or other options; "
                               "rerun with the same options, or use --force to start over")
        return cls(path, fingerprint, data.get("units") or {}, data.get("extra") or {})

    def record(self, unit: str, entry: dict) -> None:
        self.units[unit] = entry
        self.save()

    def forget_from(self, keep: list[str]) -> None:
        self.units = {k: v for k, v in self.units.items() if k in keep}
        self.save()

    def save(self) -> None:
        write_json_atomic(self.path, {"fingerprint": self.fingerprint, "units": self.units,
                                      "extra": self.extra})


def source_fingerprint(files: list[Path], options: dict) -> dict:
    listing = {}
    for f in files:
        st = f.stat()
        listing[f.name] = [st.st_size, st.st_mtime_ns]
    return {"options": options, "files": listing}


def check_destination(dst: Path, staging: Path, resume: bool, force: bool) -> None:
    if dst.exists() and not force:
        raise WeightsError(f"{dst}: already exists; pass --force to replace it")
    if staging.exists() and not resume and not force:
        raise WeightsError(f"{staging}: an interrupted conversion is here; pass --resume to continue it "
                           "or --force to start over")
    if staging.exists() and not resume:
        remove(staging)
    if not dst.parent.exists():
        dst.parent.mkdir(parents=True)


def check_free_disk(where: Path, needed: int) -> int:
    free = shutil.disk_usage(where).free
    if needed + DISK_MARGIN > free:
        raise WeightsError(f"{where}: not enough free disk: the output needs about {needed / 1e6:.1f} MB, "
                           f"{free / 1e6:.1f} MB are free")
    return free


def replace_destination(staging: Path, dst: Path) -> None:
    old = dst.with_name(dst.name + ".kt-old")
    if dst.exists():
        remove(old)
        os.replace(dst, old)
    os.replace(staging, dst)
    remove(old)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
