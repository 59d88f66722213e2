"""The four training runs of the language-model task, on the same windows of micro-batches.

* ``large batch``: one `jax.value_and_grad` over the window's k micro-batches concatenated (the
  reference);
* ``TrainStep``: `optax_accum.TrainStep` with ``weight_fn`` = the micro-batch's real tokens, one
  jitted micro-step per micro-batch; it also measures the gradient noise scale B_simple (in
  tokens: the weights count them) from its micro-batches, read after each window;
* ``microbatch``: `optax_accum.microbatch` of the loss's gradient with the same ``weight_fn``, the
  k micro-batches in one jitted step;
* ``naive``: `optax.MultiSteps`, the plain mean of the k micro-batch means (what a hand loop
  gives): a micro-batch with few real tokens counts as much as one with many.

Each run records, per optimizer step, the window's loss as the large batch defines it (the mean
over all its real tokens, before the update), so the curves compare like with like.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum
from optax_accum.core import _hlo
from optax_accum.demo.lm import model

METHODS = ("large batch", "TrainStep", "microbatch", "naive")
# The float32 floor: the large batch again, its micro-batches concatenated in reverse order. Its
# distance to the large batch is what summing the same numbers in another order alone does.
FLOOR = "large batch, reordered"


@dataclasses.dataclass
class Result:
  """What one training run produced."""

  name: str
  losses: np.ndarray  # per optimizer step: the window's token-mean loss, before its update
  reported: np.ndarray  # per optimizer step: the loss the method itself reports
  params: Any
  peak_bytes: int  # XLA's compiled peak of the training step program (the larger of two)
  seconds: float  # the training loop, compilation and warm-up excluded
  tokens: int  # real tokens trained on
  # the median over windows of a window's real tokens / its time (after a warm-up window on
  # copies, so the first timed window does not pay for first-call costs)
  tokens_per_s: float
  final_loss: float = float("nan")  # held-out token-mean loss after training
  max_param_diff: float = float("nan")  # vs the large batch
  # TrainStep only, per optimizer step: the smoothed B_simple and the window's own T/Q, in tokens
  b_simple: np.ndarray | None = None
  window_b_simple: np.ndarray | None = None


def concat(window: Sequence[dict]) -> dict:
  """The window's micro-batches as one large batch (contiguous: micro-batch i is block i)."""
  return {key: np.concatenate([mb[key] for mb in window]) for key in window[0]}


def _peak(compiled) -> int:
  return _hlo.memory(compiled).get("peak", 0)


def _token_mean(losses, window) -> float:
  counts = [float(mb["mask"].sum()) for mb in window]
  return float(np.dot(jax.device_get(losses), counts) / sum(counts))


def _commit(tree):
  """A copy of `tree` committed to the default device, as every step's outputs are: the
  `TrainStep` programs compiled in the warm-up are the ones the timed run calls."""
  return jax.device_put(jax.device_get(tree), jax.devices()[0])


def _micro_steps(step):
  """The window as k calls of the micro-step `step`: the token mean and the mean of means."""

  def window_step(params, state, window):
    values = []
    for mb in window:
      params, state, value = step(params, state, mb)
      values.append(value)
    return params, state, _token_mean(values, window), np.mean(jax.device_get(values))

  return window_step


def _jitted(step, params, state, batch):
  """`step` jitted (params and state donated), compiled for `batch`, and its compiled peak."""
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, batch).compile()
  return compiled, _peak(compiled)


_LARGE: dict = {}  # the large batch's compiled step, by loss: its reordered run reuses it


def _adam_step(grad_fn, tx):
  def step(params, state, batch):
    loss, grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


def large_batch(loss, params, windows, lr, order=1):
  """The reference: one step per window on the concatenated batch (`order=-1`: reversed)."""
  adam = optax.adam(lr)
  state = adam.init(params)
  if _LARGE.get("key") != (loss, lr):
    step = _adam_step(jax.value_and_grad(loss), adam)
    _LARGE.update(key=(loss, lr), program=_jitted(step, params, state, concat(windows[0])))
  compiled, peak = _LARGE["program"]

  def window_step(params, state, window):
    params, state, value = compiled(params, state, concat(window[::order]))
    return params, state, value, value

  return window_step, params, state, peak


NOISY = "TrainStep"  # the run that measures the noise scale


def _noise(state) -> tuple[float, float]:
  """The smoothed B_simple and the last window's T/Q, in tokens, from a `TrainStep` state."""
  ns = jax.device_get(optax_accum.noise_scale(state))
  return float(ns.b_simple), float(ns.window_trace_cov / ns.window_grad_sq)


def train_step(loss, params, windows, lr):
  """`TrainStep` with token weights: k micro-steps per window."""
  step = optax_accum.TrainStep(
    loss, optax.adam(lr), len(windows[0]), weight_fn=model.real_tokens, noise_scale=True
  )
  state = _commit(step.init(params))
  # The emitting program (gradient, accumulator and Adam's update) is the larger of the two.
  peak = _peak(step.lower(params, state, windows[0][0], emit=True).compile())
  warm_params = _commit(params)
  warm_state = _commit(step.init(warm_params))
  for mb in windows[0] * 2:  # compile its programs before the clock starts, on copies
    warm_params, warm_state, _ = step(warm_params, warm_state, mb)
  _noise(warm_state)  # and the few scalar operations that read the noise scale

  return _micro_steps(step), params, state, peak


def in_step(loss, params, windows, lr):
  """`microbatch` with token weights: the k micro-batches in one step's loop."""
  k, adam = len(windows[0]), optax.adam(lr)
  grad_fn = optax_accum.microbatch(
    jax.value_and_grad(loss), k, batch_argnums=(1,), weight_fn=model.real_tokens,
    split="contiguous",
  )  # fmt: skip
  state = adam.init(params)
  compiled, peak = _jitted(_adam_step(grad_fn, adam), params, state, concat(windows[0]))

  def window_step(params, state, window):
    params, state, value = compiled(params, state, concat(window))
    return params, state, value, value

  return window_step, params, state, peak


def naive(loss, params, windows, lr):
  """`optax.MultiSteps`: the unweighted mean of the k micro-batch means."""
  tx = optax.MultiSteps(optax.adam(lr), len(windows[0]))
  state = tx.init(params)
  compiled, peak = _jitted(_adam_step(jax.value_and_grad(loss), tx), params, state, windows[0][0])

  return _micro_steps(compiled), params, state, peak


BUILDERS: dict[str, Callable] = {
  "large batch": large_batch,
  "TrainStep": train_step,
  "microbatch": in_step,
  "naive": naive,
  FLOOR: lambda *args: large_batch(*args, order=-1),
}


class _Run:
  """One method's training run, stepped one window at a time (compiled and warmed up first)."""

  def __init__(self, name: str, loss, params0, windows, lr: float):
    self.name, n = name, len(windows)
    params = _commit(params0)  # a copy: the steps donate their inputs
    self.window_step, self.params, self.state, self.peak = BUILDERS[name](loss, params, windows, lr)
    self.window_step(_commit(self.params), _commit(self.state), windows[0])  # warm-up, on copies
    self.losses, self.reported, self.seconds = np.zeros(n), np.zeros(n), np.zeros(n)
    self.noise = np.full((n, 2), np.nan)

  def step(self, s: int, window) -> None:
    start = time.perf_counter()
    self.params, self.state, value, said = self.window_step(self.params, self.state, window)
    self.losses[s], self.reported[s] = float(value), float(said)  # waits for the window's end
    self.seconds[s] = time.perf_counter() - start
    if self.name == NOISY:
      self.noise[s] = _noise(self.state)

  def result(self, windows) -> Result:
    jax.block_until_ready(self.params)
    per_window = np.array([sum(float(mb["mask"].sum()) for mb in w) for w in windows])
    rate = float(np.median(per_window / self.seconds))
    r = Result(self.name, self.losses, self.reported, self.params, self.peak,
               float(self.seconds.sum()), int(per_window.sum()), rate)  # fmt: skip
    if self.name == NOISY:
      r.b_simple, r.window_b_simple = self.noise[:, 0], self.noise[:, 1]
    return r


def train(names: Sequence[str], loss, params0, windows, lr: float, progress: bool = True):
  """Trains from `params0` by each method of `names` on `windows` (steps x k micro-batches).

  The runs advance together, window by window, in an order that rotates each window, so that
  a burst of load on a shared machine hits every method alike (their tokens/s compare).

  Returns:
    One `Result` per name, in the order of `names`.
  """
  from optax_accum.demo import Phases  # noqa: PLC0415
  from optax_accum.demo.lm import require  # noqa: PLC0415

  tqdm = require("tqdm").tqdm
  phases, runs = Phases(len(names), "compiling", progress=progress), []
  for name in names:  # each run compiles its programs and warms them up
    phases(name)
    runs.append(_Run(name, loss, params0, windows, lr))
  phases.close()
  # One bar per method (the runs advance together, so their bars do): each shows its own loss.
  bars = [
    tqdm(total=len(windows), desc=f"{run.name:>22}", disable=not progress, leave=True)
    for run in runs
  ]
  for s, window in enumerate(windows):
    for run in runs[s % len(runs) :] + runs[: s % len(runs)]:
      run.step(s, window)
    for run, bar in zip(runs, bars, strict=True):
      extra = {} if run.name != NOISY else {"B_simple": f"{run.noise[s, 0]:,.0f} tokens"}
      bar.set_postfix({"train loss": f"{run.losses[s]:.3f}", **extra}, refresh=False)
      bar.update(1)
  for bar in bars:
    bar.close()
  return [run.result(windows) for run in runs]


def max_diff(a, b) -> float:
  """The largest absolute difference between two parameter trees."""
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return float(max(jnp.max(jnp.abs(x - y)) for x, y in pairs))
