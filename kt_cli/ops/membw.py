"""Memory read bandwidth probe: the ceiling for memory-bound kernels such as decode."""

from .ffi_args import check, check_status
from .pool import Pool

DEFAULT_BYTES = 256 << 20
DEFAULT_REPEATS = 3


def membw_read_gbps(pool: Pool, n_bytes: int = DEFAULT_BYTES, repeats: int = DEFAULT_REPEATS) -> float:
    check(isinstance(n_bytes, int) and n_bytes >= 4096, f"n_bytes must be an integer >= 4096, got {n_bytes!r}")
    check(isinstance(repeats, int) and repeats >= 1, f"repeats must be an integer >= 1, got {repeats!r}")
    gbps = float(pool.kernels.lib.kt_membw_read_gbps(pool.handle, n_bytes, repeats))
    check_status(int(gbps) if gbps < 0 else 0, "kt_membw_read_gbps")
    return gbps
