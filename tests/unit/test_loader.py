"""The real loader on this host: every built variant the CPU can run loads and
reports its own name; one it cannot run is refused in a subprocess, never SIGILL."""

import os
import subprocess
import sys

import pytest

from kt_cli import hardware, kernels
from kt_native.variants import VARIANTS


def _runnable_here():
    return kernels.runnable_built()


@pytest.mark.parametrize("name", [v.name for v in VARIANTS])
def test_variant_loads_and_reports_its_name(name):
    if name not in kernels.built_variants():
        pytest.skip(f"{name} was not built by this compiler")
    if name not in _runnable_here():
        missing = kernels.judge(kernels.by_name(name), hardware.cpu().usable(),
                                hardware.cpu().arch, True).reason
        pytest.skip(f"{name} cannot run on this host: {missing}")
    loaded = kernels.load_variant(name)
    assert loaded.ffi.string(loaded.lib.kt_variant_name()).decode() == name


def _run_kt(args, env_extra):
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-m", "kt_cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_forcing_an_unsupported_variant_exits_cleanly():
    unsupported = [v.name for v in VARIANTS if v.name not in _runnable_here()]
    if not unsupported:
        pytest.skip("this host runs every variant (an AMX machine): nothing to refuse")
    forced = unsupported[-1]
    proc = _run_kt(["doctor", "--json", "--no-bandwidth"], {"KT_ISA": forced})
    assert proc.returncode != 0
    assert f"KT_ISA={forced} cannot run on this CPU" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_forcing_a_supported_variant_loads_it():
    proc = _run_kt(["doctor", "--json", "--no-bandwidth"], {"KT_ISA": "generic"})
    assert proc.returncode == 0, proc.stderr
    assert '"selected": "generic"' in proc.stdout
