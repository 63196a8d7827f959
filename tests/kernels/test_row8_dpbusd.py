"""The 8-row I4 kernel's AVX512-VNNI path (vpdpbusd, native/src/simd_row8.h) on a host without
VNNI: built with KT_ROW8_EMULATE_DPBUSD, an exact AVX2 stand-in for vpdpbusd, its outputs must
equal the AVX2 build's bit for bit (the integer block sums are the same; the AVX2 path itself is
checked against numpy in test_row8_layout.py). On a VNNI host test_row8_layout.py runs the real one."""

import pytest

from kt_cli import hardware

from c_harness import NATIVE, run_harness

AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-mbmi2"]
CASES = 2 * 3 * 2 * 11 - 2 * 11      # cols 64 skips group 128

@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, list[str]]:
    if not {"avx2", "fma", "f16c"} <= hardware.cpu().usable():
        pytest.skip("needs an AVX2+FMA CPU to run the AVX2 build of the 8-row kernel")
    tmp = tmp_path_factory.mktemp("row8_dpbusd")
    sources = sorted(p.name for p in (NATIVE / "src").glob("*.c"))
    flags = [*AVX2_FLAGS, '-DKT_VARIANT="avx2"']
    return {name: run_harness(tmp, "row8_dpbusd_harness", sources, cflags=flags + extra, exe_name=name)
            for name, extra in (("avx2", []), ("dpbusd", ["-DKT_ROW8_EMULATE_DPBUSD"]))}

def test_the_harness_ran_every_case(outputs):
    for lines in outputs.values():
        assert sum(line.startswith("case ") for line in lines) == CASES
        assert not any(line.startswith("FAIL") for line in lines)
        values = [float.fromhex(line) for line in lines if not line.startswith("case ")]
        assert sum(v != 0.0 for v in values) > 0.99 * len(values)

def test_the_vnni_path_equals_the_avx2_path_bit_for_bit(outputs):
    avx2, dpbusd = outputs["avx2"], outputs["dpbusd"]
    assert len(avx2) == len(dpbusd)
    first = next((i for i, (a, b) in enumerate(zip(avx2, dpbusd)) if a != b), None)
    assert first is None, f"line {first}: avx2 {avx2[first]} vs vnni path {dpbusd[first]}"
