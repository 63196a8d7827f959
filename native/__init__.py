"""kt's native kernels: the C sources, the variant table and the cffi builder."""
