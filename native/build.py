"""cffi out-of-line builder: one extension module per entry of native/variants.py.

Every variant compiles the same sources in native/src with its own flags and
the macro KT_VARIANT naming it, so a loaded library can report what it is.
"""

from pathlib import Path

from cffi import FFI

from .variants import COMMON_CFLAGS, Variant, module_name

NATIVE = Path(__file__).resolve().parent
HEADER = NATIVE / "include" / "kt.h"


def sources() -> list[str]:
    return sorted(str(p.relative_to(NATIVE.parent)) for p in (NATIVE / "src").glob("*.c"))


def headers() -> list[str]:
    """What the sources include: a build whose library is older than any of them recompiles
    (without this, editing only a header left the old library in place)."""
    return sorted(str(p.relative_to(NATIVE.parent)) for p in [HEADER, *(NATIVE / "src").glob("*.h")])


def make_ffi(variant: Variant) -> FFI:
    ffi = FFI()
    ffi.cdef(HEADER.read_text())
    ffi.set_source(
        module_name(variant),
        '#include "kt.h"',
        sources=sources(),
        depends=headers(),
        include_dirs=[str(NATIVE.relative_to(NATIVE.parent) / "include")],
        define_macros=[("KT_VARIANT", f'"{variant.name}"')],
        extra_compile_args=[*COMMON_CFLAGS, *variant.cflags],
        libraries=["m"],
    )
    return ffi
