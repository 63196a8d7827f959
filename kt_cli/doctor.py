"""`kt doctor`: facts about this host gathered into one report, plus checks as
data (name, status, detail, hint). Nothing here prints; cli.py renders.

The JSON form is a stable interface (schema "kt.doctor/1", documented in README)."""

import platform
import sys
from dataclasses import asdict, dataclass, field

from . import __version__, hardware, kernels, store
from .errors import KtError

SCHEMA = "kt.doctor/1"
REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                  "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
MEMBW_PROBE_BYTES = 256 << 20
# Bytes a decode step streams (active parameters at their stored width) for models people run.
EXPECTATIONS = (
    ("SmolLM2-135M-Instruct Q4_1 (default model)", 135e6 * 5.0 / 8),
    ("Qwen3-30B-A3B INT4 (3.3B active)", 3.3e9 * 4.5 / 8),
    ("DeepSeek-V3 INT4 (37B active)", 37e9 * 4.5 / 8),
)
DECODE_EFFICIENCY = 0.75


@dataclass
class Check:
    name: str
    status: str          # "ok" | "warn" | "error"
    detail: str
    hint: str = ""


@dataclass
class Report:
    schema: str
    ok: bool
    versions: dict
    cpu: dict
    kernels: dict
    memory: dict
    gpus: dict
    storage: dict
    expected: list
    checks: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def run(measure_bandwidth: bool = True) -> Report:
    checks: list[Check] = []
    cpu = _cpu_section(checks)
    kern = _kernel_section(checks)
    mem = _memory_section(checks, measure_bandwidth and kern["selected"] is not None)
    gpus = _gpu_section(checks)
    storage = _storage_section(checks)
    versions = _versions(checks)
    expected = _expected(mem["read_bandwidth_gbps"])
    ok = not any(c.status == "error" for c in checks)
    return Report(SCHEMA, ok, versions, cpu, kern, mem, gpus, storage, expected,
                  [asdict(c) for c in checks])


def _versions(checks: list[Check]) -> dict:
    torch_version = None
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        checks.append(Check("torch", "error", "torch is not installed", "pip install torch==2.13.0"))
    py_ok = sys.version_info >= (3, 10)
    checks.append(Check("python", "ok" if py_ok else "error", platform.python_version(),
                        "" if py_ok else "kt needs Python >= 3.10"))
    return {"python": platform.python_version(), "torch": torch_version, "kt": __version__}


def _cpu_section(checks: list[Check]) -> dict:
    facts = hardware.cpu()
    features = {f: {"cpu": f in facts.flags, "os": f in facts.usable()} for f in REPORTED_FLAGS}
    hidden = [f for f, v in features.items() if v["cpu"] and not v["os"]]
    if hidden:
        checks.append(Check("os support", "warn", "CPU has but OS does not enable: " + ", ".join(hidden),
                            "the kernel or hypervisor disables this state; kt uses a lower variant"))
    checks.append(Check("cpu", "ok", f"{facts.brand}, {facts.physical_cores} physical cores"))
    checks.append(_numa_check())
    return {"model": facts.brand, "arch": facts.arch, "physical_cores": facts.physical_cores,
            "logical_cores": facts.logical_cores, "numa_nodes": facts.numa_nodes,
            "xcr0": facts.xcr0, "features": features}


def _numa_check() -> Check:
    from .ops import numa
    topology = hardware.system_numa_topology()
    try:
        return Check("numa", "ok", numa.describe(numa.current_plan(topology), topology))
    except KtError as exc:
        return Check("numa", "warn", str(exc), "set KT_NUMA=interleave or off, or unset it")


def _kernel_section(checks: list[Check]) -> dict:
    try:
        chosen = kernels.selection()
        loaded = kernels.load()
    except KtError as exc:
        checks.append(Check("kernels", "error", str(exc), "reinstall with ./install.sh; unset KT_ISA"))
        return {"selected": None, "reason": str(exc), "variants": []}
    checks.append(Check("kernels", "ok", f"{loaded.variant} loaded ({chosen.reason})"))
    return {"selected": loaded.variant, "reason": chosen.reason,
            "variants": [asdict(v) for v in chosen.verdicts]}


def _memory_section(checks: list[Check], measure: bool) -> dict:
    mem = hardware.memory()
    gbps = _bandwidth(checks) if measure else None
    low = mem.available_bytes < 4 << 30
    checks.append(Check("ram", "warn" if low else "ok",
                        f"{_gib(mem.available_bytes)} available of {_gib(mem.total_bytes)}",
                        "close other programs or pick a smaller model" if low else ""))
    return {"total_bytes": mem.total_bytes, "available_bytes": mem.available_bytes,
            "read_bandwidth_gbps": gbps}


def _bandwidth(checks: list[Check]) -> float | None:
    try:
        from . import ops
        gbps = float(ops.membw_read_gbps(MEMBW_PROBE_BYTES, 3))
    except Exception as exc:  # the probe is informative; a failure must not hide the rest
        checks.append(Check("memory bandwidth", "warn", f"probe failed: {exc}"))
        return None
    if gbps <= 0:
        checks.append(Check("memory bandwidth", "warn", "probe could not allocate its buffer"))
        return None
    checks.append(Check("memory bandwidth", "ok", f"{gbps:.1f} GB/s read, "
                        f"{hardware.default_threads()} threads"))
    return round(gbps, 2)


def _gpu_section(checks: list[Check]) -> dict:
    summary = hardware.gpus()
    if summary.error:
        checks.append(Check("gpu", "warn", summary.error, "check the NVIDIA driver; kt runs CPU-only"))
    elif not summary.gpus:
        checks.append(Check("gpu", "ok", "none: CPU-only mode (attention and experts on the CPU)"))
    for gpu in summary.gpus:
        checks.append(Check("gpu", "ok", f"{gpu.name}, {_gib(gpu.free_bytes)} free of {_gib(gpu.total_bytes)}"))
    return {"cuda_version": summary.cuda_version, "devices": [asdict(g) for g in summary.gpus]}


def _storage_section(checks: list[Check]) -> dict:
    home, models = hardware.kt_home(), store.models_dir()
    free = hardware.free_disk_bytes(models)
    default = store.default_model_path()
    if not default.is_file():
        checks.append(Check("default model", "warn", f"missing: {default}", "run ./install.sh"))
    else:
        checks.append(Check("default model", "ok", str(default)))
    checks.append(Check("disk", "warn" if free < 10 << 30 else "ok", f"{_gib(free)} free at {models}"))
    return {"kt_home": str(home), "models_dir": str(models), "free_bytes": free,
            "default_model": str(default), "default_model_present": default.is_file()}


def _expected(gbps: float | None) -> list:
    if not gbps:
        return []
    usable = gbps * 1e9 * DECODE_EFFICIENCY
    return [{"model": name, "bytes_per_token": int(b), "decode_tokens_per_s": round(usable / b, 1)}
            for name, b in EXPECTATIONS]


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
