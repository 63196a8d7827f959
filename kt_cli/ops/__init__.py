"""Python wrappers of the native kernels. Each wrapper checks every size and
dtype against the tensors it is handed before calling C.

API (implemented in this package's modules):
  pool()                                  the process-wide kt_pool (KT_THREADS threads)
  linear(x [m, cols] f32, w: QMatrix)     -> [m, rows] f32
  quantize(w [rows, cols] f32, fmt, group, symmetric=True) -> QMatrix   (native, all threads)
  quantize_rows_i8(x [rows, n] f32)       -> (q int8 [rows, n], scale f32 [rows])
  membw_read_gbps(n_bytes, repeats)       -> float
  MoEExperts(gate, up, down, activation="silu", clamp_limit=0.0, alpha=1.0)
      .forward(x [T, H] f32, ids [T, K] int32, weights [T, K] f32) -> [T, H] f32
      .submit(x, ids, weights) -> MoEJob;  MoEJob.wait() -> [T, H] f32
"""
