"""What `noise_scale=True` costs: each path with the statistics against itself without them.

Two pairs of contenders on each cross-step model: the optax protocol path
(`accumulate(adam, k)`: grad -> update -> apply, one program) and `TrainStep` (two static
programs), each with and without ``noise_scale=True``, stepped round robin in one run by the
cross-step machinery (`_cross`). The statistics cost one squared norm of each micro-batch
gradient, one of the window's mean at emission and a few float32 scalars of state, so the
figures are the time per micro-step with / without, the compiled temp bytes with − without
(program by program) and the optimizer-state bytes with − without.

Before anything is reported, all six contenders must land where Adam on the large batch does
(`_cross.check_agreement`, which also warms them up), and after the timed steps each pair must
still agree and the ``noise_scale=True`` contender must have measured something (finite window
estimates). k = 1 is left out: a window of one micro-batch measures nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np
import optax

import optax_accum
from benchmarks import _cross as X
from benchmarks import _harness as H
from optax_accum.batch_size import _noise
from optax_accum.front_ends import _window

PATHS = ("accumulate (protocol)", "TrainStep")
WITH = " + noise_scale"
BEFORE = " + noise_scale (before issue 22)"


@contextlib.contextmanager
def _separate_finite_check():
  """Traces with the spelling before issue 22: the finite check a pass of its own beside
  ``Σ|g|²``, each squared norm one plain sum, and the window's ``|Σ wᵢgᵢ|²`` read inside the
  conditional that closes it."""
  old = _window.SQ_NORM_IS_FINITE_CHECK, _window.SUMS_SQ_READ, _noise.SUM_ROWS_FIRST
  _window.SQ_NORM_IS_FINITE_CHECK, _window.SUMS_SQ_READ = False, "inside"
  _noise.SUM_ROWS_FIRST = False
  try:
    yield
  finally:
    _window.SQ_NORM_IS_FINITE_CHECK, _window.SUMS_SQ_READ, _noise.SUM_ROWS_FIRST = old


def _traced_before(tx: optax.GradientTransformationExtraArgs) -> Any:
  def update(*args, **kwargs):
    with _separate_finite_check():  # runs while jax traces the step
      return tx.update(*args, **kwargs)

  return optax.GradientTransformationExtraArgs(tx.init, update)


class _BeforeTrainStep(optax_accum.TrainStep):
  def _step(self, *args, **kwargs):
    with _separate_finite_check():
      return super()._step(*args, **kwargs)


def _fused_before(name, model, params, k, micro) -> X.Contender:
  with _separate_finite_check():  # the programs it compiles to read their memory figures
    c = X.Fused(name, model.loss, params, k, micro, noise_scale=True)
  c.helper.__class__ = _BeforeTrainStep  # and the ones it calls: traced with the flag off too
  c.helper._programs = c.helper._jit()
  return c


def make_pairs(model, params, k: int, micro: list) -> dict[str, tuple[X.Contender, ...]]:
  """{path: (without, with, before)} contenders, identical but for ``noise_scale=True`` and,
  for `before`, the spelling before issue 22 (`_separate_finite_check`)."""
  adam = optax.adam(X.LR)

  def protocol(name, **kw):
    return X.Protocol(name, optax_accum.accumulate(adam, k, **kw), model.loss, params, k, micro)

  before_tx = _traced_before(optax_accum.accumulate(adam, k, noise_scale=True))
  return {
    PATHS[0]: (
      protocol("accumulate"),
      protocol("accumulate" + WITH, noise_scale=True),
      X.Protocol("accumulate" + BEFORE, before_tx, model.loss, params, k, micro),
    ),
    PATHS[1]: (
      X.Fused("TrainStep", model.loss, params, k, micro),
      X.Fused("TrainStep" + WITH, model.loss, params, k, micro, noise_scale=True),
      _fused_before("TrainStep" + BEFORE, model, params, k, micro),
    ),
  }


def check_pair(without: X.Contender, with_: X.Contender, updates: int) -> dict[str, Any]:
  """Asserts that a pair, stepped alike, holds the same parameters, and that the contender
  with ``noise_scale=True`` measured a window; returns the differences and its estimates.

  Tolerance as `_cross.check_agreement` (a float32 summation order can flip the sign of a
  near-zero Adam step: up to 2·lr per update; the mean difference must stay below
  `_cross.mean_tolerance()`):
  statistics that leaked into the update would move most parameters by ~lr."""
  assert without.i == with_.i, f"{without.name} took {without.i} steps, {with_.name} {with_.i}"
  a = [np.asarray(x) for x in jax.tree.leaves(without.params)]
  b = [np.asarray(x) for x in jax.tree.leaves(with_.params)]
  diffs = np.concatenate([np.abs(x - y).ravel() for x, y in zip(a, b, strict=True)])
  worst, mean = float(diffs.max()), float(diffs.mean())
  assert worst <= 2 * X.LR * updates and mean <= X.mean_tolerance(), (
    f"{with_.name} disagrees with {without.name} after {with_.i} micro-steps: "
    f"max |Δ| {worst:.3g}, mean |Δ| {mean:.3g} (lr {X.LR})"
  )
  ns = optax_accum.noise_scale(with_.state)
  estimates = {f: float(getattr(ns, f)) for f in ns._fields}
  assert np.isfinite(estimates["window_trace_cov"]) and np.isfinite(estimates["window_grad_sq"]), (
    f"{with_.name} measured no window after {with_.i} micro-steps: {estimates}"
  )
  return {"max_abs": worst, "mean_abs": mean, "micro_steps": with_.i, "noise": estimates}


def _temp_by_program(c: X.Contender) -> dict[str, int]:
  return {name: p.memory.get("temp", 0) for name, p in c.programs.items()}


def pair_row(model, k, path, pair, timings, agreement, params) -> dict[str, Any]:
  """One row of the results: a path's figures without and with the statistics."""
  without, with_, before = pair
  fig0, fig1 = X.program_figures(without), X.program_figures(with_)
  t0, t1, tb = timings[without.name], timings[with_.name], timings[before.name]
  temp0, temp1 = _temp_by_program(without), _temp_by_program(with_)
  temp_diff = {name: temp1[name] - temp0[name] for name in temp0}
  return {
    "model": model.name,
    "k": k,
    "path": path,
    "contenders": [without.name, with_.name],
    "time_without": t0.as_dict(),
    "time_with": t1.as_dict(),
    "ratio": H.paired_ratio(t1, t0),
    # The earlier spelling (finite check and Σ|g|² two passes), timed in the same rounds.
    "time_before": tb.as_dict(),
    "ratio_before": H.paired_ratio(tb, t0),
    "before_over_with": H.paired_ratio(tb, t1),
    "temp_without": fig0["temp_bytes"],
    "temp_with": fig1["temp_bytes"],
    "temp_diff_by_program": temp_diff,
    "temp_diff": max(temp_diff.values()),
    "state_without": fig0["state_bytes"],
    "state_with": fig1["state_bytes"],
    "state_diff": fig1["state_bytes"] - fig0["state_bytes"],
    "extra_diff": fig1["extra_bytes"] - fig0["extra_bytes"],
    "faults_without": fig0["faults_per_step"],
    "faults_with": fig1["faults_per_step"],
    "param_bytes": H.tree_bytes(params),
    "agreement": agreement,
    "programs_without": fig0["programs"],
    "programs_with": fig1["programs"],
  }


def run(model, cfg: dict, progress=None, log=print) -> list[dict[str, Any]]:
  """The noise-scale cost figures for one model, at each k of ``cfg["noise_ks"]``."""
  params = model.init(jax.random.key(0))
  rows = []
  for k in cfg["noise_ks"]:
    micro = [model.batch(jax.random.key(100 + i), cfg["micro"]) for i in range(k)]
    pairs = make_pairs(model, params, k, micro)
    cs = [c for pair in pairs.values() for c in pair]
    # Against the large batch first (and the warm-up the timing loop does not do).
    X.check_agreement(model, params, cs, micro, windows=2 if k < 16 else 1)
    rounds = X.rounds_for(cfg, k, cfg["noise_micro_steps"])
    timings = X.time_steps(cs, k, rounds, cfg, progress)
    for path, (without, with_, before) in pairs.items():
      agreement = check_pair(without, with_, updates=-(-with_.i // k))
      check_pair(without, before, updates=-(-before.i // k))
      rows.append(pair_row(model, k, path, (without, with_, before), timings, agreement, params))
    log(
      f"[noise] {model.name} k={k}: "
      + ", ".join(
        f"{r['path']} {r['ratio']:.3f}× (before {r['ratio_before']:.3f}×, "
        f"temp {r['temp_diff']:+d} B, state "
        f"{r['state_diff']:+d} B, max abs Δparams {r['agreement']['max_abs']:.2g})"
        for r in rows[-len(pairs) :]
      )
    )
    del cs, pairs
  return rows
