"""The thread pool's job API (kt_pool_run / _async / _wait) is internal to the C
library, so a small C harness drives native/src/threadpool.c directly."""


import pytest
import torch

from kt_cli.errors import KtError
from kt_cli.ops import Pool
from kt_cli.ops.linear import linear as linear_on
from kt_weights.layout import Format, QMatrix

from c_harness import run_harness

@pytest.fixture(scope="module")
def harness_lines(tmp_path_factory) -> list[str]:
    return run_harness(tmp_path_factory.mktemp("pool"), "pool_harness", ["threadpool.c"])


CHECKS = [f"{kind} threads={n}" for n in (1, 2, 3, 8) for kind in ("sync repeated", "async", "async then sync")]
CHECKS += [f"sync threads={n} tasks={t}" for n in (1, 2, 3, 8) for t in (0, 1, 2, 7, 64, 5000)]
CHECKS += ["bad sizes", "spin control threads=3"]


@pytest.mark.parametrize("check", CHECKS)
def test_pool_harness(harness_lines, check):
    failures = [line for line in harness_lines if line.startswith(f"FAIL {check}")]
    assert not failures, failures
    assert f"ok {check}" in harness_lines


@pytest.mark.parametrize("threads", [0, -1, 5000, 2.0])
def test_python_pool_rejects_bad_thread_counts(ops, threads):
    with pytest.raises(KtError):
        Pool(ops.kernels, threads)


def test_python_pool_reports_threads(ops):
    assert Pool(ops.kernels, 2).threads == 2
    assert ops.kernels.lib.kt_pool_threads(ops.pool.handle) == ops.threads


def test_python_pool_spin_control(ops):
    pool = Pool(ops.kernels, 2)
    with pool.sleeping_workers():
        assert linear_on(pool, torch.ones(1, 8), QMatrix(Format.F32, 4, 8, torch.ones(4, 8))).eq(8).all()
    for bad in (-2, 1 << 25, 1.5):
        with pytest.raises(KtError, match="spin rounds"):
            pool.set_spin(bad)
