"""Small models: where the time of an accumulated step goes, side by side with the alternatives.

Issue 34, item 18. The shapes are those of the programs the library was dropped into: optax's
gradient-accumulation notebook (its MLP, and the transformer of the issue's port), the Equinox
CNN example, the Flax NNX MNIST tutorial's CNN and a nanodo-style small language model — all
written here in plain JAX (the frameworks add nothing to the compiled programs compared).

Per model, after checking that every equivalent contender lands on the large batch's
parameters (Adam, one update), two kinds of contenders are timed in rotating rounds:

* **cross-step** (one jitted call per micro-batch, params and state donated; seconds per
  micro-step): `accumulate(adam, k)` inside the user's own jitted step; `TrainStep`;
  `optax.MultiSteps(adam, k)` in the same step; a hand-written cross-step loop (a jitted
  ``acc + grad`` on k−1 micro-steps, ``acc + grad → adam → apply`` on the k-th), and the same made
  NaN-safe as `TrainStep` is (`NanSafeHandLoop`); plain Adam at the micro-batch size (the
  floor: no accumulation at all).
* **in-step** (one jitted call per update; seconds per update): `microbatch` (default, rolled
  loop) and ``unroll=True``; `optax.microbatching.microbatch` (MEAN); a hand-written
  `lax.scan` and the same unrolled; the large batch (the limit, not a target).

The notebook MLP's cross-step contenders are timed once more in `--processes` fresh processes
(default 5), one after another (`cross_over_processes`): on a 2-CPU machine one process is one
draw, and the same code's ratio to the hand loop moves by several percent between processes.
The median over processes is the figure issue 42's item 7 is judged by.

Also: XLA's compiled temporary bytes and compile seconds of the in-step programs (what
``unroll=True`` costs), and, among the cross-step contenders, the per-call dispatch floor: a
jitted identity on the same params and Adam state (donated), the least any
one-call-per-micro-step path pays per call.

    python benchmarks/small_models.py --rounds 61  # the committed run
    python benchmarks/small_models.py --rounds 3 --processes 2 --models notebook_mlp nnx_cnn

About 4 CPU-minutes, most of them compiling (some 80 programs) and the NNX CNN's rolled loops
(0.8 s a step on CPU), and a minute or so per process of `--processes`; the committed run took
934 s on a 2-core machine at a load average of 1-3 (an earlier one, without the processes,
20 minutes at a load average of 10 to 13). A cross-step sample runs whole windows for at least
`SAMPLE_S` (0.05 s): the calls of consecutive windows are dispatched without waiting, as a
training loop dispatches them, and a small model's window (a fraction of a millisecond) is not
timed alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optax_accum  # noqa: E402
from benchmarks import _harness as H  # noqa: E402
from benchmarks import _models  # noqa: E402
from optax_accum.core import _core  # noqa: E402
from optax_accum.front_ends import _host, _train_step  # noqa: E402

LR = 1e-3
# Adam's eps, above the default 1e-8: Adam's first update is -LR * g / (|g| + eps), which with a
# tiny eps is -LR * sign(g), blind to a wrong scale of the gradient (a sum for a mean). With
# eps = 1e-3 the agreement check below sees the scale; the programs timed are the same.
EPS = 1e-3
OUT = Path(__file__).resolve().parent / "results" / "cpu"


# ----------------------------------------------------------------------------------------------
# The models, plain JAX.


@dataclass(frozen=True)
class Small:
  name: str
  what: str  # the program it stands for, and the shape
  model: _models.Model
  b: int  # micro-batch size
  k: int  # micro-batches per update


def _dense(key, a, b):
  return {"w": jax.random.normal(key, (a, b)) / a**0.5, "b": jnp.zeros(b)}


def _conv(x, w, padding):
  return lax.conv_general_dilated(x, w, (1, 1), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _images(classes=10):
  def batch(key, n):
    kx, ky = jax.random.split(key)
    x = jax.random.uniform(kx, (n, 28, 28, 1))
    return x, jax.random.randint(ky, (n,), 0, classes)

  return batch


def _xent(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def nnx_cnn() -> _models.Model:
  """Flax NNX MNIST tutorial: conv 3x3 32, avg-pool, conv 3x3 64, avg-pool, 3136-256-10."""

  def init(key):
    k = jax.random.split(key, 4)
    return {
      "c1": jax.random.normal(k[0], (3, 3, 1, 32)) / 3,
      "c2": jax.random.normal(k[1], (3, 3, 32, 64)) / 17,
      "l1": _dense(k[2], 3136, 256),
      "l2": _dense(k[3], 256, 10),
    }

  def pool(x):
    return lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4

  def loss(p, batch):
    x, y = batch
    x = pool(jax.nn.relu(_conv(x, p["c1"], "SAME")))
    x = pool(jax.nn.relu(_conv(x, p["c2"], "SAME")))
    x = jax.nn.relu(x.reshape(x.shape[0], -1) @ p["l1"]["w"] + p["l1"]["b"])
    return _xent(x @ p["l2"]["w"] + p["l2"]["b"], y)

  return _models.Model("nnx_cnn", init, loss, _images())


def equinox_cnn() -> _models.Model:
  """Equinox CNN example: conv 4x4 3 (valid), max-pool 2 stride 1, 1728-512-64-10."""

  def init(key):
    k = jax.random.split(key, 4)
    return {
      "c": jax.random.normal(k[0], (4, 4, 1, 3)) / 4,
      "l1": _dense(k[1], 1728, 512),
      "l2": _dense(k[2], 512, 64),
      "l3": _dense(k[3], 64, 10),
    }

  def loss(p, batch):
    x, y = batch
    x = _conv(x, p["c"], "VALID")
    x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "VALID")
    x = jax.nn.relu(x).reshape(x.shape[0], -1)
    for name in ("l1", "l2"):
      x = jax.nn.relu(x @ p[name]["w"] + p[name]["b"])
    return _xent(x @ p["l3"]["w"] + p["l3"]["b"], y)

  return _models.Model("equinox_cnn", init, loss, _images())


def notebook_mlp() -> _models.Model:
  """optax's gradient-accumulation notebook: MLP 784-32-32-10 on (28, 28, 1) images."""
  mlp = _models.mlp((784, 32, 32, 10))

  def loss(p, batch):
    x, y = batch
    return mlp.loss(p, (x.reshape(x.shape[0], -1), y))

  return _models.Model("notebook_mlp", mlp.init, loss, _images())


def models() -> dict[str, Small]:
  tr = _models.transformer
  return {
    s.name: s
    for s in (
      Small("notebook_mlp", "optax notebook: MLP 784-32-32-10, b=3, k=3", notebook_mlp(), 3, 3),
      Small(
        "notebook_transformer",
        "optax notebook port: transformer vocab 128, width 64, 2 layers, 32 tokens, b=8, k=4",
        tr(128, 64, 2, 4, 32, name="notebook_transformer"),
        8,
        4,
      ),
      Small("equinox_cnn", "Equinox CNN example, b=64, k=4", equinox_cnn(), 64, 4),
      Small("nnx_cnn", "Flax NNX MNIST CNN, b=32, k=4", nnx_cnn(), 32, 4),
      Small(
        "nanodo_lm",
        "nanodo-style LM: vocab 256, width 128, 2 layers, 64 tokens, b=8, k=4",
        tr(256, 128, 2, 4, 64, name="nanodo_lm"),
        8,
        4,
      ),
    )
  }


# ----------------------------------------------------------------------------------------------
# Cross-step contenders: each a `Runner` that does one window (k micro-steps) per call.


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def adam() -> optax.GradientTransformation:
  return optax.adam(LR, eps=EPS)


def _n(*trees) -> int:
  return len(jax.tree.leaves(trees))


def _passed(compiled) -> int:
  """The arrays a compiled program's call passes in and hands back."""
  return _n(compiled.in_avals) + _n(compiled.out_info)


class Runner:
  """A contender: `window()` dispatches one window's calls and returns arrays to block on;
  `params` after a window is what the agreement check reads; `arrays()` is how many arrays its
  calls of one window pass in and hand back (each costs the call dispatch time)."""

  def __init__(self, params):
    self.params = _copy(params)

  def window(self) -> Any:
    raise NotImplementedError

  def arrays(self) -> int | None:
    return None


def _protocol(loss, tx):
  def step(params, state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  return jax.jit(step, donate_argnums=(0, 1))


class Protocol(Runner):
  """``grad → tx.update → apply`` in the user's own jit (accumulate, MultiSteps, plain Adam)."""

  def __init__(self, params, loss, tx, micro):
    super().__init__(params)
    self.state, self.step, self.micro = tx.init(self.params), _protocol(loss, tx), micro

  def window(self):
    for mb in self.micro:
      self.params, self.state, value = self.step(self.params, self.state, mb)
    return self.params, value

  def arrays(self):
    return len(self.micro) * (_n(self.params, self.state, self.micro[0]) * 2 + 1 - _n(self.micro))


class Train(Runner):
  """`TrainStep(loss, adam, k, **options)`, called once per micro-batch. `two_programs`: the
  emitting micro-step runs the accumulating program and then the closing one whatever the
  model's size (``_train_step.FUSED_EMIT_MAX_OPS = 0`` while the object decides), the path
  before issue 42's item 7 for a small model, as a contender in the same run."""

  def __init__(self, params, loss, k, micro, two_programs=False, **options):
    super().__init__(params)
    with _max_ops(0 if two_programs else _train_step.FUSED_EMIT_MAX_OPS):
      self.step = optax_accum.TrainStep(loss, adam(), k, **options)
      self.state, self.micro = self.step.init(self.params), micro
      self.step.compile(self.params, self.state, micro[0])

  def window(self):
    for mb in self.micro:
      self.params, self.state, value = self.step(self.params, self.state, mb)
    return self.params, value

  def arrays(self):
    programs = self.step._compiled[self.step._key]
    k = len(self.micro)
    if self.step._fused_emit:
      return (k - 1) * _passed(programs[False]) + _passed(programs[True])
    return k * _passed(programs[False]) + _passed(programs[True])


@contextlib.contextmanager
def _max_ops(value: int):
  """`_train_step.FUSED_EMIT_MAX_OPS` set to `value` while a `TrainStep` chooses its programs."""
  saved = _train_step.FUSED_EMIT_MAX_OPS
  _train_step.FUSED_EMIT_MAX_OPS = value
  try:
    yield
  finally:
    _train_step.FUSED_EMIT_MAX_OPS = saved


def _timed_compile(lowered) -> tuple[Any, float, float]:
  """The compiled program, and its compile's wall and CPU seconds (CPU: this process's, which a
  loaded machine does not inflate as much)."""
  t, c = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  return compiled, time.perf_counter() - t, time.process_time() - c


def train_step_programs(s: Small, params, micro) -> dict:
  """What TrainStep chose for this model and why: its accumulating program's size (lowered
  operations, `_host.ops`) against `FUSED_EMIT_MAX_OPS`, and the compile seconds of each
  program, for both choices (one emitting program, or the closing one after the accumulating
  one), on fresh objects."""
  out = {"max_ops": _train_step.FUSED_EMIT_MAX_OPS}
  for name, max_ops in (("one", 10**9), ("two", 0)):
    with _max_ops(max_ops):
      step = optax_accum.TrainStep(s.model.loss, adam(), s.k)
      state = step.init(params)
      accumulating = step.lower(params, state, micro[0])
      emitting = step.lower(params, state, micro[0], emit=True)
    _, acc_wall, acc_cpu = _timed_compile(accumulating)
    _, emit_wall, emit_cpu = _timed_compile(emitting)
    out["ops"] = _host.ops(accumulating)
    out[name] = {"accumulating": [acc_wall, acc_cpu], "emitting": [emit_wall, emit_cpu]}
  chosen = optax_accum.TrainStep(s.model.loss, adam(), s.k)
  chosen.lower(params, chosen.init(params), micro[0], emit=True)
  out["chosen"] = "one" if chosen._fused_emit else "two"
  return out


class HandLoop(Runner):
  """The hand-written cross-step loop: a gradient buffer donated through k−1 ``acc + grad``
  calls, and one ``acc + grad → mean → adam → apply`` call closing the window."""

  def __init__(self, params, loss, k, micro):
    super().__init__(params)
    tx, vg = adam(), jax.value_and_grad(loss)
    self.state, self.micro, self.k = tx.init(self.params), micro, k
    self.acc = jax.tree.map(jnp.zeros_like, self.params)

    def add(acc, params, batch):
      value, g = vg(params, batch)
      return jax.tree.map(jnp.add, acc, g), value

    def close(acc, params, state, batch):
      acc, value = add(acc, params, batch)
      updates, state = tx.update(jax.tree.map(lambda a: a / k, acc), state, params)
      zeros = jax.tree.map(jnp.zeros_like, acc)
      return zeros, optax.apply_updates(params, updates), state, value

    self.add = jax.jit(add, donate_argnums=0)
    self.close = jax.jit(close, donate_argnums=(0, 1, 2))

  def window(self):
    for mb in self.micro[:-1]:
      self.acc, value = self.add(self.acc, self.params, mb)
    self.acc, self.params, self.state, value = self.close(
      self.acc, self.params, self.state, self.micro[-1]
    )
    return self.params, value

  def arrays(self):
    p, s, b = _n(self.params), _n(self.state), _n(self.micro[0])
    # k − 1 adds: (acc, params, batch) → (acc, value); the close: (acc, params, state, batch)
    # → (zeros, params, state, value)
    return (len(self.micro) - 1) * (3 * p + b + 1) + 4 * p + 2 * s + b + 1


class NanSafeHandLoop(Runner):
  """The hand loop, NaN-safe: each micro-batch's gradient is checked (`_core.all_finite`,
  pooled: the check `TrainStep` uses on one device), a non-finite one adds nothing and is
  counted, and the window's mean divides by the micro-batches kept. `counters` more int32
  scalars ride every call (in, +1, out)."""

  def __init__(self, params, loss, k, micro, counters=0):
    super().__init__(params)
    tx, vg = adam(), jax.value_and_grad(loss)
    self.state, self.micro = tx.init(self.params), micro
    self.acc = jax.tree.map(jnp.zeros_like, self.params)
    self.kept = (jnp.float32(0), jnp.int32(0))  # (micro-batches kept, dropped so far)
    self.counters = tuple(jnp.int32(i) for i in range(counters))

    def add(acc, kept, counters, params, batch):
      value, g = vg(params, batch)
      ok = _core.all_finite(g, pooled=True)
      acc = jax.tree.map(lambda a, x: jnp.where(ok, a + x, a), acc, g)
      kept = (kept[0] + jnp.where(ok, 1.0, 0.0), kept[1] + jnp.where(ok, 0, 1))
      return acc, kept, tuple(c + 1 for c in counters), value

    def close(acc, kept, counters, params, state, batch):
      acc, kept, counters, value = add(acc, kept, counters, params, batch)
      n = kept[0]
      mean = jax.tree.map(lambda a: jnp.where(n > 0, a / jnp.maximum(n, 1.0), 0.0), acc)
      updates, state = tx.update(mean, state, params)
      zeros = jax.tree.map(jnp.zeros_like, acc)
      params = optax.apply_updates(params, updates)
      return zeros, (jnp.float32(0), kept[1]), counters, params, state, value

    self.add = jax.jit(add, donate_argnums=(0, 1, 2))
    self.close = jax.jit(close, donate_argnums=(0, 1, 2, 3, 4))

  def window(self):
    for mb in self.micro[:-1]:
      self.acc, self.kept, self.counters, value = self.add(
        self.acc, self.kept, self.counters, self.params, mb
      )
    self.acc, self.kept, self.counters, self.params, self.state, value = self.close(
      self.acc, self.kept, self.counters, self.params, self.state, self.micro[-1]
    )
    return self.params, value


class Dispatch(Runner):
  """The per-call floor: a jitted identity on the parameters and Adam's state (donated), once
  per micro-step: what any one-call-per-micro-step path pays whatever the model computes."""

  def __init__(self, params, k):
    super().__init__(params)
    self.tree, self.k = (self.params, adam().init(self.params)), k
    self.ident = jax.jit(lambda t: t, donate_argnums=0)

  def window(self):
    for _ in range(self.k):
      self.tree = self.ident(self.tree)
    return self.tree

  def arrays(self):
    return self.k * 2 * _n(self.tree)


def per_array_cost(rounds: int, calls: int = 200) -> dict:
  """The dispatch time one array passed to a call (and handed back) costs: a jitted identity
  (donated) on 2 and on 64 small arrays, timed side by side; per array = the difference over
  2 × 62 arrays."""
  few, many = (_copy([jnp.zeros(8) + i for i in range(n)]) for n in (2, 64))
  ident = jax.jit(lambda t: t, donate_argnums=0)
  trees = {"2": few, "64": many}

  def run(name):
    def window():
      for _ in range(calls):
        trees[name] = ident(trees[name])
      return trees[name]

    return window

  for n in trees:
    H.block(run(n)())
  t = H.run_side_by_side({n: run(n) for n in trees}, rounds=rounds, units=calls)
  return {
    "2": t["2"].median,
    "64": t["64"].median,
    "per_array": (t["64"].median - t["2"].median) / 124,
  }


def cross_runners(s: Small, params, micro) -> dict[str, Runner]:
  loss, k = s.model.loss, s.k
  return {
    "accumulate": Protocol(params, loss, optax_accum.accumulate(adam(), k), micro),
    "TrainStep": Train(params, loss, k, micro),
    "TrainStep, two programs": Train(params, loss, k, micro, two_programs=True),
    "MultiSteps": Protocol(params, loss, optax.MultiSteps(adam(), k), micro),
    "hand loop": HandLoop(params, loss, k, micro),
    "hand loop, NaN-safe": NanSafeHandLoop(params, loss, k, micro),
    "adam (floor)": Protocol(params, loss, adam(), micro),
    "dispatch": Dispatch(params, k),
  }


# ----------------------------------------------------------------------------------------------
# In-step contenders: one jitted step per update, the whole k·b batch in.


def _hand_scan(vg, k: int, unroll: int | bool):
  """A minimal hand-written scan: strided micro-batches, (loss, grad) summed, divided once."""

  def grads(params, batch):
    mb = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)

    def body(acc, one):
      return jax.tree.map(jnp.add, acc, vg(params, one)), None

    zero = jax.tree.map(jnp.zeros_like, (jnp.float32(0), params))
    acc, _ = lax.scan(body, zero, mb, unroll=unroll)
    return jax.tree.map(lambda a: a / k, acc)

  return grads


def in_step_grads(s: Small) -> dict[str, Callable]:
  vg, k = jax.value_and_grad(s.model.loss), s.k
  mean = optax.microbatching.AccumulationType.MEAN
  return {
    "microbatch": optax_accum.microbatch(vg, k),
    "microbatch unroll=True": optax_accum.microbatch(vg, k, unroll=True),
    "optax.microbatching": optax.microbatch(vg, argnums=1, microbatch_size=s.b, accumulator=mean),
    "hand scan": _hand_scan(vg, k, 1),
    "hand scan unrolled": _hand_scan(vg, k, True),
    "large batch": vg,
  }


def _in_step(grads: Callable, tx):
  def step(params, state, batch):
    value, g = grads(params, batch)
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state, value

  return step


class InStep(Runner):
  def __init__(self, params, program: H.Program, tx, batch):
    super().__init__(params)
    self.state, self.program, self.batch = tx.init(self.params), program, batch

  def window(self):
    self.params, self.state, value = self.program(self.params, self.state, self.batch)
    return self.params, value


def in_step_runners(s: Small, params, batch) -> tuple[dict[str, Runner], dict[str, dict]]:
  """The in-step runners, and each program's compile seconds and temporary bytes."""
  tx, runners, programs = adam(), {}, {}
  state = tx.init(params)
  for name, grads in in_step_grads(s).items():
    program = H.compile_fn(_in_step(grads, tx), params, state, batch, donate_argnums=(0, 1))
    runners[name] = InStep(params, program, tx, batch)
    programs[name] = {"compile_s": program.compile_s, "temp_bytes": program.memory["temp"]}
  return runners, programs


# ----------------------------------------------------------------------------------------------
# Measuring.


def check_agreement(
  runners: dict[str, Runner], want: Any, skip=("adam (floor)", "dispatch")
) -> dict:
  """One window each (which also compiles); every equivalent contender's parameters must be
  the large batch's after its one Adam update."""
  diffs = {}
  for name, r in runners.items():
    H.block(r.window())
    if name in skip:
      continue
    diffs[name] = H.max_diff(r.params, want)[0]
    # Adam's first step moves a weight by LR·|g|/(|g| + EPS): a gradient off by a factor moves
    # it by ~1e-4 more; float32 rounding of a sum of k micro-batch gradients by ~1e-7.
    assert diffs[name] < 1e-6, (name, diffs[name])
  return diffs


def large_batch_update(s: Small, params, batch):
  tx = adam()
  step = jax.jit(_in_step(jax.value_and_grad(s.model.loss), tx))
  return step(params, tx.init(params), batch)[0]


def inputs(s: Small) -> tuple[Any, Any, list]:
  """The model's parameters, one step's batch of k·b rows, and its k micro-batches: micro-batch
  i takes rows i, i+k, ... (strided), as microbatch's default split does."""
  params = s.model.init(jax.random.key(0))
  batch = s.model.batch(jax.random.key(1), s.k * s.b)
  return params, batch, [jax.tree.map(lambda x, i=i: x[i :: s.k], batch) for i in range(s.k)]


def measure(s: Small, rounds: int, log: Callable) -> dict:
  params, batch, micro = inputs(s)
  want = large_batch_update(s, params, batch)
  cross = cross_runners(s, params, micro)
  inner, programs = in_step_runners(s, params, batch)
  diffs = {**check_agreement(cross, want), **check_agreement(inner, want, skip=())}
  log(f"{s.name}: contenders agree (max |Δparams| {max(diffs.values()):.1e}); timing")
  t_cross, reps = time_cross(s, cross, rounds)
  t_in = H.run_side_by_side({n: r.window for n, r in inner.items()}, rounds=rounds)
  return {
    "model": s.name,
    "what": s.what,
    "params": _models.num_params(params),
    "k": s.k,
    "b": s.b,
    "max_abs_diff": diffs,
    "cross": {n: t.as_dict() for n, t in t_cross.items()},
    "arrays_per_step": {n: r.arrays() / s.k for n, r in cross.items() if r.arrays() is not None},
    "windows_per_sample": reps,
    "train_step_programs": train_step_programs(s, params, micro),
    "cross_ratio": _ratios(
      t_cross,
      ("MultiSteps", "hand loop"),
      ("accumulate", "TrainStep", "TrainStep, two programs", "hand loop, NaN-safe"),
    ),
    "in": {n: {**t.as_dict(), **programs[n]} for n, t in t_in.items()},
    "in_ratio": _ratios(
      t_in,
      ("optax.microbatching", "hand scan"),
      ("microbatch", "microbatch unroll=True", "hand scan unrolled", "large batch"),
    ),
  }


def time_cross(s: Small, cross: dict[str, Runner], rounds: int) -> tuple[dict, int]:
  """The cross-step contenders timed side by side: ``(timings per micro-step, windows per
  sample)``."""
  reps = _repeats(cross["hand loop"].window)
  windows = {n: _repeated(r.window, reps) for n, r in cross.items()}
  return H.run_side_by_side(windows, rounds=rounds, units=s.k * reps), reps


def checked_and_timed(s: Small, make: Callable, rounds: int) -> dict:
  """Contenders `make(s, params, micro)` (a "hand loop" among them) in this process, checked
  against the large batch, then timed side by side: each one's median (µs per micro-step), its
  median of per-round ratios to the hand loop, and the windows a sample ran."""
  params, batch, micro = inputs(s)
  runners = make(s, params, micro)
  check_agreement(runners, large_batch_update(s, params, batch))
  timed, reps = time_cross(s, runners, rounds)
  base = timed["hand loop"]
  return {
    "us": {n: t.median * 1e6 for n, t in timed.items()},
    "ratio": {n: H.paired_ratio(t, base) for n, t in timed.items()},
    "windows_per_sample": reps,
  }


def cross_in_this_process(name: str, rounds: int) -> dict:
  """`name`'s cross-step contenders alone in this process (`checked_and_timed`)."""
  return checked_and_timed(models()[name], cross_runners, rounds)


def cross_over_processes(name: str, rounds: int, processes: int, log: Callable) -> dict:
  """`name`'s cross-step contenders timed in `processes` fresh processes (`in_fresh_processes`
  of `cross_in_this_process`), summed up by `over_runs`."""
  cmd = [sys.executable, __file__, "--cross-only", name, "--rounds", str(rounds)]

  def say(i: int, run: dict) -> None:
    log(f"{name}, process {i}/{processes}: TrainStep {run['ratio']['TrainStep']:.3f}×")

  runs = in_fresh_processes(cmd, processes, say)
  return {"processes": processes, **over_runs(runs), "runs": runs}


def in_fresh_processes(cmd: list[str], processes: int, log: Callable) -> list[dict]:
  """`cmd` run `processes` times, one after another, each a fresh process that compiles its
  programs and places its buffers anew, and prints its result as JSON on its last line. On
  the 2-CPU machine these results come from, one process is one draw: the same code's ratio
  to the hand loop moves by several percent from one process to the next, more than within
  one. `log(i, result)` after each."""
  runs = []
  for i in range(processes):
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
      raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    log(i + 1, runs[-1])
  return runs


def over_runs(runs: list[dict]) -> dict:
  """Per contender, over the processes' results (``{"us": {name: µs}, "ratio": {name: ratio
  to the hand loop}}`` each): the median µs, the median ratio and the ratios' range."""
  names = list(runs[0]["us"])
  ratios = {n: [r["ratio"][n] for r in runs] for n in names}
  return {
    "us": {n: statistics.median(r["us"][n] for r in runs) for n in names},
    "ratio": {n: statistics.median(ratios[n]) for n in names},
    "range": {n: (min(ratios[n]), max(ratios[n])) for n in names},
  }


# A timed sample of the cross-step contenders lasts at least this long: a window of a small
# model takes well under a millisecond, where one sample would be at the mercy of the scheduler.
SAMPLE_S = 0.05


def _repeats(window: Callable[[], Any], probes: int = 5) -> int:
  """How many windows make one sample of at least `SAMPLE_S` seconds (from the fastest of a
  few probes)."""
  best = float("inf")
  for _ in range(probes):
    t = time.perf_counter()
    H.block(window())
    best = min(best, time.perf_counter() - t)
  return max(1, math.ceil(SAMPLE_S / best))


def _repeated(window: Callable[[], Any], reps: int) -> Callable[[], Any]:
  def run():
    for _ in range(reps):
      out = window()
    return out

  return run


def _ratios(t: dict[str, H.Timing], best_of: tuple[str, ...], ours: tuple[str, ...]) -> dict:
  """Each contender's paired ratio to the best (lowest median) of `best_of`."""
  best = min(best_of, key=lambda n: t[n].median)
  return {"best": best, **{n: H.paired_ratio(t[n], t[best]) for n in (*ours, *best_of)}}


# ----------------------------------------------------------------------------------------------
# Report.


def _ms(x: float) -> str:
  return f"{x * 1e3:.2f} ms" if x >= 1e-3 else f"{x * 1e6:.0f} µs"


def table(results: list[dict], kind: str) -> list[str]:
  names = list(results[0][kind])
  lines = ["| model | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
  for r in results:
    ratio = r[f"{kind}_ratio"]
    cells = []
    for n in names:
      cell = _ms(r[kind][n]["median_s"])
      if n in ratio:
        cell += f" ({ratio[n]:.2f}×)" + (" ◆" if n == ratio["best"] else "")
      cells.append(cell)
    lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
  return lines


def over_processes_table(over: dict | None, rounds: int) -> list[str]:
  """The notebook MLP's cross-step contenders over fresh processes (`cross_over_processes`)."""
  if over is None:
    return []
  lines = [
    f"### The notebook MLP in {over['processes']} fresh processes",
    "",
    "One process is one draw (its programs compiled, its buffers placed, the machine's load "
    "of those minutes): on this machine the same code's ratio moves by several percent from "
    f"one process to the next, more than within one. Its cross-step contenders again, each "
    f"process on its own ({rounds} rounds, checked against the large batch first), one after "
    "another; the median over processes is the figure for issue 42's item 7 (`TrainStep` "
    "within 1.10× of the hand loop).",
    "",
    "µs: the median over processes of each one's median (not paired: compare the ratios, each "
    "a median of per-round ratios within its process).",
    "",
    "| contender | µs per micro-step | / hand loop: median over processes | lowest | highest |",
    "|---|---:|---:|---:|---:|",
  ]
  for n, us in over["us"].items():
    lo, hi = over["range"][n]
    ratio = over["ratio"][n]
    lines.append(f"| {n} | {us:.1f} | **{ratio:.3f}×** | {lo:.3f}× | {hi:.3f}× |")
  return [*lines, ""]


def memory_table(results: list[dict]) -> list[str]:
  names = ("microbatch", "microbatch unroll=True", "hand scan unrolled", "large batch")
  lines = [
    "| model | " + " | ".join(f"{n}: temp, compile" for n in names) + " |",
    "|---|" + "---:|" * len(names),
  ]
  for r in results:
    cells = [
      f"{H.fmt_bytes(r['in'][n]['temp_bytes'])}, {r['in'][n]['compile_s']:.1f} s" for n in names
    ]
    lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
  return lines


def arrays_table(results: list[dict], per_array: float) -> list[str]:
  names = ("hand loop", "MultiSteps", "accumulate", "TrainStep", "TrainStep, two programs")
  lines = ["| model | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
  for r in results:
    n = r["arrays_per_step"]
    cells = [f"{n[x]:.0f} ({_ms(n[x] * per_array)})" for x in names]
    lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
  return lines


def programs_table(results: list[dict]) -> list[str]:
  """TrainStep's choice per model, and the compile seconds (wall, CPU) behind it."""
  lines = [
    "| model | accumulating program: operations | emitting micro-step | compile: accumulating "
    "| compile: one emitting program | compile: closing program |",
    "|---|---:|---|---:|---:|---:|",
  ]
  for r in results:
    p = r["train_step_programs"]
    sec = lambda w_c: f"{w_c[0]:.2f} s ({w_c[1]:.2f} s CPU)"  # noqa: E731
    chosen = "one program" if p["chosen"] == "one" else "two programs"
    lines.append(
      f"| {r['model']} | {p['ops']} | {chosen} | {sec(p['one']['accumulating'])} | "
      f"{sec(p['one']['emitting'])} | {sec(p['two']['emitting'])} |"
    )
  return lines


def report(results: list[dict], meta: dict) -> str:
  shapes = [f"- `{r['model']}`: {r['what']} ({r['params']:,} parameters)" for r in results]
  cols = ("dispatch", "adam (floor)", "accumulate", "TrainStep")
  floor = [
    f"| {r['model']} | " + " | ".join(_ms(r["cross"][n]["median_s"]) for n in cols) + " |"
    for r in results
  ]
  return "\n".join(
    [
      "# Small models: per-call overhead and the micro-batch loop (issue 34, item 18; issue 42, "
      "item 7)",
      "",
      f"`python benchmarks/small_models.py --rounds {meta['rounds']}`; {meta['when']}, "
      f"{meta['machine']}, jax {meta['jax']}, optax {meta['optax']}; {meta['total_s']:.0f} s "
      f"in all; load average {meta['load_start']} at the start, {meta['load']} at the end.",
      "",
      *shapes,
      "",
      "Every equivalent contender was first checked to land on the large batch's parameters "
      "after one Adam update (max |Δ| below 1e-6). Medians over rounds that rotate the "
      "contenders' order; in brackets the median of per-round ratios to the best (◆) of the "
      "alternatives of its kind.",
      "",
      "## Cross-step: time per micro-step",
      "",
      "Ratios against the better of `optax.MultiSteps` and the hand-written loop. Each timed "
      f"sample runs whole windows for at least {SAMPLE_S * 1e3:.0f} ms (the notebook MLP's: "
      f"{results[0]['windows_per_sample']} windows). `TrainStep, two programs`: the same "
      "object made to run the accumulating program and then the closing one on each window's "
      "last micro-step (what it did for every model before issue 42). `hand loop, NaN-safe`: "
      "the hand loop with `TrainStep`'s promise (a micro-batch whose gradient holds a NaN or "
      "Inf adds nothing and is counted; the library's pooled finite check), the like-for-like "
      "hand-written contender for `TrainStep`'s default.",
      "",
      *table(results, "cross"),
      "",
      *over_processes_table(meta["mlp_over_processes"], meta["rounds"]),
      "## TrainStep: one program per micro-step where compiling the backward pass twice is cheap",
      "",
      "Without an axis, `TrainStep` runs one program on a window's last micro-step (gradient, "
      "add, update, apply) instead of the accumulating program and then the closing one, when "
      "its accumulating program has at most `_train_step.FUSED_EMIT_MAX_OPS` = "
      f"{results[0]['train_step_programs']['max_ops']} operations (lowered) and the "
      "parameters are below 32 MiB: that program then compiles the backward pass a second "
      "time. Compile seconds of each program on fresh objects (wall, and this process's CPU "
      "seconds, which a loaded machine inflates less):",
      "",
      *programs_table(results),
      "",
      "## In-step: time per update (k micro-batches)",
      "",
      "Ratios against the better of `optax.microbatching.microbatch` and a hand-written "
      "`lax.scan` (both rolled loops).",
      "",
      *table(results, "in"),
      "",
      "## What unrolling costs: compiled temporary memory and compile time",
      "",
      *memory_table(results),
      "",
      "## The per-call floor",
      "",
      "A jitted identity on the same parameters and Adam state (donated; timed in the same "
      "rounds as the cross-step contenders) against a plain Adam micro-step and the "
      "library's micro-steps:",
      "",
      "| model | dispatch (identity) | adam micro-step | accumulate | TrainStep |",
      "|---|---:|---:|---:|---:|",
      *floor,
      "",
      "What a call costs beyond its computation grows with the arrays it passes in and hands "
      "back: a jitted identity (donated) on 64 small arrays against 2, side by side, "
      f"{_ms(meta['arrays']['64'])} against {_ms(meta['arrays']['2'])} per call, i.e. "
      f"**{meta['arrays']['per_array'] * 1e6:.2f} µs per array**. Arrays passed per "
      "micro-step (in and out, averaged over the window) and what they cost at that rate:",
      "",
      *arrays_table(results, meta["arrays"]["per_array"]),
      "",
    ]
  )


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--models", nargs="*", default=None, help="a subset of the models")
  ap.add_argument("--out", type=Path, default=OUT)
  ap.add_argument(
    "--processes", type=int, default=5, help="fresh processes for the notebook MLP's cross-step"
  )
  ap.add_argument("--cross-only", help="(internal) one model's cross-step in this process, JSON")
  args = ap.parse_args(argv)
  if args.cross_only:
    print(json.dumps(cross_in_this_process(args.cross_only, args.rounds)))
    return
  t0 = time.time()
  load_start = f"{os.getloadavg()[0]:.1f}"
  chosen = models()
  names = args.models or list(chosen)
  log = lambda m: print(m, flush=True)  # noqa: E731
  results = [measure(chosen[n], args.rounds, log) for n in names]
  arrays = per_array_cost(args.rounds)
  over = None
  if "notebook_mlp" in names and args.processes:
    over = cross_over_processes("notebook_mlp", args.rounds, args.processes, log)
  meta = {
    "rounds": args.rounds,
    "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "machine": f"{jax.default_backend()}, {os.cpu_count()} CPUs, {platform.machine()}",
    "jax": jax.__version__,
    "optax": optax.__version__,
    "total_s": time.time() - t0,
    "load": f"{os.getloadavg()[0]:.1f}",
    "load_start": load_start,
    "arrays": arrays,
    "mlp_over_processes": over,
  }
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "small_models.json").write_text(
    json.dumps({"meta": meta, "results": results}, indent=1)
  )
  text = report(results, meta)
  (args.out / "small_models.md").write_text(text)
  print(text)


if __name__ == "__main__":
  main()
