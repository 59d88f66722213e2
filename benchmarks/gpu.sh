#!/usr/bin/env bash
# One GPU, about 11 minutes: the cross-step section (Adam, MultiSteps, the optax protocol,
# TrainStep, both emission modes), the noise-scale cost, the within-step section, TrainStep's
# compile time, issue 33's modes (benchmarks/accel.py: TrainStep per micro-step with each
# accumulator, the protocol path's device conditional against static emit= and TrainStep,
# whether the cuBLAS GEMM adds into the accumulator, beta = 1, read from the optimized HLO; the
# price of the reduction overlapped with the last backward pass where several GPUs are lent),
# then the byte LM's tokens/s at a size that keeps the GPU busy, and FSDP's three points where
# several GPUs are lent (time per update, collectives, memory: fsdp.md). Writes
# benchmarks/results/gpu/ (bench tables and plots, compile.md, accel.md, lm/, fsdp.md).
#
#   bash benchmarks/gpu.sh                     # on the GPU machine, from a clone with .[dev]
#                                              # installed (or PYTHONPATH=. and the image's jax)
#   bash benchmarks/gpu.sh --only cross        # some phases: cross noise within compile accel
#                                              # lm fsdp
#   bash benchmarks/gpu.sh --dry-run           # anywhere (CPU): tiny sizes, into
#                                              # benchmarks/results/tmp/gpu-dry-run/
#
# Each phase is a process of its own under its own time limit (the limits add up to the device
# time a session is lent), and a phase that fails or runs out of time does not stop the others:
# its name and exit status are printed and recorded in phases.txt, and bench.py's parts (written
# after each model and section) are joined into one report that names any part missing or cut
# short. The exit status is non-zero if any phase failed.
#
# The dry run checks that every phase and path runs and writes its files, nothing more: its cost
# is compiling ~100 small XLA programs, so its sizes are the smallest that run every path
# (bench.py's gpu_dry_run, the LM's --size dry), its three chains of phases run side by side, and
# XLA compiles without LLVM's optimizations (216 s on a shared 2-core CPU at load 6.3, 2026-12-02).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
scale=gpu_short
out=benchmarks/results/gpu
lm=(--size gpu)
accel=()
accel_only=microstep,fusion,lm
dry=0
only=cross,noise,within,compile,accel,lm,fsdp
# Seconds per phase on one H200 (cross includes the emission figures). Measured 2026-12-04 (jax
# 0.11.2): cross 177 s, noise 79 s, within 53 s, compile 56 s (and a few seconds to exit), accel
# 44 s; lm ran out of 80 s after its planner (not yet measured whole). About 11 minutes in all:
# where one call may run 10 minutes, run it as two calls,
#   bash benchmarks/gpu.sh --only cross,noise,within && bash benchmarks/gpu.sh --only compile,accel,lm
# (the second call's report joins the first's parts where the machine kept them; else join them
# with python benchmarks/bench.py --combine DIR/parts/*.json --out DIR).
declare -A limit=([cross]=200 [noise]=100 [within]=70 [compile]=75 [accel]=60 [lm]=150
  [fsdp]=120)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --only)
      only="${2:?--only needs a comma-separated list of phases}"
      shift
      ;;
    --limit)  # --limit PHASE=SECONDS, e.g. a phase alone in a call of its own
      l="${2:?--limit needs PHASE=SECONDS}"
      [[ -n "${limit[${l%%=*}]:-}" && "${l#*=}" =~ ^[0-9]+$ ]] || {
        echo "gpu.sh: --limit: expected PHASE=SECONDS with PHASE one of ${!limit[*]}, got '$l'" >&2
        exit 2
      }
      limit[${l%%=*}]=${l#*=}
      shift
      ;;
    *)
      echo "usage: bash benchmarks/gpu.sh [--dry-run] [--only PHASE,...] [--limit PHASE=SECONDS]" >&2
      exit 2
      ;;
  esac
  shift
done
for p in ${only//,/ }; do
  if [[ -z "${limit[$p]:-}" ]]; then
    echo "gpu.sh: --only: unknown phase '$p' (phases: ${!limit[*]})" >&2
    exit 2
  fi
done
if ((dry)); then
  scale=gpu_dry_run
  out=benchmarks/results/tmp/gpu-dry-run
  lm=(--size dry)
  accel=(--quick)
  accel_only=microstep,fusion,overlap,lm  # one process: the overlap rows on 8 host CPU devices
  # Nothing is measured: XLA's CPU backend compiles without LLVM's optimizations (half the time).
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
  XLA_FLAGS+=" --xla_llvm_disable_expensive_passes=true"
fi
mkdir -p "$out/parts"
: >"$out/phases.txt"
python -c "import jax, optax; print('gpu.sh:', jax.default_backend(), jax.devices()[0].device_kind,
  'x', jax.device_count(), '· jax', jax.__version__, '· optax', optax.__version__)" || exit 1
if ! ((dry)) && python -c "import jax; raise SystemExit(jax.device_count() < 2)"; then
  accel_only+=,overlap  # the overlapped reduction needs several devices of this backend
elif ! ((dry)); then
  only=${only//fsdp/}  # FSDP's points need several devices: one GPU has nothing to shard over
fi

phase() {  # phase NAME COMMAND...: run it under NAME's limit (none in the dry run), record it
  local name=$1 t=$SECONDS rc=0
  shift
  [[ ",$only," == *",$name,"* ]] || return 0
  echo "gpu.sh: phase $name (limit ${limit[$name]} s)"
  if ((dry)); then
    "$@" || rc=$?
  else
    timeout --kill-after=10 "${limit[$name]}" "$@" || rc=$?
  fi
  local what="done"
  ((rc == 124 || rc == 137)) && what="stopped at its limit"
  ((rc != 0 && rc != 124 && rc != 137)) && what="FAILED"
  echo "gpu.sh: phase $name $what (rc $rc) in $((SECONDS - t)) s" | tee -a "$out/phases.txt"
}
bench_phase() {  # bench_phase NAME SECTIONS: one bench.py part
  phase "$1" python benchmarks/bench.py --scale "$scale" --only "$2" --part "$out/parts/$1.json"
}
bench_chain() {
  bench_phase cross cross,emission
  bench_phase noise noise
  bench_phase within within
  bench_phase compile compile
}
accel_phase() {
  phase accel python benchmarks/accel.py "${accel[@]}" --only "$accel_only" --out "$out"
}
lm_phase() {
  phase lm python -m optax_accum.demo lm "${lm[@]}" --no-progress --out "$out/lm"
}
fsdp_phase() {  # FSDP's three points (benchmarks/fsdp.py); quick sizes in the dry run
  local quick=()
  ((dry)) && quick=(--quick)
  phase fsdp python benchmarks/fsdp.py "${quick[@]}" --out "$out"
}
if ((dry)); then
  # The three chains at once: each is mostly single-threaded XLA compilation.
  bench_chain &
  bench_pid=$!
  accel_phase &
  accel_pid=$!
  lm_phase
  fsdp_phase
  wait "$bench_pid" "$accel_pid"
else
  bench_chain  # one at a time: the GPU is timed
  accel_phase
  lm_phase
  fsdp_phase
fi
parts=()
for p in cross noise within compile; do
  [[ -e "$out/parts/$p.json" || ",$only," == *",$p,"* ]] && parts+=("$out/parts/$p.json")
done
if ((${#parts[@]})); then
  python benchmarks/bench.py --combine "${parts[@]}" --out "$out" ||
    echo "gpu.sh: phase combine FAILED" | tee -a "$out/phases.txt"
fi
echo "gpu.sh: done in $((SECONDS - start)) s -> $out"
if grep -qv " done " "$out/phases.txt"; then
  echo "gpu.sh: not every phase finished:" >&2
  grep -v " done " "$out/phases.txt" >&2
  exit 1
fi
