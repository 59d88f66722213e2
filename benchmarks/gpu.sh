#!/usr/bin/env bash
# One GPU, at most 8 minutes: the cross-step section (Adam, MultiSteps, the optax protocol,
# TrainStep, both emission modes), the within-step section, the noise-scale cost, TrainStep's
# compile time, issue 33's modes (benchmarks/accel.py: TrainStep per micro-step with each
# accumulator, the protocol path's device conditional against static emit= and TrainStep,
# whether the cuBLAS GEMM adds into the accumulator, beta = 1, read from the optimized HLO, the
# price of the reduction overlapped with the last backward pass — compile seconds and time per
# micro-step against the closing program, on the GPUs when several are lent, else on 8 host CPU
# devices — and the byte LM's final loss with each accumulator), then the language model's
# tokens/s at a size that keeps the GPU busy, and FSDP's three points (time per update, collectives,
# memory: fsdp.md). Writes benchmarks/results/gpu/ (bench tables and plots, compile.md, accel.md,
# lm/, fsdp.md).
#
#   bash benchmarks/gpu.sh             # on the GPU machine, from a clone with .[dev] installed
#   bash benchmarks/gpu.sh --dry-run   # anywhere (CPU): tiny sizes, into benchmarks/results/tmp/
#                                      # (216 s on a shared 2-core CPU, load 6.3 at the
#                                      # start, 2026-12-02: accel.py's phase, 199 s, is the
#                                      # longest of the three, which run side by side)
#
# The dry run checks that every section and path runs and writes its files, nothing more: its
# cost is compiling ~100 small XLA programs, so its sizes are the smallest that run every path
# (bench.py's gpu_dry_run, the LM's --size dry), its two phases run side by side, and XLA
# compiles without LLVM's optimizations.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
scale=gpu_short
out=benchmarks/results/gpu
lm=(--size gpu)
limit=(timeout 280)  # each phase has its own limit: the whole stays within 8 minutes
accel_limit=(timeout 80)  # (280 + 80 + 120 s; not yet run on a GPU: the limits are estimates)
accel=()
lm_limit=(timeout 120)
if [[ "${1:-}" == "--dry-run" ]]; then
  scale=gpu_dry_run
  out=benchmarks/results/tmp/gpu-dry-run
  lm=(--size dry)
  limit=()  # a shared CPU is slower than the GPU budget assumes
  accel_limit=()
  accel=(--quick)
  # Nothing is measured: XLA's CPU backend compiles without LLVM's optimizations (half the time).
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
  XLA_FLAGS+=" --xla_llvm_disable_expensive_passes=true"
  lm_limit=()
elif [[ -n "${1:-}" ]]; then
  echo "usage: bash benchmarks/gpu.sh [--dry-run]" >&2
  exit 2
fi
python -c "import jax; print('gpu.sh:', jax.default_backend(), jax.devices()[0].device_kind)"
bench=("${limit[@]}" python benchmarks/bench.py --scale "$scale"
  --only cross,emission,noise,within,compile --out "$out")
accel_run=("${accel_limit[@]}" python benchmarks/accel.py "${accel[@]}"
  --only microstep,fusion,overlap,lm --out "$out")
lm_run=("${lm_limit[@]}" python -m optax_accum.demo lm "${lm[@]}" --no-progress --out "$out/lm")
# FSDP's three points (benchmarks/fsdp.py): on the GPUs when 8 are lent, else on 8 host CPU
# devices; its quick sizes in the dry run (9 small programs).
fsdp_quick=()
[[ "$scale" == gpu_dry_run ]] && fsdp_quick=(--quick)
fsdp_run=("${lm_limit[@]}" python benchmarks/fsdp.py "${fsdp_quick[@]}" --out "$out")
if [[ "$scale" == gpu_dry_run ]]; then
  # The three phases at once: each is mostly single-threaded XLA compilation.
  "${bench[@]}" &
  bench_pid=$!
  "${accel_run[@]}" &
  accel_pid=$!
  if ! "${lm_run[@]}"; then
    kill "$bench_pid" "$accel_pid" 2>/dev/null || true
    exit 1
  fi
  wait "$bench_pid"
  wait "$accel_pid"
  "${fsdp_run[@]}"
else
  "${bench[@]}"
  "${accel_run[@]}"
  "${lm_run[@]}"
  "${fsdp_run[@]}"
fi
echo "gpu.sh: done in $((SECONDS - start)) s -> $out"
