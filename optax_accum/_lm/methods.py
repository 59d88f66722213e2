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
from optax_accum import _hlo
from optax_accum._lm import model

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
  peak_bytes: int  # XLA's compiled peak of the step program(s)
  seconds: float  # the training loop, compilation excluded
  tokens: int  # real tokens trained on
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


def train(name: str, loss, params0, windows, lr: float, progress: bool = True) -> Result:
  """Trains from `params0` by method `name` on `windows` (steps x k micro-batches)."""
  from optax_accum._lm import require  # noqa: PLC0415

  tqdm = require("tqdm").tqdm
  params = _commit(params0)  # a copy: the steps donate their inputs
  window_step, params, state, peak = BUILDERS[name](loss, params, windows, lr)
  losses, reported = np.zeros(len(windows)), np.zeros(len(windows))
  noise = np.full((len(windows), 2), np.nan)
  bar = tqdm(windows, desc=f"{name:>11}", disable=not progress, leave=True)
  start = time.perf_counter()
  for s, window in enumerate(bar):
    params, state, value, said = window_step(params, state, window)
    losses[s], reported[s] = float(value), float(said)
    if name == NOISY:
      noise[s] = _noise(state)
    if s % 10 == 0 or s == len(windows) - 1:
      extra = {"B_simple": f"{noise[s, 0]:,.0f} tokens"} if name == NOISY else {}
      bar.set_postfix(loss=f"{losses[s]:.3f}", **extra)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - start
  bar.close()
  tokens = int(sum(mb["mask"].sum() for window in windows for mb in window))
  r = Result(name, losses, reported, params, peak, seconds, tokens)
  if name == NOISY:
    r.b_simple, r.window_b_simple = noise[:, 0], noise[:, 1]
  return r


def max_diff(a, b) -> float:
  """The largest absolute difference between two parameter trees."""
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return float(max(jnp.max(jnp.abs(x - y)) for x, y in pairs))
