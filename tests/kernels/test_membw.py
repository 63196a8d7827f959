import time

import pytest

from kt_cli.ops import OpError


def test_membw_is_plausible_and_quick(ops):
    start = time.perf_counter()
    gbps = ops.membw_read_gbps()          # the defaults the CLI uses: 256 MiB, 3 passes
    elapsed = time.perf_counter() - start
    assert 0.5 < gbps < 5000, gbps
    # ~0.2 s on an idle machine; the bound leaves room for a loaded shared test box
    assert elapsed < 3.0, f"probe took {elapsed:.2f} s"


@pytest.mark.parametrize("n_bytes, repeats", [(0, 1), (4096, 0), (1 << 20, -1)])
def test_membw_rejects_bad_sizes(ops, n_bytes, repeats):
    with pytest.raises(OpError):
        ops.membw_read_gbps(n_bytes, repeats)


def test_membw_small_odd_buffer(ops):
    assert ops.membw_read_gbps(4096 * 3 + 17, 1) > 0
