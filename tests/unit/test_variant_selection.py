import pytest

from kt_cli import kernels
from kt_cli.errors import KernelLoadError
from kt_cli.hardware import XCR0_AMX, XCR0_AVX, XCR0_AVX512, CpuFacts, normalise_flags
from kt_native.variants import VARIANTS

ALL_BUILT = {v.name for v in VARIANTS}
AVX2 = {"avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
ZEN4 = AVX512 | {"avx512_vnni", "avx512_bf16"}
SPR = ZEN4 | {"amx_tile", "amx_int8", "amx_bf16"}
FULL_XCR0 = XCR0_AVX | XCR0_AVX512 | XCR0_AMX


def facts(flags, xcr0=FULL_XCR0, amx_permitted=True, arch="x86_64"):
    return CpuFacts("test", arch, normalise_flags(flags), xcr0, amx_permitted, 2, 2, 1)


HOSTS = [
    ("avx2 only (Haswell, Zen 2, this VM)", facts(AVX2), "avx2"),
    ("avx512 without vnni (Skylake-X)", facts(AVX512), "avx512"),
    ("avx512 + vnni (Cascade Lake)", facts(AVX512 | {"avx512_vnni"}), "avx512_vnni"),
    ("zen 4", facts(ZEN4), "avx512_bf16"),
    ("sapphire rapids with AMX permission", facts(SPR), "amx"),
    ("sapphire rapids without AMX permission", facts(SPR, amx_permitted=False), "avx512_bf16"),
    ("sapphire rapids, OS without AMX state", facts(SPR, xcr0=XCR0_AVX | XCR0_AVX512), "avx512_bf16"),
    ("zen 4 whose hypervisor hides ZMM state", facts(ZEN4, xcr0=XCR0_AVX), "avx2"),
    ("aarch64", facts({"asimd", "fp"}, xcr0=0, arch="aarch64"), "generic"),
    ("x86 without AVX state", facts(AVX2, xcr0=0), "generic"),
]


@pytest.mark.parametrize("label,host,expected", HOSTS, ids=[h[0] for h in HOSTS])
def test_selects_best_runnable_variant(label, host, expected):
    chosen = kernels.select(host.usable(), host.arch, ALL_BUILT)
    assert chosen.variant.name == expected


def test_unbuilt_variant_is_passed_over():
    host = facts(SPR)
    chosen = kernels.select(host.usable(), host.arch, ALL_BUILT - {"amx"})
    assert chosen.variant.name == "avx512_bf16"
    amx = next(v for v in chosen.verdicts if v.variant == "amx")
    assert amx.runnable and not amx.built


def test_reason_names_what_blocks_the_next_variant():
    host = facts(AVX2)
    chosen = kernels.select(host.usable(), host.arch, ALL_BUILT)
    assert "avx512f" in chosen.reason


def test_forced_variant_the_cpu_lacks_is_refused():
    host = facts(AVX2)
    with pytest.raises(KernelLoadError, match="KT_ISA=amx cannot run"):
        kernels.select(host.usable(), host.arch, ALL_BUILT, forced="amx")


def test_forced_unknown_variant_is_refused():
    host = facts(ZEN4)
    with pytest.raises(KernelLoadError, match="unknown kernel variant"):
        kernels.select(host.usable(), host.arch, ALL_BUILT, forced="sse9")


def test_forced_runnable_variant_wins_over_best():
    host = facts(ZEN4)
    chosen = kernels.select(host.usable(), host.arch, ALL_BUILT, forced="generic")
    assert chosen.variant.name == "generic"
    assert "KT_ISA" in chosen.reason


def test_nothing_built_is_an_error():
    with pytest.raises(KernelLoadError):
        kernels.select(facts(AVX2).usable(), "x86_64", set())


def test_alias_flags_are_normalised():
    assert normalise_flags({"AVX512VNNI", "amx-tile"}) == {"avx512_vnni", "amx_tile"}


def test_a_library_built_for_another_abi_is_refused(monkeypatch):
    """A stale build (kt.h changed since) would misread kt_matrix: it must not load."""
    generic = kernels.by_name("generic")
    assert kernels._import(generic).lib.kt_abi_version() == kernels.ABI_VERSION
    monkeypatch.setattr(kernels, "ABI_VERSION", kernels.ABI_VERSION + 1)
    with pytest.raises(KernelLoadError, match="C ABI version .* rebuild the kernels"):
        kernels._import(generic)


def test_a_saved_build_loads_beside_the_installed_one_only_as_its_own_variant(tmp_path):
    """kernels.load_file (the benchmarks' --baseline): a copy of the generic .so loads as a
    second library; named as another variant, or not a library at all, it is refused."""
    import importlib.util
    import shutil
    origin = importlib.util.find_spec(kernels.module_name(kernels.by_name("generic"))).origin
    saved = tmp_path / "old_generic.so"
    shutil.copy(origin, saved)
    base = kernels.load_file(str(saved), "generic")
    assert base.variant == "generic" and base.lib.kt_abi_version() == kernels.ABI_VERSION
    with pytest.raises(KernelLoadError, match="not the 'avx2' kernel library"):
        kernels.load_file(str(saved), "avx2")
    (tmp_path / "notes.txt").write_text("not a library")
    with pytest.raises(KernelLoadError, match="not a loadable kernel library"):
        kernels.load_file(str(tmp_path / "notes.txt"), "generic")
    with pytest.raises(SystemExit, match="^--baseline: .*missing.so: not the 'generic' kernel library"):
        kernels.baseline_kernels(str(tmp_path / "missing.so"), "generic")
