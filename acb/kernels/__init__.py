"""Optional native kernels. Each is built on first use and falls back to PyTorch ops
when it cannot be built (no compiler), so acb always works without them."""
