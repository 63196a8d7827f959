"""The progress interface the converter reports through (the CLI draws a rich
progress bar from it), the end-of-run summary, and a plain text sink."""

import sys
from dataclasses import asdict, dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ConvertStart:
    units: int
    source_bytes: int
    estimated_output_bytes: int
    free_disk_bytes: int
    resumed_units: int
    threads: int


@dataclass(frozen=True)
class UnitDone:
    index: int
    name: str
    source_bytes: int
    output_bytes: int
    seconds: float
    resumed: bool


class ProgressSink(Protocol):
    def start(self, info: ConvertStart) -> None: ...
    def unit_done(self, unit: UnitDone) -> None: ...


@dataclass
class ConvertSummary:
    source: str
    destination: str
    format: str
    architecture: str
    units: int
    resumed_units: int
    source_bytes: int
    output_bytes: int
    seconds: float
    read_mb_per_s: float
    peak_rss_bytes: int
    max_rel_error: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summary_table_rows(summary: ConvertSummary) -> list[tuple[str, str]]:
    s = summary
    rows = [("source", s.source), ("destination", s.destination), ("format", s.format),
            ("architecture", s.architecture),
            ("units", f"{s.units} ({s.resumed_units} resumed)" if s.resumed_units else str(s.units)),
            ("size in", _mb(s.source_bytes)), ("size out", _mb(s.output_bytes)),
            ("time", f"{s.seconds:.1f} s"), ("throughput", f"{s.read_mb_per_s:.1f} MB/s of source read"),
            ("peak RSS", _mb(s.peak_rss_bytes))]
    rows += [(f"max rel error {kind}", f"{err:.2e}") for kind, err in sorted(s.max_rel_error.items())]
    rows += [("note", note) for note in s.notes]
    return rows


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


class TextSink:
    """One line per unit on stderr (the argparse entry point's sink)."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.total = 0

    def start(self, info: ConvertStart) -> None:
        self.total = info.units
        print(f"converting {info.units} units, {_mb(info.source_bytes)} in, about "
              f"{_mb(info.estimated_output_bytes)} out ({_mb(info.free_disk_bytes)} free), "
              f"{info.threads} threads", file=self.stream, flush=True)

    def unit_done(self, unit: UnitDone) -> None:
        how = "verified" if unit.resumed else f"{unit.seconds:.2f} s, " \
              f"{unit.source_bytes / 1e6 / max(unit.seconds, 1e-9):.0f} MB/s"
        print(f"[{unit.index + 1}/{self.total}] {unit.name}: {_mb(unit.output_bytes)} ({how})",
              file=self.stream, flush=True)


class NullSink:
    def start(self, info: ConvertStart) -> None:
        pass

    def unit_done(self, unit: UnitDone) -> None:
        pass
