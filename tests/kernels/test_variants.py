import pytest

from kt_cli import hardware, kernels
from kt_native.variants import VARIANTS


@pytest.mark.parametrize("name", [v.name for v in VARIANTS])
def test_each_variant_loads_or_names_missing_hardware(name):
    facts = hardware.cpu()
    built = kernels.built_variants()
    variant = next(v for v in VARIANTS if v.name == name)
    verdict = kernels.judge(variant, facts.usable(), facts.arch, name in built)
    if not verdict.runnable:
        missing = sorted(variant.requires - facts.usable())
        pytest.skip(f"{name} needs {', '.join(missing) or variant.arch} (CPU lacks it)")
    if name not in built:
        pytest.skip(f"{name} is runnable here but was not built (compiler lacked support)")
    loaded = kernels.load_variant(name)
    assert loaded.ffi.string(loaded.lib.kt_variant_name()).decode() == name
