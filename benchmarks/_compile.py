"""Compile time of `TrainStep` (two programs) against the optax protocol path (one program).

For each cross-step model at one k, in rounds that rotate the contenders' order, each round on
fresh objects (nothing cached): the protocol path's one program (``grad -> accumulate.update ->
apply``, `jax.jit(...).lower(...).compile()`); `TrainStep`'s two programs, the accumulating one
(``grad -> add``) and the closing one (``update -> apply`` on the parameters and the state, no
gradient: the emitting micro-step runs it after the accumulating one), lowered and compiled one
after the other; and `TrainStep.compile` (both lowered, then compiled concurrently). Figures:
the median seconds of each, and the median of per-round ratios to the protocol path (the
target: `TrainStep` ≤ 1.2×).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import optax

import optax_accum
from benchmarks import _cross

CONTENDERS = ("protocol (one program)", "TrainStep, sequential", "TrainStep.compile")


def _protocol(loss, params, batch, k: int) -> float:
  tx = optax_accum.accumulate(optax.adam(_cross.LR), k)
  state = tx.init(params)
  step = jax.jit(_cross.protocol_step(loss, tx), donate_argnums=(0, 1))
  t0 = time.perf_counter()
  step.lower(params, state, batch).compile()
  return time.perf_counter() - t0


def _train_step(loss, params, batch, k: int, concurrent: bool) -> float:
  helper = optax_accum.TrainStep(loss, optax.adam(_cross.LR), every_k=k)
  state = helper.init(params)
  t0 = time.perf_counter()
  if concurrent:
    helper.compile(params, state, batch)
  else:
    for emit in (False, True):
      helper.lower(params, state, batch, emit=emit).compile()
  return time.perf_counter() - t0


def run(model, cfg: dict, k: int, rounds: int, log=print) -> dict[str, Any]:
  """The three compile times on `model` (medians over `rounds`) and the ratios to protocol."""
  params = model.init(jax.random.key(0))
  batch = model.batch(jax.random.key(1), cfg["micro"])
  measure = {
    CONTENDERS[0]: lambda: _protocol(model.loss, params, batch, k),
    CONTENDERS[1]: lambda: _train_step(model.loss, params, batch, k, concurrent=False),
    CONTENDERS[2]: lambda: _train_step(model.loss, params, batch, k, concurrent=True),
  }
  times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
  for r in range(rounds):
    order = CONTENDERS[r % 3 :] + CONTENDERS[: r % 3]
    for name in order:
      times[name].append(measure[name]())
  base = times[CONTENDERS[0]]
  row = {
    "model": model.name,
    "k": k,
    "rounds": rounds,
    "seconds": {name: statistics.median(ts) for name, ts in times.items()},
    "x_protocol": {
      name: statistics.median(t / b for t, b in zip(ts, base, strict=True))
      for name, ts in times.items()
    },
  }
  log(
    f"[compile] {model.name} k={k}: "
    + ", ".join(f"{n} {row['seconds'][n]:.2f} s ({row['x_protocol'][n]:.2f}x)" for n in CONTENDERS)
  )
  return row


def markdown(rows: list[dict]) -> str:
  """The compile-time table."""
  head = "| model | k | " + " | ".join(CONTENDERS) + " |"
  lines = [head, "|---|---:" + "|---:" * len(CONTENDERS) + "|"]
  for r in rows:
    cells = [f"{r['seconds'][n]:.2f} s ({r['x_protocol'][n]:.2f}×)" for n in CONTENDERS]
    lines.append(f"| {r['model']} | {r['k']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)
