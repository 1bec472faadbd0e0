#!/usr/bin/env bash
# The native kernels' AVX-512 paths (the float32, bf16 and int8 attention and GEMM kernels an
# AVX-512 CPU runs) tested on a CPU without AVX-512: built against SIMDe's portable intrinsics
# (acb/kernels/csrc/avx512_emulated.h, ACB_CPU_KERNEL_EMULATE) and run through the kernel tests, which
# compare them with references (and, where they must, with each other bit for bit). The builds
# target AVX2 + FMA on any CPU (acb.kernels.cpu.EMULATION_ARCH), an AVX-512 one too, so each kind
# is the one named, not this CPU's own. Two kinds of
# AVX-512 by default: with VNNI and BF16 (Sapphire Rapids, Zen 4) and without BF16 (Cascade Lake,
# Ice Lake); EMULATIONS="avx512-base" (Skylake-X) or any list of them chooses. Correctness only:
# emulated kernels are slow, and each kind builds the kernel library again (~9 CPU-minutes: SIMDe's
# headers and intrinsics compile slowly) in a build folder of its own. CI runs it as a stage.
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
  # built, and built as that kind of AVX-512: a kernel that failed to build would make its tests skip
  echo "test-avx512-emulated: building the kernel library with ACB_CPU_KERNEL_EMULATE=$emulation"
  ACB_CPU_KERNEL_EMULATE=$emulation "$PY" - "$emulation" <<'EOF'
import sys
from acb.kernels import cpu
kind = sys.argv[1]
built = {g.__name__: g() for g in (cpu.fused_kernels, cpu.lora_kernels, cpu.int8_kernels, cpu.bf16_kernels,
                                   cpu.paged_decode_kernel)}
missing = [name for name, module in built.items() if module is None]
assert not missing, f"{kind}: these kernels did not build (the log above says why): {missing}"
decode, int8, bf16 = built["paged_decode_kernel"], built["int8_kernels"], built["bf16_kernels"]
want_vnni, want_bf16 = kind != "avx512-base", kind == "avx512"
assert decode.has_avx512() and built["lora_kernels"].available(), f"{kind}: the build has no AVX-512 paths"
assert int8.has_vnni() == want_vnni, f"{kind}: the int8 GEMM's VNNI path is {'missing' if want_vnni else 'built'}"
assert bf16.native() == want_bf16 == decode.prefill_bf16(), f"{kind}: the bf16 kernels do not match"
print(f"test-avx512-emulated: {kind}: the kernel library built, VNNI {want_vnni}, BF16 {want_bf16}")
EOF
  echo "test-avx512-emulated: ACB_CPU_KERNEL_EMULATE=$emulation python -m pytest -q ${FILES[*]} $* with $PY"
  ACB_CPU_KERNEL_EMULATE=$emulation "$PY" -m pytest -q "${FILES[@]}" "$@"
done
