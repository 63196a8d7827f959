"""kt_cli.hardware.hold_step_buffers: glibc then serves a step-sized allocation from its heap and
keeps it once freed, where by default it maps it afresh and unmaps it on free (read back from
glibc's own mallinfo2, in a fresh process each, so the suite's heap does not matter)."""

import ctypes
import json
import subprocess
import sys
import textwrap

import pytest

STEP_BYTES = 48 << 20

PROBE = textwrap.dedent(f"""
    import ctypes, json, sys
    from kt_cli import hardware

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    if sys.argv[1] == "held":
        hardware.hold_step_buffers()
    p = libc.malloc({STEP_BYTES})
    ctypes.memset(p, 1, {STEP_BYTES})
    mapped = libc.mallinfo2().hblkhd
    libc.free(p)
    print(json.dumps({{"mapped": mapped, "kept_free": libc.mallinfo2().fordblks}}))
""")


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not _has_mallinfo2(),
                                reason="needs glibc 2.33+ (mallinfo2), the allocator hold_step_buffers tunes")


def _heap_after_step(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_default_glibc_maps_a_step_buffer_and_returns_it():
    heap = _heap_after_step("default")
    assert heap["mapped"] >= STEP_BYTES
    assert heap["kept_free"] < STEP_BYTES


def test_held_step_buffer_comes_from_the_heap_and_stays():
    heap = _heap_after_step("held")
    assert heap["mapped"] < STEP_BYTES
    assert heap["kept_free"] >= STEP_BYTES
