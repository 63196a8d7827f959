"""`kt doctor --json` is an interface people script against: its fields and
types are documented in README.md (schema kt.doctor/1) and checked here."""

import json
import subprocess
import sys

import pytest

TOP_LEVEL = {"schema": str, "ok": bool, "versions": dict, "cpu": dict, "kernels": dict,
             "memory": dict, "gpus": dict, "storage": dict, "expected": list, "checks": list}
CPU = {"model": str, "arch": str, "physical_cores": int, "logical_cores": int, "numa_nodes": int,
       "xcr0": int, "features": dict}
KERNELS = {"selected": str, "reason": str, "variants": list}
VARIANT = {"variant": str, "built": bool, "runnable": bool, "reason": str}
MEMORY = {"total_bytes": int, "available_bytes": int}
STORAGE = {"kt_home": str, "models_dir": str, "free_bytes": int, "default_model": str,
           "default_model_present": bool}
CHECK = {"name": str, "status": str, "detail": str, "hint": str}


def _assert_types(obj: dict, spec: dict, where: str) -> None:
    for key, kind in spec.items():
        assert key in obj, f"{where}.{key} missing"
        assert isinstance(obj[key], kind), f"{where}.{key} is {type(obj[key]).__name__}, not {kind.__name__}"


@pytest.fixture(scope="module")
def report() -> dict:
    proc = subprocess.run([sys.executable, "-m", "kt_cli", "doctor", "--json"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_top_level_fields(report):
    _assert_types(report, TOP_LEVEL, "report")
    assert report["schema"] == "kt.doctor/1"


def test_cpu_fields(report):
    _assert_types(report["cpu"], CPU, "cpu")
    for name, flags in report["cpu"]["features"].items():
        assert set(flags) == {"cpu", "os"} and all(isinstance(v, bool) for v in flags.values()), name
        assert not flags["os"] or flags["cpu"], f"{name}: OS-enabled without CPU support"


def test_kernel_fields_and_selection_is_runnable(report):
    _assert_types(report["kernels"], KERNELS, "kernels")
    for v in report["kernels"]["variants"]:
        _assert_types(v, VARIANT, "variant")
    chosen = next(v for v in report["kernels"]["variants"] if v["variant"] == report["kernels"]["selected"])
    assert chosen["built"] and chosen["runnable"]


def test_memory_bandwidth_is_measured(report):
    _assert_types(report["memory"], MEMORY, "memory")
    gbps = report["memory"]["read_bandwidth_gbps"]
    assert isinstance(gbps, float) and 0.5 < gbps < 2000, gbps


def test_gpu_storage_and_checks(report):
    assert report["gpus"]["cuda_version"] is None or isinstance(report["gpus"]["cuda_version"], str)
    assert isinstance(report["gpus"]["devices"], list)
    _assert_types(report["storage"], STORAGE, "storage")
    for check in report["checks"]:
        _assert_types(check, CHECK, "check")
        assert check["status"] in {"ok", "warn", "error"}


def test_expected_speed_follows_bandwidth(report):
    rows = report["expected"]
    assert rows, "expected speeds need the bandwidth figure"
    gbps = report["memory"]["read_bandwidth_gbps"]
    for row in rows:
        rounding = row["bytes_per_token"] * 0.05 / 1e9      # tokens/s are rounded to 0.1
        implied = row["bytes_per_token"] * row["decode_tokens_per_s"] / 1e9
        assert implied <= gbps + rounding
        assert implied >= gbps * 0.5 - rounding
