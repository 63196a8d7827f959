"""The one table of kt's native build variants.

Each variant is the same C source set compiled with different flags. `requires`
names the CPU features (as kt_cli.hardware reports them: cpuid flag plus OS
support) that a host must have to run that build. `score` orders the variants:
the loader takes the highest-scoring one the host can run.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    name: str
    score: int
    cflags: tuple[str, ...]
    requires: frozenset[str]
    arch: str = "x86_64"


_X86_BASE = ("-mtune=generic",)

VARIANTS: tuple[Variant, ...] = (
    Variant("generic", 0, (), frozenset(), arch="any"),
    Variant(
        "avx2", 10,
        _X86_BASE + ("-mavx2", "-mfma", "-mf16c", "-mbmi2"),
        frozenset({"avx2", "fma", "f16c"}),
    ),
    Variant(
        "avx512", 20,
        _X86_BASE + ("-mavx2", "-mfma", "-mf16c", "-mbmi2",
                     "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"),
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"}),
    ),
    Variant(
        "avx512_vnni", 30,
        _X86_BASE + ("-mavx2", "-mfma", "-mf16c", "-mbmi2",
                     "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni"),
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                   "avx512_vnni"}),
    ),
    Variant(
        "avx512_bf16", 40,
        _X86_BASE + ("-mavx2", "-mfma", "-mf16c", "-mbmi2",
                     "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni",
                     "-mavx512bf16"),
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                   "avx512_vnni", "avx512_bf16"}),
    ),
    Variant(
        "amx", 50,
        _X86_BASE + ("-mavx2", "-mfma", "-mf16c", "-mbmi2",
                     "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni",
                     "-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16"),
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                   "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}),
    ),
)

COMMON_CFLAGS: tuple[str, ...] = ("-O3", "-std=c11", "-fno-strict-aliasing", "-pthread")


def by_name(name: str) -> Variant:
    for variant in VARIANTS:
        if variant.name == name:
            return variant
    known = ", ".join(v.name for v in VARIANTS)
    raise KeyError(f"unknown kernel variant {name!r} (known: {known})")


def module_name(variant: Variant) -> str:
    return f"kt_cli._native._kt_{variant.name}"
