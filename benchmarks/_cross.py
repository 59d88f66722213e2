"""Cross-step contenders: one jitted call per micro-batch, params and optimizer state donated.

Every contender runs windows of k micro-steps over the same k micro-batches. The
equivalent ones (accumulate in every spelling, optax.MultiSteps) must land on the parameters
that Adam reaches on the k·b batch directly; `chain(adam, apply_every(k))` (Adam on every
micro-batch, updates summed) and plain Adam at the micro-batch size (the floor) are speed
references only.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum
from benchmarks import _harness as H

LR = 1e-3


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def protocol_step(loss: Callable, tx: optax.GradientTransformation, **update_kwargs) -> Callable:
  """The train step as users write it: grad -> tx.update -> optax.apply_updates."""

  def step(params, state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, state = tx.update(grads, state, params, **update_kwargs)
    return optax.apply_updates(params, updates), state, value

  return step


class Contender:
  """One way of training: compiled program(s), its own params and state, one micro-step per
  `step()` call (the window position is the contender's own business)."""

  name: str
  equivalent: bool = True  # takes part in the agreement check
  programs: dict[str, H.Program]

  def __init__(self, k: int, micro: list):
    self.k = k
    self.micro = micro  # the k micro-batches of a window (device arrays)

  def reset(self, params) -> None:
    raise NotImplementedError

  def step(self):
    """One micro-step (dispatched, not waited for); returns arrays to block on."""
    raise NotImplementedError

  def window(self):
    """k micro-steps: one whole window wherever the contender is in its own."""
    out = None
    for _ in range(self.k):
      out = self.step()
    return out

  @property
  def state_bytes(self) -> int:
    return H.tree_bytes(self.state)

  extra_bytes = 0  # persistent device memory besides params and optimizer state


class Protocol(Contender):
  """grad -> tx.update -> apply, one compiled program (or two with static `emit`)."""

  def __init__(self, name, tx, loss, params, k, micro, *, equivalent=True, static=False):
    super().__init__(k, micro)
    self.name, self.tx, self.equivalent, self.static = name, tx, equivalent, static
    state = tx.init(params)
    if static:
      # Two programs chosen by the host counter: no conditional on the device. At k=1 every
      # call closes its window (`emit=False` is an error there): the emitting program only.
      self.programs = {
        "emit" if emit else "accumulate": H.compile_fn(
          protocol_step(loss, tx, emit=emit), params, state, micro[0], donate_argnums=(0, 1)
        )
        for emit in ((False, True) if k > 1 else (True,))
      }
    else:
      self.programs = {
        "step": H.compile_fn(
          protocol_step(loss, tx), params, state, micro[0], donate_argnums=(0, 1)
        )
      }

  def reset(self, params):
    self.params = _copy(params)
    self.state = self.tx.init(self.params)
    self.i = 0

  def step(self):
    b = self.micro[self.i % self.k]
    if self.static:
      self.last = "emit" if (self.i + 1) % self.k == 0 else "accumulate"
    else:
      self.last = "step"
    self.params, self.state, _ = self.programs[self.last](self.params, self.state, b)
    self.i += 1
    return self.params, self.state


class Fused(Contender):
  """`optax_accum.TrainStep`: the library's static two-program train step (host counter).

  Its gradient buffer (on by default on CPU) lives in the helper, not in the optimizer state:
  `extra_bytes` reports it, read from XLA's accounting of the compiled program's arguments."""

  def __init__(self, name, loss, params, k, micro, **kwargs):
    super().__init__(k, micro)
    self.name = name
    self.helper = optax_accum.TrainStep(loss, optax.adam(LR), every_k=k, **kwargs)
    state = self.helper.init(params)
    self.programs = {
      "emit" if emit else "accumulate": H.compile_lowered(
        lambda emit=emit: self.helper.lower(params, state, micro[0], emit=emit)
      )
      for emit in ((False, True) if k > 1 else (True,))
    }
    # Argument bytes beyond params, optimizer state and the micro-batch: the gradient buffer
    # the helper keeps between calls (0 without one).
    args = next(iter(self.programs.values())).memory.get("argument", 0)
    self._extra = max(0, args - H.tree_bytes((params, state, micro[0])))

  def reset(self, params):
    self.params = _copy(params)
    self.state = self.helper.init(self.params)
    self.i = 0

  @property
  def extra_bytes(self) -> int:
    return self._extra

  def step(self):
    b = self.micro[self.i % self.k]
    self.last = "emit" if self.k == 1 or (self.i + 1) % self.k == 0 else "accumulate"
    self.params, self.state, _ = self.helper(self.params, self.state, b)
    self.i += 1
    return self.params, self.state


def make_contenders(model, params, k: int, micro: list, *, fused: bool = True) -> list[Contender]:
  loss = model.loss
  adam = optax.adam(LR)
  cs: list[Contender] = [
    Protocol("adam (floor)", adam, loss, params, k, micro, equivalent=False),
    Protocol("accumulate", optax_accum.accumulate(adam, k), loss, params, k, micro),
    Protocol(
      "accumulate (skip_nonfinite=False)",
      optax_accum.accumulate(adam, k, skip_nonfinite=False),
      loss,
      params,
      k,
      micro,
    ),
    Protocol(
      "optax.MultiSteps",
      optax.MultiSteps(adam, k).gradient_transformation(),
      loss,
      params,
      k,
      micro,
    ),
    Protocol(
      "chain(adam, apply_every)",
      optax.chain(adam, optax.apply_every(k)),
      loss,
      params,
      k,
      micro,
      equivalent=False,
    ),
    Protocol(
      "accumulate static (emit=, protocol)",
      optax_accum.accumulate(adam, k),
      loss,
      params,
      k,
      micro,
      static=True,
    ),
  ]
  if fused:
    cs.append(Fused("TrainStep", loss, params, k, micro))
    # What the default NaN/Inf guard costs (one read of the gradients every micro-step).
    cs.append(
      Fused("TrainStep (skip_nonfinite=False)", loss, params, k, micro, skip_nonfinite=False)
    )
  return cs


def reference(model, params, micro: list, windows: int):
  """Adam on the k·b batch directly: one step per window, the independent ground truth."""
  big = jax.tree.map(lambda *xs: jnp.concatenate(xs), *micro)
  adam = optax.adam(LR)

  @jax.jit
  def step(p, s):
    g = jax.grad(model.loss)(p, big)
    u, s = adam.update(g, s, p)
    return optax.apply_updates(p, u), s

  p, s = params, adam.init(params)
  for _ in range(windows):
    p, s = step(p, s)
  return p


def mean_tolerance() -> float:
  """The mean |Δparameter| allowed against the large batch: 1e-3·lr where float32 matrix
  products are exact to float32 (CPU), 5e-2·lr on GPU/TPU, whose default float32 matmul
  precision rounds the inputs (TF32 on NVIDIA, bf16 passes on TPU): a gradient component near 0
  then changes sign between the large batch and its micro-batches on ~1 % of coordinates (mean
  1e-5 = 1e-2·lr measured on an H200, 784-2048³-10 MLP, k = 4), while a missed or doubled
  micro-batch still moves most parameters by ~lr."""
  return 1e-3 * LR if jax.default_backend() == "cpu" else 5e-2 * LR


def check_agreement(model, params, cs: list[Contender], micro: list, windows: int):
  """Asserts every equivalent contender lands where Adam on the large batch does.

  Tolerance: Adam divides by sqrt(v), so a gradient component near 0 can change sign under a
  different float32 summation order and move by up to 2·lr per step. We therefore bound the
  largest parameter difference by 2·lr·windows and require the mean difference to be below
  1e-3·lr — a wrong gradient (e.g. a missed or doubled micro-batch) moves most parameters
  by ~lr and fails both.
  """
  ref = reference(model, params, micro, windows)
  mean_tol = mean_tolerance()
  ref_leaves = [np.asarray(x) for x in jax.tree.leaves(ref)]
  report = {}
  for c in cs:
    c.reset(params)
    for _ in range(windows):
      c.window()
    got = [np.asarray(x) for x in jax.tree.leaves(c.params)]
    diffs = np.concatenate([np.abs(a - b).ravel() for a, b in zip(got, ref_leaves, strict=True)])
    worst, mean = float(diffs.max()), float(diffs.mean())
    report[c.name] = {"max_abs": worst, "mean_abs": mean, "checked": c.equivalent}
    if c.equivalent:
      assert worst <= 2 * LR * windows and mean <= mean_tol, (
        f"{c.name} disagrees with Adam on the large batch: max |Δ| {worst:.3g}, "
        f"mean |Δ| {mean:.3g} (lr {LR})"
      )
  return report


def dispatch_profile(c: Contender, windows: int) -> dict[str, float]:
  """Seconds to dispatch `windows` windows without blocking vs to finish them.

  A step that makes the host wait on the device (e.g. a GPU conditional reading its predicate
  back) shows dispatch ≈ total; asynchronous dispatch shows dispatch << total.
  """
  H.block(c.window())
  t0 = time.perf_counter()
  out = None
  for _ in range(windows):
    out = c.window()
  t1 = time.perf_counter()
  H.block(out)
  t2 = time.perf_counter()
  return {"dispatch_s": t1 - t0, "total_s": t2 - t0, "dispatch_frac": (t1 - t0) / (t2 - t0)}


def faults_per_program(c: Contender, windows: int = 2) -> dict[str, float]:
  """Minor page faults per call of each of the contender's programs (median over calls).

  `cost_analysis()` does not see this cost: on CPU, glibc serves an allocation above its mmap
  threshold (32 MiB) with fresh pages on every call, and the kernel faults each page in (about
  2 µs per 4 KiB page). A program whose temporaries stay below the threshold reuses its memory
  and faults about zero times per call."""
  H.block(c.step())
  faults: dict[str, list[int]] = {}
  for _ in range(windows * c.k):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    H.block(c.step())
    faults.setdefault(c.last, []).append(
      resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    )
  return {name: float(np.median(f)) for name, f in faults.items()}


def rounds_for(cfg: dict, k: int, micro_steps: int | None = None) -> int:
  """Rounds of k micro-steps that make up at least `micro_steps` (default: the config's)."""
  steps = cfg["micro_steps"] if micro_steps is None else micro_steps
  return max(cfg["min_rounds"], -(-steps // k))


def time_steps(cs: list[Contender], k: int, rounds: int, cfg: dict, progress=None):
  """Times the contenders side by side: {name: Timing} of time per micro-step.

  Call after every contender has run (e.g. `check_agreement`): no warm-up here."""
  if cfg.get("interleave_steps", True):
    # Step by step, round robin, each step blocked: load bursts on a shared machine hit
    # every contender alike. A sample is still the mean time per micro-step of a window.
    return H.run_interleaved_steps(
      {c.name: c.step for c in cs}, steps=k, rounds=rounds, progress=progress
    )
  # Whole windows dispatched asynchronously (accelerators: keeps dispatch overlap).
  return H.run_side_by_side(
    {c.name: c.window for c in cs}, rounds=rounds, units=float(k), progress=progress, warmup=0
  )


def program_figures(c: Contender) -> dict[str, Any]:
  """What one contender's compiled programs hold and cost besides time: XLA's memory
  accounting, page faults per call, HLO copies and conditionals, compile seconds, and its
  optimizer-state bytes. Steps the contender (2 windows, for the fault counts)."""
  faults = faults_per_program(c)
  progs = {
    name: {
      "compile_s": p.compile_s,
      "memory": p.memory,
      "hlo": p.hlo.as_dict(),
      "faults_per_call": faults.get(name),
      "temp_over_mmap_threshold": p.memory.get("temp", 0) > H.MMAP_THRESHOLD,
    }
    for name, p in c.programs.items()
  }
  # Faults per micro-step: the accumulating program k-1 times, the emitting one once.
  calls = {"accumulate": c.k - 1, "emit": 1, "step": c.k}
  return {
    "temp_bytes": max((p.memory.get("temp", 0) for p in c.programs.values()), default=None),
    "state_bytes": c.state_bytes,
    "extra_bytes": c.extra_bytes,
    "faults_per_step": sum(calls.get(n, 0) * f for n, f in faults.items()) / c.k,
    "copy_bytes": sum(p.hlo.copy_bytes for p in c.programs.values()),
    "conditionals": sum(p.hlo.conditionals for p in c.programs.values()),
    "compile_s": sum(p.compile_s for p in c.programs.values()),
    "programs": progs,
  }


def run(model, cfg: dict, ks: tuple[int, ...], progress=None, log=print) -> list[dict[str, Any]]:
  """All cross-step figures for one model: rows of the results table."""
  params = model.init(jax.random.key(0))
  rows = []
  for k in ks:
    micro = [model.batch(jax.random.key(100 + i), cfg["micro"]) for i in range(k)]
    cs = make_contenders(model, params, k, micro)
    # Two windows check that the state carries over between windows; one suffices at large k.
    agreement = check_agreement(model, params, cs, micro, windows=2 if k < 16 else 1)
    timings = time_steps(cs, k, rounds_for(cfg, k), cfg, progress)
    base = timings["adam (floor)"]
    ms = timings["optax.MultiSteps"]
    adam_mem = cs[0].programs["step"].memory
    adam_state = cs[0].state_bytes
    dispatch = {}
    if cfg.get("dispatch_windows") and k == cfg.get("dispatch_k"):
      for c in cs:
        dispatch[c.name] = dispatch_profile(c, cfg["dispatch_windows"])
    for c in cs:
      t = timings[c.name]
      fig = program_figures(c)
      temp = fig["temp_bytes"]
      rows.append(
        {
          "model": model.name,
          "k": k,
          "contender": c.name,
          "time": t.as_dict(),
          "ratio_vs_adam": H.paired_ratio(t, base),
          "ratio_vs_multisteps": H.paired_ratio(t, ms),
          "temp_bytes": temp,
          "temp_minus_adam": None if temp is None else temp - adam_mem.get("temp", 0),
          "state_bytes": fig["state_bytes"],
          "state_minus_adam": fig["state_bytes"] - adam_state,
          "extra_bytes": fig["extra_bytes"],
          "faults_per_step": fig["faults_per_step"],
          "param_bytes": H.tree_bytes(params),
          "copy_bytes": fig["copy_bytes"],
          "conditionals": fig["conditionals"],
          "compile_s": fig["compile_s"],
          "programs": fig["programs"],
          "agreement": agreement[c.name],
          "dispatch": dispatch.get(c.name),
        }
      )
    log(
      f"[cross] {model.name} k={k}: "
      + ", ".join(f"{c.name} {timings[c.name].median * 1e3:.1f}ms" for c in cs)
    )
    del cs
  return rows
