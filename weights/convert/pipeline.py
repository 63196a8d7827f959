"""kt convert: one streamed pass from a HF checkpoint to a kt directory or a GGUF file.

  Source (headers) -> units (globals, layer 0..N-1) -> per unit: read tensor by tensor
  (private copies), dequantize FP8, quantize (native kernels / gguf.quants), write
  into a staging file -> journal entry with its checksum -> ... -> metadata, manifest,
  rename staging -> DST.

Peak memory is one unit's largest tensor set plus fixed overhead, whatever the model
size. An interrupted run resumes (--resume) after the last unit whose checksum verifies."""

import resource
import time
from pathlib import Path

import torch

from ..errors import WeightsError
from .journal import Journal, check_destination, check_free_disk, remove, replace_destination, source_fingerprint
from .options import ConvertOptions
from .progress import ConvertStart, ConvertSummary, NullSink, ProgressSink, UnitDone
from .source import Source
from .stats import ErrorStats


def convert(options: ConvertOptions, progress: ProgressSink | None = None, quantize=None) -> ConvertSummary:
    """quantize: (w f32 [rows, cols], fmt, group, symmetric) -> QMatrix; default: kt's
    native kernels with options.threads threads."""
    sink = progress or NullSink()
    source = Source(options.source)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)        # the heavy work runs in the native pool; torch only converts dtypes
    try:
        return _run(options, source, sink, quantize)
    finally:
        torch.set_num_threads(torch_threads)
        source.close()


def _run(options: ConvertOptions, source: Source, sink: ProgressSink, quantize) -> ConvertSummary:
    started = time.perf_counter()
    units, skipped = source.plan_units()
    target, threads = _target(options, source, quantize, units)
    check_destination(options.destination, target.staging, options.resume, options.force)
    fingerprint = source_fingerprint(source.files(), options.fingerprint())
    fresh = not (options.resume and target.journal_path.exists())
    journal = Journal(target.journal_path, fingerprint) if fresh else Journal.load(target.journal_path, fingerprint)
    estimate = sum(target.estimate(u) for u in units)
    free = check_free_disk(options.destination.parent, estimate - target.done_bytes(journal))
    done = target.begin(units, journal)
    sink.start(ConvertStart(len(units), sum(u.source_bytes for u in units), estimate, free, len(done), threads))
    stats = ErrorStats()
    try:
        _convert_units(units, done, target, journal, stats, sink)
        target.finalize(units, journal)
    except WeightsError:
        if not done:
            remove(target.staging)
            remove(target.journal_path)
        raise
    except OSError as err:
        raise WeightsError(f"{options.destination}: writing failed ({err.strerror or err}); the finished "
                           f"layers are kept in {target.staging}: fix the cause and rerun with --resume") from None
    replace_destination(target.staging, options.destination)
    notes = getattr(target, "notes", [])
    return _summary(options, source, units, done, stats, started, skipped, notes)


def _target(options: ConvertOptions, source: Source, quantize, units):
    if options.to == "gguf":
        from .gguf_target import GGUFTarget

        return GGUFTarget(source, options, units), 1
    if quantize is None:
        from kt_cli import kernels
        from kt_cli.ops import Ops

        ops = Ops(kernels.load(), options.threads)
        quantize, threads = ops.quantize, ops.threads
    else:
        threads = options.threads or 1
    from .kt_target import KTTarget

    return KTTarget(source, options, quantize), threads


def _convert_units(units, done, target, journal, stats, sink) -> None:
    for unit in units:
        if unit.name in done:
            stats.merge(journal.units[unit.name].get("max_rel_error", {}))
            sink.unit_done(UnitDone(unit.index, unit.name, unit.source_bytes,
                                    journal.units[unit.name]["size"], 0.0, True))
            continue
        t0 = time.perf_counter()
        unit_stats = ErrorStats()
        record = target.write(unit, unit_stats)
        record["max_rel_error"] = unit_stats.max_rel
        journal.record(unit.name, record)
        stats.merge(unit_stats.max_rel)
        sink.unit_done(UnitDone(unit.index, unit.name, unit.source_bytes, record["size"],
                                time.perf_counter() - t0, False))


def _summary(options, source, units, done, stats, started, skipped, notes) -> ConvertSummary:
    seconds = time.perf_counter() - started
    read = sum(u.source_bytes for u in units if u.name not in done)
    out = _output_size(options.destination)
    notes = list(notes) + ([f"skipped {len(skipped)} tensors of layers past num_hidden_layers"] if skipped else [])
    return ConvertSummary(str(source.directory), str(options.destination), options.format_name,
                          source.architecture, len(units), len(done), sum(u.source_bytes for u in units),
                          out, seconds, read / 1e6 / max(seconds, 1e-9),
                          peak_rss_bytes(),
                          dict(sorted(stats.max_rel.items())), notes)


def peak_rss_bytes(status: Path = Path("/proc/self/status")) -> int:
    """This process's own peak resident set (Linux VmHWM). ru_maxrss is not that: Linux
    carries it over fork and exec, so `kt convert` started by a process that once held
    10 GB reported a 10 GB peak of its own while it never passed 1 GB."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _output_size(path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
