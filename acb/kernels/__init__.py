"""Optional native kernels: one C++ library (``csrc/``, :mod:`acb.kernels.cpu`), built on first use;
where it cannot be built (no compiler) acb logs that once and uses PyTorch ops, so acb always works
without it."""
