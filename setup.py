"""Builds one cffi extension per kernel variant (native/variants.py).

A variant that this host's compiler cannot build, or that does not fit this
machine's architecture, is skipped with a warning: the install never fails
because of it, and the loader simply never sees that variant.
"""

import os
import platform
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from native.build import make_ffi  # noqa: E402
from native.variants import VARIANTS  # noqa: E402


def _buildable(variant) -> bool:
    is_x86 = platform.machine().lower() in ("x86_64", "amd64")
    wanted = os.environ.get("KT_BUILD_VARIANTS")
    if wanted and variant.name not in wanted.split(","):
        return False
    return variant.arch == "any" or is_x86


class BuildVariants(build_ext):
    def build_extension(self, ext):
        shared_temp = self.build_temp
        # every variant compiles the same sources: keep their objects apart
        self.build_temp = os.path.join(shared_temp, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        except Exception as exc:  # compiler rejects the flags: skip this variant only
            if ext.name.endswith("_generic"):
                raise
            self.warn(f"kt: skipping kernel variant {ext.name}: {exc}")
        finally:
            self.build_temp = shared_temp


def extensions():
    build_tmp = os.path.join("build", "cffi")
    return [make_ffi(v).distutils_extension(tmpdir=build_tmp) for v in VARIANTS if _buildable(v)]


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildVariants})
