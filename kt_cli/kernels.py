"""Picks the best kernel variant this host can run, loads it and confirms that
the library is what it says it is. KT_ISA=<variant> forces one; a variant the
CPU cannot run is refused with a KernelLoadError, never loaded (no SIGILL)."""

import importlib
import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache

from kt_native.variants import VARIANTS, Variant, by_name, module_name  # noqa: F401 (by_name re-exported)

from .errors import KernelLoadError

ABI_VERSION = 11     # native/src/identity.c kt_abi_version: the kt.h the Python side is written against


@dataclass(frozen=True)
class Verdict:
    variant: str
    built: bool
    runnable: bool
    reason: str


@dataclass(frozen=True)
class Selection:
    variant: Variant
    reason: str
    verdicts: tuple[Verdict, ...]


@dataclass(frozen=True)
class Kernels:
    variant: str
    reason: str
    ffi: object
    lib: object


def judge(variant: Variant, usable: frozenset[str], arch: str, built: bool) -> Verdict:
    if variant.arch not in ("any", arch):
        return Verdict(variant.name, built, False, f"needs {variant.arch}, this is {arch}")
    missing = sorted(variant.requires - usable)
    if missing:
        return Verdict(variant.name, built, False, "CPU/OS lacks " + ", ".join(missing))
    if not built:
        return Verdict(variant.name, built, True, "runnable but not built (compiler lacked support)")
    return Verdict(variant.name, built, True, "runnable")


def select(usable: frozenset[str], arch: str, built: set[str], forced: str | None = None) -> Selection:
    """Pure: the variant to load for a host with `usable` features."""
    verdicts = tuple(judge(v, usable, arch, v.name in built) for v in VARIANTS)
    if forced:
        return _forced(forced, verdicts)
    ok = [v for v, d in zip(VARIANTS, verdicts) if d.runnable and d.built]
    if not ok:
        raise KernelLoadError("no kernel variant is built for this CPU; reinstall kt (./install.sh)")
    best = max(ok, key=lambda v: v.score)
    return Selection(best, _best_reason(best, verdicts), verdicts)


def _forced(name: str, verdicts: tuple[Verdict, ...]) -> Selection:
    try:
        variant = by_name(name)
    except KeyError as exc:
        raise KernelLoadError(f"KT_ISA: {exc.args[0]}") from None
    verdict = next(d for d in verdicts if d.variant == name)
    if not verdict.runnable:
        raise KernelLoadError(f"KT_ISA={name} cannot run on this CPU: {verdict.reason}")
    if not verdict.built:
        raise KernelLoadError(f"KT_ISA={name} was not built on this install")
    return Selection(variant, f"forced by KT_ISA={name}", verdicts)


def _best_reason(best: Variant, verdicts: tuple[Verdict, ...]) -> str:
    better = [d for d in verdicts if by_name(d.variant).score > best.score]
    if not better:
        return "best variant for this CPU"
    nearest = min(better, key=lambda d: by_name(d.variant).score)
    return f"highest runnable; {nearest.variant}: {nearest.reason}"


def built_variants() -> set[str]:
    found = set()
    for variant in VARIANTS:
        try:
            importlib.util.find_spec(module_name(variant)) and found.add(variant.name)
        except ModuleNotFoundError:
            pass
    return found


def _import(variant: Variant):
    module = importlib.import_module(module_name(variant))
    reported = module.ffi.string(module.lib.kt_variant_name()).decode()
    if reported != variant.name:
        raise KernelLoadError(f"library {module_name(variant)} reports variant {reported!r}, "
                              f"expected {variant.name!r}; reinstall kt")
    abi = module.lib.kt_abi_version()
    if abi != ABI_VERSION:
        raise KernelLoadError(f"library {module_name(variant)} has C ABI version {abi}, this kt needs "
                              f"{ABI_VERSION}: rebuild the kernels with ./install.sh")
    return module


def load_file(path: str, variant: str) -> Kernels:
    """A saved build of `variant` from another file (its module name), loaded beside the
    installed one: benchmarks time a kernel change against the .so from before it. Not
    checked for the C ABI version (an older build may be the point); another variant's
    library fails to import, as its module init has another name."""
    spec = importlib.util.spec_from_file_location(module_name(by_name(variant)), path)
    if spec is None or spec.loader is None:
        raise KernelLoadError(f"{path}: not a loadable kernel library")
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:
        raise KernelLoadError(f"{path}: not the {variant!r} kernel library ({exc})") from None
    return Kernels(variant, f"baseline {path}", module.ffi, module.lib)


def baseline_kernels(path: str, variant: str) -> Kernels:
    """load_file for a benchmark's --baseline: a bad file ends the run with one line"""
    try:
        return load_file(path, variant)
    except KernelLoadError as exc:
        raise SystemExit(f"--baseline: {exc}") from None


def load_generic():
    """The portable build: safe on any CPU, used to read CPU/OS facts before choosing."""
    try:
        return _import(by_name("generic")).lib
    except ImportError as exc:
        raise KernelLoadError(f"kt's native kernels are not built ({exc}); run ./install.sh") from None


def selection() -> Selection:
    from . import hardware
    facts = hardware.cpu()
    return select(facts.usable(), facts.arch, built_variants(), os.environ.get("KT_ISA") or None)


@lru_cache(maxsize=1)
def load() -> Kernels:
    chosen = selection()
    module = _import(chosen.variant)
    return Kernels(chosen.variant.name, chosen.reason, module.ffi, module.lib)


def runnable_built() -> list[str]:
    """Every built variant this host can run, lowest score first."""
    from . import hardware
    facts = hardware.cpu()
    built = built_variants()
    return [v.name for v in VARIANTS
            if v.name in built and judge(v, facts.usable(), facts.arch, True).runnable]


@lru_cache(maxsize=None)
def load_variant(name: str) -> Kernels:
    """Load one named variant (tests run every kernel on each), refusing what the CPU cannot run."""
    from . import hardware
    facts = hardware.cpu()
    chosen = _forced(name, tuple(judge(v, facts.usable(), facts.arch, v.name in built_variants())
                                 for v in VARIANTS))
    module = _import(chosen.variant)
    return Kernels(name, chosen.reason, module.ffi, module.lib)
