import pytest

from kt_cli import kernels
from kt_cli.ops import Ops

TEST_THREADS = 3   # more threads than this machine's cores: exercises the pool's hand-off


@pytest.fixture(scope="session", params=kernels.runnable_built())
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def ops(variant) -> Ops:
    return Ops(kernels.load_variant(variant), threads=TEST_THREADS)
