#!/usr/bin/env bash
# Compile-only check of the CUDA kernels (ext/cuda/*.cu) for sm_80 and sm_90 with plain nvcc:
# no GPU needed, no torch headers involved; then a syntax check of the CUDA glue in
# ext/bindings.cpp and ext/glue/ (one translation unit, torch headers, when torch is importable). Exits non-zero when any file fails to compile;
# skips (exit 0, with a message) when nvcc is not on the machine.
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [ -z "$NVCC" ]; then
  echo "check_cuda: nvcc not found, CUDA compile check skipped"
  exit 0
fi
shopt -s nullglob
sources=("$root"/ext/cuda/*.cu)
if [ ${#sources[@]} -eq 0 ]; then
  echo "check_cuda: no .cu files under ext/cuda" >&2
  exit 1
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "check_cuda: $("$NVCC" --version | tail -1)"
# -Werror all-warnings: a warning in a kernel is a defect here, not noise. The __CUDA_NO_*
# macros are the ones torch.utils.cpp_extension adds: the kernels must not lean on implicit
# half/bfloat16 conversions or operators.
flags=(-std=c++17 -O3 -Werror all-warnings --expt-relaxed-constexpr
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
       -D__CUDA_NO_HALF2_OPERATORS__
       -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
       -I "$root/ext/cuda")
status=0
pids=()
for src in "${sources[@]}"; do
  name="$(basename "$src" .cu)"
  ( "$NVCC" "${flags[@]}" -c "$src" -o "$tmp/$name.o" >"$tmp/$name.log" 2>&1 ) &
  pids+=("$!")
done
for i in "${!sources[@]}"; do
  name="$(basename "${sources[$i]}" .cu)"
  if wait "${pids[$i]}"; then
    echo "check_cuda: ok     ext/cuda/$name.cu (sm_80, sm_90)"
  else
    echo "check_cuda: FAILED ext/cuda/$name.cu" >&2
    cat "$tmp/$name.log" >&2
    status=1
  fi
done
# The header must also stand alone in a host-only C++ translation unit (the torch glue).
cuda_inc="$(dirname "$(dirname "$(readlink -f "$NVCC")")")/include"
[ -f "$cuda_inc/cuda_runtime.h" ] || cuda_inc=/usr/local/cuda/include
if command -v "${CXX:-g++}" >/dev/null 2>&1 && [ -f "$cuda_inc/cuda_runtime.h" ]; then
  printf '#include "ampfunc_cuda.h"\nint main(void) { return ampfunc_cuda_abi_version == 0; }\n' >"$tmp/h.cpp"
  if "${CXX:-g++}" -std=c++17 -fsyntax-only -I "$root/ext/cuda" -I "$cuda_inc" "$tmp/h.cpp" 2>"$tmp/h.log"; then
    echo "check_cuda: ok     ext/cuda/ampfunc_cuda.h (host C++)"
  else
    echo "check_cuda: FAILED ext/cuda/ampfunc_cuda.h does not compile as host C++" >&2
    cat "$tmp/h.log" >&2
    status=1
  fi
fi
# The CUDA glue (ext/bindings.cpp with AMPFUNC_WITH_CUDA) must compile against the launchers'
# header: syntax only, with torch's headers (a CPU-only torch lacks one generated CUDA macro
# header, stood in for here). Skipped without python/torch; AMPFUNC_CHECK_GLUE=0 skips it.
if [ "${AMPFUNC_CHECK_GLUE:-1}" != 0 ] && [ -f "$cuda_inc/cuda_runtime.h" ] && command -v "${CXX:-g++}" >/dev/null 2>&1 \
   && incs="$("${PYTHON:-python3}" -c 'import sysconfig
from torch.utils.cpp_extension import include_paths
print("\n".join(include_paths() + [sysconfig.get_paths()["include"]]))' 2>/dev/null)"; then
  glue_flags=(-std=c++20 -fsyntax-only -DAMPFUNC_WITH_CUDA -I "$root/ext" -I "$cuda_inc")
  while IFS= read -r inc; do glue_flags+=(-I "$inc"); done <<<"$incs"
  first_inc="$(head -1 <<<"$incs")"
  if [ ! -f "$first_inc/c10/cuda/impl/cuda_cmake_macros.h" ]; then
    mkdir -p "$tmp/stub/c10/cuda/impl"
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$tmp/stub/c10/cuda/impl/cuda_cmake_macros.h"
    glue_flags+=(-I "$tmp/stub")
  fi
  if "${CXX:-g++}" "${glue_flags[@]}" "$root/ext/bindings.cpp" 2>"$tmp/glue.log"; then
    echo "check_cuda: ok     ext/bindings.cpp with AMPFUNC_WITH_CUDA (host C++, syntax)"
  else
    echo "check_cuda: FAILED ext/bindings.cpp does not compile with AMPFUNC_WITH_CUDA" >&2
    grep -E "error" "$tmp/glue.log" | head -40 >&2
    status=1
  fi
elif [ -n "${PYTHON:-}" ] && [ "${AMPFUNC_CHECK_GLUE:-1}" != 0 ]; then
  # a python was named (CI names its venv's): not being able to check is a failure, not a skip
  echo "check_cuda: FAILED ext/bindings.cpp with AMPFUNC_WITH_CUDA could not be checked with PYTHON=$PYTHON" \
       "(needs g++, the CUDA headers and torch importable there)" >&2
  status=1
else
  echo "check_cuda: ext/bindings.cpp with AMPFUNC_WITH_CUDA not checked (needs g++, the CUDA headers and torch)"
fi
exit $status
