#!/usr/bin/env bash
# One call on a CUDA machine (sized for an H200, < 8 minutes from a fresh machine):
#   1. installs carried wheels from .whl/ (optree is missing on the device image; make them with
#      the device README's `pip download ... --python-version 3.12 ... -d .whl optree`, which is
#      gitignored, and pass carry: [".whl"] to the run),
#   2. puts this checkout on PYTHONPATH,
#   3. builds the extension with its CUDA kernels (AMPFUNC_REQUIRE_EXT=1: a failed build fails),
#   4. runs tests/test_cuda.py (its pure step/update tests: one-pass CUDA kernels bit for bit
#      the in-place step's numbers; the pure steps' new state and updates one block per list;
#      check_norm finite past fp32's range of the sum, as on the CPU) and the CUDA tests of the
#      other test files (-k cuda),
#   5. runs benchmarks/bench_step.py --device cuda (every section, (e) included: every step path
#      against torch's fused AdamW, and 10,000 tensors against 200; (g): Lion's step_ and kernel
#      beside AdamW's), then benchmarks/bench_lowmem.py --device cuda (the low-memory settings'
#      step_, fused by ext/cuda/lowmem.cu), then benchmarks/bench_lowmem_gpt.py --device cuda (the
#      low-memory states training a 440M-param GPT: tokens/s, B/param and peak memory per row, beside
#      torch's fused AdamW and, when their wheels are carried, torchao's and bitsandbytes' AdamW8bit;
#      GPT_BENCH_ARGS adds flags, e.g. "--layers 24 --batch 8"). The peers are not on the device
#      image: put their wheels in .whl/ beside optree's (about 47 MB together, under the 64 MiB a
#      call carries), e.g. from the repo root
#        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
#          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl optree torchao bitsandbytes
#      (torchao needs nothing more; bitsandbytes needs numpy and packaging, already there). A peer
#      that does not import is printed as skipped, with the reason, and fails nothing,
#   6. memcheck (and racecheck with GPU_CHECK_RACECHECK=1) of every kernel on odd sizes with
#      compute-sanitizer, when present and time is left,
#   7. prints a short table.
# Steps share a budget of GPU_CHECK_BUDGET seconds (default 450): each gets at most what is
# left, so the whole call ends in time even when a step hangs.
# Everything is also written to $OUT/gpu_check.log when $OUT is set (the device tool's folder).
# Usage: bash benchmarks/gpu_check.sh [--quick]   (--quick: the benchmark's quick mode)
#        BENCH_ARGS="--elements 268435456" bash benchmarks/gpu_check.sh   (extra benchmark flags)
set -u
SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
cd "$(dirname "$SELF")/.."
QUICK=""
[ "${1:-}" = "--quick" ] && QUICK="--quick"
if [ -n "${OUT:-}" ] && [ -z "${GPU_CHECK_TEED:-}" ]; then  # rerun self with all output tee'd
  mkdir -p "$OUT"
  GPU_CHECK_TEED=1 bash "$SELF" "$@" 2>&1 | tee -a "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
T0=$(date +%s)
declare -a ROWS=()
row() { ROWS+=("$(printf '%-34s %-8s %6ss  %s' "$1" "$2" "$3" "${4:-}")"); }
since() { echo $(( $(date +%s) - $1 )); }
banner() { echo; echo "=== $* ($(since "$T0")s) ==="; }
BUDGET="${GPU_CHECK_BUDGET:-450}"
left() {  # seconds a step may take: its cap, or what is left of the budget (minus the table)
  local rest=$(( BUDGET - $(since "$T0") - 10 ))
  [ "$rest" -lt "$1" ] && echo "$(( rest > 1 ? rest : 1 ))" || echo "$1"
}

# 1. carried wheels -------------------------------------------------------------------------
banner "environment"
if compgen -G ".whl/*.whl" >/dev/null; then
  # (the device README's line; a wheel for another Python only warns: the import check below decides)
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "warning: the wheels in .whl/ did not install"
  fi
fi
# 2. this checkout --------------------------------------------------------------------------
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export AMPFUNC_EXT_CACHE="${AMPFUNC_EXT_CACHE:-/tmp/ampfunc_ext}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
"$PY" - <<'EOF' || { echo "python/torch/optree not usable"; exit 1; }
import sys, torch, optree
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  cuda {torch.version.cuda}  optree {optree.__version__}")
assert torch.cuda.is_available(), "torch sees no CUDA device"
p = torch.cuda.get_device_properties(0)
print(f"device {p.name}  sm_{p.major}{p.minor}  {p.multi_processor_count} SMs  {p.total_memory / 2**30:.0f} GiB")
EOF
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
  export TORCH_CUDA_ARCH_LIST
fi
echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS cache=$AMPFUNC_EXT_CACHE"

# 3. build ----------------------------------------------------------------------------------
banner "build the extension (CPU + CUDA kernels)"
t=$(date +%s)
if AMPFUNC_REQUIRE_EXT=1 AMPFUNC_EXT_VERBOSE="${AMPFUNC_EXT_VERBOSE:-0}" "$PY" - <<'EOF'
from ampfunc import ops
backend = ops.load()
print("backend:", backend, "| reason:", ops.backend_reason())
assert backend == "cpu+cuda", f"CUDA kernels not loaded: {ops.backend_reason()}"
EOF
then
  row "build (AMPFUNC_REQUIRE_EXT=1)" ok "$(since "$t")"
  BUILD_OK=1
else
  row "build (AMPFUNC_REQUIRE_EXT=1)" FAILED "$(since "$t")" "rerun with AMPFUNC_EXT_VERBOSE=1 for the compiler output"
  BUILD_OK=0
fi

# 4. tests ----------------------------------------------------------------------------------
pytest_row() {  # name, log file, status, seconds: the row carries pytest's summary line
  local summary
  summary="$(grep -E '[0-9]+ (passed|failed|skipped|deselected|error)|no tests ran' "$2" | tail -1 | tr -d '=')"
  row "$1" "$3" "$4" "$summary"
}
if [ "$BUILD_OK" = 1 ]; then
  banner "tests/test_cuda.py"
  t=$(date +%s)
  log=/tmp/gpu_check_test_cuda.log
  # The tests that need the GPU (-m cuda) only: the host-emulation tests of the same file need
  # none and run in CI; here they would spend the budget before the GPU tests run.
  AMPFUNC_REQUIRE_EXT=1 timeout "$(left 200)" "$PY" -m pytest tests/test_cuda.py -m cuda -q -rfEs -p no:cacheprovider \
    ${OUT:+--junitxml="$OUT/test_cuda.xml"} 2>&1 | tee "$log"
  st=${PIPESTATUS[0]}
  pytest_row "pytest tests/test_cuda.py -m cuda" "$log" "$([ "$st" = 0 ] && echo ok || echo "FAILED($st)")" "$(since "$t")"

  banner "CUDA tests of the other test files (-k cuda)"
  t=$(date +%s)
  log=/tmp/gpu_check_test_other.log
  AMPFUNC_REQUIRE_EXT=1 timeout "$(left 150)" "$PY" -m pytest tests -q -rfEs -p no:cacheprovider -k "cuda or gpu" \
    --ignore=tests/test_cuda.py --ignore=tests/test_notebooks.py 2>&1 | tee "$log"
  st=${PIPESTATUS[0]}
  [ "$st" = 5 ] && st=0  # "no tests collected" is not a failure
  pytest_row "pytest tests -k cuda (others)" "$log" "$([ "$st" = 0 ] && echo ok || echo "FAILED($st)")" "$(since "$t")"
else
  row "pytest tests/test_cuda.py" skipped 0 "no CUDA build"
fi

# 5. benchmark ------------------------------------------------------------------------------
if [ "$BUILD_OK" = 1 ] && [ -f benchmarks/bench_step.py ]; then
  banner "benchmarks/bench_step.py --device cuda $QUICK ${BENCH_ARGS:-}"
  t=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$(left 200)" "$PY" benchmarks/bench_step.py --device cuda $QUICK ${BENCH_ARGS:-} 2>&1 \
    | tee /tmp/gpu_check_bench.log
  st=${PIPESTATUS[0]}
  [ -n "${OUT:-}" ] && cp /tmp/gpu_check_bench.log "$OUT/bench_cuda.log"
  row "bench_step.py --device cuda $QUICK" "$([ "$st" = 0 ] && echo ok || echo "FAILED($st)")" "$(since "$t")"
else
  row "bench_step.py --device cuda" skipped 0 "$([ -f benchmarks/bench_step.py ] || echo 'no benchmarks/bench_step.py')"
fi

# 5b. the low-memory step (master="split", moments bf16 / q8: ext/cuda/lowmem.cu) -----------------
if [ "$BUILD_OK" = 1 ] && [ -f benchmarks/bench_lowmem.py ] && [ "$(left 60)" -ge 60 ]; then
  banner "benchmarks/bench_lowmem.py --device cuda --before $QUICK"
  t=$(date +%s)
  timeout "$(left 120)" "$PY" benchmarks/bench_lowmem.py --device cuda --before $QUICK 2>&1 | tee /tmp/gpu_check_lowmem.log
  st=${PIPESTATUS[0]}
  [ -n "${OUT:-}" ] && cp /tmp/gpu_check_lowmem.log "$OUT/bench_lowmem_cuda.log"
  row "bench_lowmem.py --device cuda $QUICK" "$([ "$st" = 0 ] && echo ok || echo "FAILED($st)")" "$(since "$t")"
else
  row "bench_lowmem.py --device cuda" skipped 0 "no CUDA build, no benchmarks/bench_lowmem.py or no time left"
fi

# 5c. the low-memory states training a GPT-style model (tokens/s, peak memory; peers from .whl/) -----
if [ "$BUILD_OK" = 1 ] && [ -f benchmarks/bench_lowmem_gpt.py ] && [ "$(left 90)" -ge 90 ]; then
  banner "benchmarks/bench_lowmem_gpt.py --device cuda $QUICK ${GPT_BENCH_ARGS:-}"
  t=$(date +%s)
  log=/tmp/gpu_check_lowmem_gpt.log
  # shellcheck disable=SC2086
  timeout "$(left 180)" "$PY" benchmarks/bench_lowmem_gpt.py --device cuda $QUICK ${GPT_BENCH_ARGS:-} 2>&1 | tee "$log"
  st=${PIPESTATUS[0]}
  [ -n "${OUT:-}" ] && cp "$log" "$OUT/bench_lowmem_gpt_cuda.log"
  ran="$(grep -E '^(torchao|bitsandbytes) AdamW8bit \(' "$log" | grep -vc 'failed:')"
  row "bench_lowmem_gpt.py --device cuda $QUICK" "$([ "$st" = 0 ] && echo ok || echo "FAILED($st)")" "$(since "$t")" \
    "peers timed: ${ran:-0} of 2$(grep -qE '^(torchao|bitsandbytes) AdamW8bit.*(skipped|failed):' "$log" && echo ' (the log says why not)')"
else
  row "bench_lowmem_gpt.py --device cuda" skipped 0 "no CUDA build, no benchmarks/bench_lowmem_gpt.py or no time left"
fi

# 6. compute-sanitizer ----------------------------------------------------------------------
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)"
if [ "$BUILD_OK" = 1 ] && [ -n "$SAN" ] && [ -z "${GPU_CHECK_NO_SANITIZER:-}" ] && [ "$(left 60)" -ge 60 ]; then
  cat >/tmp/gpu_check_smoke.py <<'EOF'
# Every CUDA kernel once on odd sizes (tails, unaligned views, several launches), for the sanitizer.
import torch
from ampfunc import ops
dev = "cuda"
C = 65536
sizes = [1, 7, 3 * C + 17, 4099] + [1 + i % 50 for i in range(700)]
for dt in (torch.float32, torch.float16, torch.bfloat16):
    xs = [torch.randn(n + 1, device=dev).to(dt)[1:] for n in sizes]  # offset by one element: unaligned
    xs[2][-1] = float("inf")
    ops.check(xs, per_leaf=True)
    ops.unscale(xs, torch.tensor(0.5, device=dev))
    ops.unscale_(xs, torch.tensor(0.5, device=dev))
    ps = [torch.randn(n, device=dev) for n in sizes]
    st = [torch.zeros(n, device=dev) for n in sizes]
    st2 = [torch.zeros(n, device=dev) for n in sizes]
    st3 = [torch.zeros(n, device=dev) for n in sizes]
    model = [torch.empty(n, device=dev, dtype=torch.bfloat16) for n in sizes]
    step = torch.zeros((), device=dev)
    one, yes = torch.ones((), device=dev), torch.tensor(True, device=dev)
    grads = [torch.randn(n, device=dev).to(dt) for n in sizes]
    ops.adam_step_(ps, grads, st, st2, st3, model, step, one, yes, lr=1e-3, amsgrad=True, weight_decay=0.1,
                   decoupled_weight_decay=True)
    ops.sgd_step_(ps, grads, st, model, step, one, yes, lr=0.1, momentum=0.9, nesterov=True)
    ops.sgd_step_(ps, grads, st, model, step, one, yes, lr=0.1, momentum=0.9, nesterov=True)
    # the pure optimizers' ops and the robust norm
    ops.check_norm(xs, torch.tensor(0.5, device=dev), per_leaf=True)
    ops.adam_update(ps, grads, st, st2, st3, step, one, lr=1e-3, amsgrad=True, weight_decay=0.1,
                    decoupled_weight_decay=True)
    ops.adam_update(None, grads, st, st2, None, step, one, lr=1e-3)
    ops.sgd_update(ps, grads, st, step, one, lr=0.1, momentum=0.9, weight_decay=0.01)
    ops.sgd_update(None, grads, st, step, one, lr=0.1, momentum=0.9)
    # the pure steps' out-of-place kernels (11 lists for Adam: several launches here), unaligned
    # params, taken and skipped (the skip copies every input to its output)
    pu = [torch.randn(n + 1, device=dev)[1:] for n in sizes]
    for fin in (yes, torch.tensor(False, device=dev)):
        ops.adam_step(pu, grads, st, st2, st3, model, step, one, fin, lr=1e-3, amsgrad=True, weight_decay=0.1,
                      decoupled_weight_decay=True)
        ops.sgd_step(pu, grads, st, model, step, one, fin, lr=0.1, momentum=0.9)
        ops.lion_step(pu, grads, st, model, step, one, fin, lr=1e-4, weight_decay=0.1)
    # the generic optimizers' kernel (ext/cuda/optimizers.cu): Lion in place, pure, as an update
    ops.lion_step_(ps, grads, st, model, step, one, yes, lr=1e-4, weight_decay=0.1)
    ops.lion_update(ps, grads, st, step, one, lr=1e-4, weight_decay=0.1)
    ops.lion_update(None, grads, st, step, one, lr=1e-4)
    ops.apply_updates(xs, grads)
# the low-memory step (ext/cuda/lowmem.cu): split and fp32 masters, q8 / bf16 / fp32 moments, odd sizes
from ampfunc.lowbits import q8_lookup, quantize_q8, split_bf16
lm = [(C + 512, "q8"), (4096, "q8"), (7, "bf16"), (4099, "fp32"), (1, "fp32")]
P, R, M, MA, V, VA, G = [], [], [], [], [], [], []
for i, (n, kind) in enumerate(lm):
    x = torch.randn(n, device=dev)
    if i % 2 == 0:
        hi, lo = split_bf16(x)
        P.append(hi), R.append(lo)
    else:
        P.append(x), R.append(torch.zeros(0, dtype=torch.int16, device=dev))
    G.append(torch.randn(n, device=dev).to((torch.float32, torch.float16, torch.bfloat16)[i % 3]))
    m, v = torch.randn(n, device=dev) * 1e-2, torch.rand(n, device=dev) * 1e-4
    if kind == "q8":
        (a, b), (c, d) = quantize_q8(m, True), quantize_q8(v, False)
        M.append(a), MA.append(b), V.append(c), VA.append(d)
    else:
        dt = torch.bfloat16 if kind == "bf16" else torch.float32
        M.append(m.to(dt)), V.append(v.to(dt))
        MA.append(torch.zeros(0, device=dev)), VA.append(torch.zeros(0, device=dev))
maps, bases = q8_lookup(dev)
step = torch.zeros((), device=dev)
for fin in (torch.tensor(True, device=dev), torch.tensor(False, device=dev)):
    torch.ops.ampfunc.adam_lowmem_step_(P, R, G, M, MA, V, VA, step, torch.ones((), device=dev), fin, maps, bases,
                                        1e-3, None, 0.9, 0.999, 1e-8, 0.1, True, False)
s, g, h = torch.ones((), device=dev), torch.zeros((), dtype=torch.int32, device=dev), torch.ones((), dtype=torch.int32, device=dev)
ops.update_scale_(s, g, h, torch.tensor(False, device=dev), growth_factor=2.0, backoff_factor=0.5, growth_interval=2,
                  min_scale=1.0, max_scale=2.0 ** 24, hysteresis=1)
torch.cuda.synchronize()
print("smoke ok")
EOF
  for tool in memcheck ${GPU_CHECK_RACECHECK:+racecheck}; do
    [ "$(left 60)" -ge 40 ] || { row "compute-sanitizer $tool" skipped 0 "no time left"; continue; }
    banner "compute-sanitizer --tool $tool"
    t=$(date +%s)
    log=/tmp/gpu_check_$tool.log
    # Without the caching allocator every tensor is its own allocation: overruns are caught.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(left 120)" "$SAN" --tool "$tool" --error-exitcode 99 \
      --kernel-name regex:ampfunc "$PY" /tmp/gpu_check_smoke.py >"$log" 2>&1
    st=$?
    tail -5 "$log"
    summary="$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
    if [ "$st" != 0 ] && grep -qiE 'device not supported|not supported on this platform' "$log"; then
      # the sandboxed runtime of some device machines: the tool cannot attach (not a kernel defect)
      row "compute-sanitizer $tool" unsupported "$(since "$t")" "$(grep -iE 'not supported' "$log" | head -1)"
      continue
    fi
    row "compute-sanitizer $tool" "$([ "$st" = 0 ] && echo ok || echo "FAILED($st)")" "$(since "$t")" "$summary"
  done
elif [ "$BUILD_OK" = 1 ]; then
  row "compute-sanitizer" skipped 0 "$([ -n "$SAN" ] && echo 'no time left or disabled' || echo 'not installed')"
fi

# fp8 (ampfunc/fp8.py; the fp8 helper's section) ---------------------------------------------
# FP8 linear layers on the GPU: tests/test_fp8.py's CUDA cases (_scaled_mm against the emulation,
# padding to multiples of 16, a compiled GPT step equal to eager) and tokens/s of fp8 against bf16 on
# the scaled-up GPT (benchmarks/bench_fp8.py --speed; FP8_BENCH_ARGS adds flags, e.g.
# "--d-model 4096 --layers 4"). Needs sm89+ for fp8 matmuls, not the extension. Skip: GPU_CHECK_NO_FP8=1.
if [ -f benchmarks/bench_fp8.py ] && [ -z "${GPU_CHECK_NO_FP8:-}" ] && [ "$(left 60)" -ge 60 ]; then
  banner "fp8: tests/test_fp8.py -k cuda"
  t=$(date +%s)
  log=/tmp/gpu_check_fp8_test.log
  timeout "$(left 150)" "$PY" -m pytest tests/test_fp8.py -q -rfEs -p no:cacheprovider -k cuda 2>&1 | tee "$log"
  st=${PIPESTATUS[0]}
  pytest_row "pytest tests/test_fp8.py -k cuda" "$log" "$([ "$st" = 0 ] && echo ok || echo "FAILED($st)")" "$(since "$t")"
  banner "fp8: benchmarks/bench_fp8.py --speed ${FP8_BENCH_ARGS:-}"
  t=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$(left 300)" "$PY" benchmarks/bench_fp8.py --speed ${FP8_BENCH_ARGS:-} 2>&1 | tee /tmp/gpu_check_fp8_bench.log
  st=${PIPESTATUS[0]}
  [ -n "${OUT:-}" ] && cp /tmp/gpu_check_fp8_bench.log "$OUT/bench_fp8_cuda.log"
  row "bench_fp8.py --speed" "$([ "$st" = 0 ] && echo ok || echo "FAILED($st)")" "$(since "$t")" \
    "$(grep -E '^fp8 / bf16' /tmp/gpu_check_fp8_bench.log | tail -1)"
elif [ -f benchmarks/bench_fp8.py ]; then
  row "fp8 tests + bench_fp8.py" skipped 0 "$([ -n "${GPU_CHECK_NO_FP8:-}" ] && echo disabled || echo 'no time left')"
fi

# 7. table ----------------------------------------------------------------------------------
echo
echo "=== gpu_check summary ($(date -u '+%Y-%m-%d %H:%M UTC'), $(since "$T0")s total) ==="
printf '%-34s %-8s %7s  %s\n' "step" "status" "time" "detail"
for r in "${ROWS[@]}"; do echo "$r"; done
if printf '%s\n' "${ROWS[@]}" | grep -q 'FAILED'; then exit 1; fi
exit 0
