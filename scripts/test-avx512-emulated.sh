#!/usr/bin/env bash
# The native kernels' paths this CPU does not run itself, built and run through the kernel tests,
# which compare them with references (and, where they must, with each other bit for bit). On a CPU
# without AVX-512: the AVX-512 paths (the float32, bf16 and int8 attention and GEMM kernels an AVX-512
# CPU runs), built against SIMDe's portable intrinsics (acb/kernels/csrc/avx512_emulated.h,
# ACB_CPU_KERNEL_EMULATE=avx512: with VNNI and BF16, as Sapphire Rapids and Zen 4; avx512-vnni:
# without BF16, as Cascade Lake and Ice Lake) - slowly; built at -O1 (SIMDe at -O3 compiled ~5x
# slower). On an AVX-512 CPU: the AVX2 build (ACB_CPU_KERNEL_EMULATE=avx2, nothing emulated), whose
# paths Zen 2/3 and Alder Lake run, and the AVX-512 kind it is not (with or without BF16).
# EMULATIONS chooses others, e.g. "avx512-base" (Skylake-X: neither VNNI nor BF16) or
# "avx512 avx512-vnni avx2". The builds target AVX2 + FMA on any CPU
# (acb.kernels.cpu.EMULATION_ARCH), so each kind is the one named, not this CPU's own; each builds
# in a folder of its own. CI runs it as a stage.
set -euo pipefail
cd "$(dirname "$0")/.."
# the kinds this CPU does not run natively (its own are the default suite's)
if ! grep -qw avx512f /proc/cpuinfo; then DEFAULT="avx512 avx512-vnni"
elif grep -qw avx512_bf16 /proc/cpuinfo; then DEFAULT="avx2 avx512-vnni"
else DEFAULT="avx2 avx512"; fi
KINDS=${EMULATIONS:-$DEFAULT}
if [ "$KINDS" != avx2 ] && [ ! -f /usr/include/simde/x86/avx512.h ]; then  # only the AVX-512 kinds need SIMDe
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
  tests/test_lora_kernels.py tests/test_quantization.py tests/test_gguf_int8.py tests/test_gguf_native.py tests/test_dtype_defaults.py
  tests/test_adapters.py)
for emulation in $KINDS; do
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
want_vnni, want_bf16 = kind not in ("avx512-base", "avx2"), kind == "avx512"
if kind == "avx2":
    assert not decode.has_avx512() and int8.available(), f"{kind}: the build is not the AVX2 one"
else:
    assert decode.has_avx512() and built["lora_kernels"].available(), f"{kind}: the build has no AVX-512 paths"
assert int8.has_vnni() == want_vnni, f"{kind}: the int8 GEMM's VNNI path is {'missing' if want_vnni else 'built'}"
assert bf16.native() == want_bf16 == decode.prefill_bf16(), f"{kind}: the bf16 kernels do not match"
print(f"test-avx512-emulated: {kind}: the kernel library built, VNNI {want_vnni}, BF16 {want_bf16}")
EOF
  echo "test-avx512-emulated: ACB_CPU_KERNEL_EMULATE=$emulation python -m pytest -q ${WORKERS[*]} ${FILES[*]} $* with $PY"
  ACB_CPU_KERNEL_EMULATE=$emulation "$PY" -m pytest -q "${WORKERS[@]}" "${FILES[@]}" "$@"
done
