"""Builds and runs the small C harnesses that drive the native library's internal
APIs (not in the cffi ABI) directly: one line of output per check."""

import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
NATIVE = HERE.parents[1] / "native"


def run_harness(tmp_dir: Path, harness: str, sources: list[str], args: list[str] = (),
                cflags: list[str] = (), exe_name: str | None = None) -> list[str]:
    """Compiles tests/kernels/<harness>.c with native/src/<sources> (and cflags), runs it -> its stdout lines."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip(f"needs a C compiler (cc) to build {harness}")
    exe = tmp_dir / (exe_name or harness)
    subprocess.run([cc, "-O2", "-std=c11", "-pthread", "-Wall", *cflags, "-I", str(NATIVE / "include"),
                    "-I", str(NATIVE / "src"), str(HERE / f"{harness}.c"),
                    *(str(NATIVE / "src" / s) for s in sources), "-o", str(exe), "-lm"], check=True)
    result = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60, check=True)
    return result.stdout.splitlines()
