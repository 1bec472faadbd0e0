#!/usr/bin/env bash
# The native kernels' AVX-512 paths (the float32, bf16 and int8 attention and GEMM kernels an
# AVX-512 CPU runs) tested on a CPU without AVX-512: built against SIMDe's portable intrinsics
# (acb/kernels/avx512_emulated.h, ACB_CPU_KERNEL_EMULATE) and run through the kernel tests, which
# compare them with references (and, where they must, with each other bit for bit). Two kinds of
# AVX-512 by default: with VNNI and BF16 (Sapphire Rapids, Zen 4) and without BF16 (Cascade Lake,
# Ice Lake); EMULATIONS="avx512-base" (Skylake-X) or any list of them chooses. Correctness only:
# emulated kernels are slow, and each kind builds the five kernels again (~6 min on 2 cores) in
# build folders of its own. CI runs it as a stage.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f /usr/include/simde/x86/avx512.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test-avx512-emulated: installing Debian's libsimde-dev (SIMDe's headers)"
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libsimde-dev
  else
    echo "test-avx512-emulated: SIMDe's headers are missing: install libsimde-dev (Debian/Ubuntu) first" >&2
    exit 1
  fi
fi
bash scripts/setup.sh
source scripts/python-env.sh
FILES=(tests/test_cpu_kernels.py tests/test_fused_forward.py tests/test_kv_int8.py tests/test_bf16_gemm.py
  tests/test_lora_kernels.py tests/test_quantization.py tests/test_gguf_int8.py tests/test_dtype_defaults.py
  tests/test_adapters.py)
for emulation in ${EMULATIONS:-avx512 avx512-vnni}; do
  echo "test-avx512-emulated: ACB_CPU_KERNEL_EMULATE=$emulation python -m pytest -q ${FILES[*]} $* with $PY"
  ACB_CPU_KERNEL_EMULATE=$emulation "$PY" -m pytest -q "${FILES[@]}" "$@"
done
