"""Flax Linen and NNX with `accumulate` and `microbatch`, each against a direct computation.

The large-batch references are `_reference.run_steps` (a plain optax step on a direct
`jax.grad`, no Flax optimizer wrapper) on the model's parameters.

BatchNorm under accumulation: in training mode every forward pass normalises with the statistics
of the batch it sees, which is one *micro*-batch. So (a) the running averages after a window
are k sequential updates with micro-batch statistics, not one update with the large batch's,
and (b) the accumulated gradient is the mean of the micro-batch gradients, each taken with its
own micro-batch's statistics — not the large batch's gradient. The tests below pin both down
against numpy / per-micro-batch references, and show the difference to the large batch.
"""

from __future__ import annotations

import functools

import _reference as ref
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import optax_accum

MICRO = 4  # examples per micro-batch
FEATURES = 5
ADAM = optax.adam(0.1)  # large enough steps that "it trained" is clear after one or two


def _windows(k, steps=1, seed=0):
  """`steps` large batches of k·MICRO examples ``{"x": (n, FEATURES), "y": (n, 1)}``; the inputs
  have mean 1 and scale 2, so BatchNorm's statistics move far from their initial (0, 1)."""
  data = ref.regression_data(seed, steps * k * MICRO, FEATURES, 1)
  return ref.split({**data, "x": data["x"] * 2.0 + 1.0}, steps)


def _micro(batch, k):
  # Strided split: rows i, i+k, ... in micro-batch i (what `microbatch` does by default).
  return ref.split(batch, k, strided=True)


# ---------------------------------------------------------------------------------------------
# Linen: TrainState(tx=accumulate(...)).


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(8)(x))
    return nn.Dense(1)(x)


def _mse(apply_fn, params, batch):
  return jnp.mean((apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("k, jit", [(4, True), (2, False)])
def test_linen_train_state_accumulate_matches_large_batch(k, jit):
  model = MLP()
  big = _windows(k, steps=2 if jit else 1)
  params = model.init(jax.random.key(1), big[0]["x"])["params"]
  loss = functools.partial(_mse, model.apply)
  want, _ = ref.run_steps(ADAM, params, loss, big, jit=jit)

  def step(state, batch):
    return state.apply_gradients(grads=jax.grad(loss)(state.params, batch))

  step = jax.jit(step) if jit else step
  acc = train_state.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax_accum.accumulate(ADAM, k)
  )
  for mb in [m for b in big for m in _micro(b, k)]:
    acc = step(acc, mb)
  assert ref.max_abs_diff(want, params) > 1e-2  # it trained
  chex.assert_trees_all_close(acc.params, want, **ref.TOL)
  # TrainState.step counts apply_gradients calls (micro-steps); the optimizer counts updates.
  assert int(acc.step) == k * len(big)
  assert int(acc.opt_state.gradient_step) == len(big)


# ---------------------------------------------------------------------------------------------
# Linen BatchNorm.

MOMENTUM = 0.8  # BatchNorm's


class BNNet(nn.Module):
  """BatchNorm straight on the inputs, so its statistics can be computed with numpy."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.BatchNorm(use_running_average=not train, momentum=MOMENTUM)(x)
    x = nn.tanh(nn.Dense(8)(x))
    return nn.Dense(1)(x)


class BNState(train_state.TrainState):
  batch_stats: dict


def _bn_loss(params, batch_stats, batch):
  """The loss of one batch in training mode, and the BatchNorm statistics it leaves behind."""
  out, updated = BNNet().apply(
    {"params": params, "batch_stats": batch_stats}, batch["x"], train=True, mutable=["batch_stats"]
  )
  return jnp.mean((out - batch["y"]) ** 2), updated["batch_stats"]


def _bn_state(batch, tx):
  variables = BNNet().init(jax.random.key(1), batch["x"], train=False)
  return BNState.create(
    apply_fn=BNNet().apply,
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    tx=tx,
  )


# The references: one jitted training-mode pass (compiled once per batch shape, not op by op).
_bn_grad = jax.jit(jax.value_and_grad(_bn_loss, has_aux=True))


@jax.jit
def _bn_step(state, batch):
  """The model's own training step: batch_stats updated on every call (every micro-batch)."""
  (_, batch_stats), grads = _bn_grad(state.params, state.batch_stats, batch)
  return state.apply_gradients(grads=grads).replace(batch_stats=batch_stats)


def _numpy_running_stats(batches, mean, var):
  """Flax BatchNorm's running averages after training-mode passes over `batches`, by numpy."""
  for b in batches:
    x = np.asarray(b["x"], np.float64)
    mean = MOMENTUM * mean + (1 - MOMENTUM) * x.mean(0)
    var = MOMENTUM * var + (1 - MOMENTUM) * x.var(0)  # biased variance, as Flax computes it
  return mean, var


INIT_STATS = np.zeros(FEATURES), np.ones(FEATURES)  # BatchNorm's initial running mean and var


@pytest.mark.parametrize("k", [2, 4])
def test_linen_batchnorm_accumulate_running_stats_are_micro_batch_statistics(k):
  (big,) = _windows(k)
  state = _bn_state(big, optax_accum.accumulate(optax.sgd(0.1), k))
  for mb in _micro(big, k):
    state = _bn_step(state, mb)
  stats = state.batch_stats["BatchNorm_0"]

  want_mean, want_var = _numpy_running_stats(_micro(big, k), *INIT_STATS)
  chex.assert_trees_all_close((stats["mean"], stats["var"]), (want_mean, want_var), **ref.TOL)

  # One update with the large batch's statistics gives other running averages.
  large_mean, large_var = _numpy_running_stats([big], *INIT_STATS)
  assert np.max(np.abs(stats["mean"] - large_mean)) > 1e-2
  assert np.max(np.abs(stats["var"] - large_var)) > 1e-2


@pytest.mark.parametrize("k", [4])
def test_linen_batchnorm_accumulated_gradient_is_mean_of_micro_batch_gradients(k):
  (big,) = _windows(k)
  state = _bn_state(big, optax_accum.accumulate(optax.sgd(1.0), k))
  params0, stats0 = state.params, state.batch_stats
  for mb in _micro(big, k):
    state = _bn_step(state, mb)
  emitted = jax.tree.map(lambda new, old: new - old, state.params, params0)  # -1.0 * gradient

  # Reference: each micro-batch's gradient with its own statistics, at the window's parameters
  # (they do not move inside a window); the running stats do not enter a training-mode pass.
  grads = [_bn_grad(params0, stats0, mb)[1] for mb in _micro(big, k)]
  want = jax.tree.map(lambda *g: -sum(g) / k, *grads)
  chex.assert_trees_all_close(emitted, want, **ref.TOL)

  large = _bn_grad(params0, stats0, big)[1]
  assert ref.max_abs_diff(emitted, jax.tree.map(jnp.negative, large)) > 1e-3  # not the large's


@pytest.mark.parametrize("k", [2, 4])
def test_linen_batchnorm_microbatch_threads_batch_stats(k):
  """`microbatch(..., state_argnums=1, state_out=...)` == k sequential small training passes."""
  (big,) = _windows(k)
  state = _bn_state(big, optax.sgd(1.0))
  params0, stats0 = state.params, state.batch_stats
  grad_fn = jax.value_and_grad(_bn_loss, has_aux=True)
  step = jax.jit(
    optax_accum.microbatch(
      grad_fn, k, batch_argnums=2, state_argnums=1, state_out=lambda out: out[0][1]
    )
  )
  (loss, stats), grads = step(params0, stats0, big)

  # Reference: k sequential calls of the model's own training pass, stats handed on.
  want_stats, want_losses, want_grads = stats0, [], []
  for mb in _micro(big, k):
    (loss_i, want_stats), g = _bn_grad(params0, want_stats, mb)
    want_losses.append(loss_i)
    want_grads.append(g)
  chex.assert_trees_all_close(stats, want_stats, **ref.TOL)
  chex.assert_trees_all_close(loss, np.mean(want_losses), **ref.TOL)
  chex.assert_trees_all_close(grads, jax.tree.map(lambda *g: sum(g) / k, *want_grads), **ref.TOL)
  want_mean, _ = _numpy_running_stats(_micro(big, k), *INIT_STATS)
  chex.assert_trees_all_close(stats["BatchNorm_0"]["mean"], want_mean, **ref.TOL)

  # accumulate across steps with the model's own step lands on the same parameters and stats.
  acc = _bn_state(big, optax_accum.accumulate(optax.sgd(1.0), k))
  for mb in _micro(big, k):
    acc = _bn_step(acc, mb)
  chex.assert_trees_all_close(acc.batch_stats, stats, **ref.TOL)
  chex.assert_trees_all_close(
    acc.params, jax.tree.map(lambda p, g: p - g, params0, grads), **ref.TOL
  )


# ---------------------------------------------------------------------------------------------
# NNX.


class NNXNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0, batchnorm: bool = False):
    self.fc1 = nnx.Linear(FEATURES, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, momentum=MOMENTUM, rngs=rngs) if batchnorm else None
    self.drop = nnx.Dropout(dropout)
    self.fc2 = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x, key=None):
    h = self.fc1(x)
    if self.bn is not None:
      h = self.bn(h)
    h = self.drop(nnx.relu(h), rngs=key, deterministic=key is None)
    return self.fc2(h)


def _nnx_loss(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _nnx_reference():
  """The large-batch reference of an NNXNet (no dropout, no BatchNorm): its parameters as a
  pytree and a loss of them (the model rebuilt from its graph), stepped with `ref.run_steps`."""
  graphdef, params = nnx.split(NNXNet(nnx.Rngs(0)), nnx.Param)
  return params, functools.partial(_nnx_merged_loss, graphdef)


def _nnx_merged_loss(graphdef, params, batch):
  return _nnx_loss(nnx.merge(graphdef, params), batch)


@pytest.mark.parametrize("k", [4])
def test_nnx_optimizer_accumulate_matches_large_batch(k):
  big = _windows(k, steps=2)
  params0, loss = _nnx_reference()
  want, _ = ref.run_steps(ADAM, params0, loss, big)
  model = NNXNet(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax_accum.accumulate(ADAM, k), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    optimizer.update(model, nnx.grad(_nnx_loss)(model, batch))

  for mb in [m for b in big for m in _micro(b, k)]:
    step(model, opt, mb)
  assert ref.max_abs_diff(want, params0) > 1e-2  # it trained
  chex.assert_trees_all_close(nnx.state(model, nnx.Param), want, **ref.TOL)
  assert int(opt.opt_state.gradient_step) == len(big)


def _nnx_split_loss(graphdef, params, batch_stats, rest, batch, key):
  """The loss of one batch with the model rebuilt from its state, and the new BatchNorm stats."""
  # copy=True: fresh Variables at this trace level (inside grad and the scan) that BatchNorm
  # may write to; the arguments' own Variables belong to the caller's trace.
  model = nnx.merge(graphdef, params, batch_stats, rest, copy=True)
  loss = jnp.mean((model(batch["x"], key) - batch["y"]) ** 2)
  return loss, nnx.state(model, nnx.BatchStat)


@functools.cache  # one compiled step per k, shared by the tests
def _nnx_microbatch_step(k):
  @nnx.jit
  def train_step(model, optimizer, batch, key):
    graphdef, params, batch_stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
    loss_fn = functools.partial(_nnx_split_loss, graphdef)

    def fun(params, batch_stats, batch, key):
      return jax.value_and_grad(loss_fn, has_aux=True)(params, batch_stats, rest, batch, key)

    grad_fn = optax_accum.microbatch(
      fun, k, batch_argnums=2, rng_argnums=3, state_argnums=1, state_out=lambda out: out[0][1]
    )
    (loss, batch_stats), grads = grad_fn(params, batch_stats, batch, key)
    nnx.update(model, batch_stats)
    optimizer.update(model, grads)
    return loss

  return train_step


@pytest.mark.parametrize("k", [2])
def test_nnx_microbatch_dropout_batchnorm_matches_sequential_reference(k):
  (big,) = _windows(k)
  key = jax.random.key(42)
  model = NNXNet(nnx.Rngs(0), dropout=0.5, batchnorm=True)
  graphdef, params0, stats0, rest = jax.tree.map(
    jnp.array, nnx.split(model, nnx.Param, nnx.BatchStat, ...)
  )  # copies: the train step updates the model in place
  optimizer = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)
  loss = _nnx_microbatch_step(k)(model, optimizer, big, key)

  # Reference, computed directly: micro-batch i with its own key fold_in(key, i) (microbatch's
  # documented derivation) and the BatchNorm stats micro-batch i-1 left behind.
  grad_fn = jax.jit(jax.value_and_grad(functools.partial(_nnx_split_loss, graphdef), has_aux=True))
  stats, losses, grads = stats0, [], []
  for i, mb in enumerate(_micro(big, k)):
    (loss_i, stats), g = grad_fn(params0, stats, rest, mb, jax.random.fold_in(key, i))
    losses.append(loss_i)
    grads.append(g)
  mean_grad = jax.tree.map(lambda *g: sum(g) / k, *grads)
  chex.assert_trees_all_close(loss, np.mean(losses), **ref.TOL)
  chex.assert_trees_all_close(nnx.state(model, nnx.BatchStat), stats, **ref.TOL)
  chex.assert_trees_all_close(
    nnx.state(model, nnx.Param), jax.tree.map(lambda p, g: p - g, params0, mean_grad), **ref.TOL
  )

  # Each micro-batch had its own dropout key: one shared key gives another gradient.
  same_key = [grad_fn(params0, stats0, rest, mb, key)[1] for mb in _micro(big, k)]
  same_key = jax.tree.map(lambda *g: sum(g) / k, *same_key)
  assert ref.max_abs_diff(same_key, mean_grad) > 1e-4


@pytest.mark.parametrize("k", [4])
def test_nnx_microbatch_train_step_matches_large_batch(k):
  """Without dropout or BatchNorm (nothing couples examples) the in-step form is the large batch."""
  big = _windows(k, steps=2)
  want, loss_fn = _nnx_reference()
  want_state = ADAM.init(want)
  model = NNXNet(nnx.Rngs(0))
  opt = nnx.Optimizer(model, ADAM, wrt=nnx.Param)
  step = _nnx_microbatch_step(k)
  for s, batch in enumerate(big):
    loss = step(model, opt, batch, jax.random.key(s))
    chex.assert_trees_all_close(loss, loss_fn(want, batch), **ref.TOL)  # at the step's params
    want, want_state = ref.run_steps(ADAM, want, loss_fn, [batch], state=want_state)
  chex.assert_trees_all_close(nnx.state(model, nnx.Param), want, **ref.TOL)


def test_nnx_microbatch_dropout_is_deterministic_for_a_key():
  (big,) = _windows(2)
  results = []
  for key in (jax.random.key(1), jax.random.key(1), jax.random.key(2)):
    model = NNXNet(nnx.Rngs(0), dropout=0.5, batchnorm=True)
    optimizer = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)
    _nnx_microbatch_step(2)(model, optimizer, big, key)
    results.append(nnx.state(model, nnx.Param))
  chex.assert_trees_all_equal(results[0], results[1])
  assert ref.max_abs_diff(results[0], results[2]) > 1e-4


def test_has_updated_on_nnx_optimizer_state_is_a_jax_bool():
  """nnx.Optimizer wraps each array of its state in a Variable: `has_updated` unwraps it, so
  `bool()` works on what it returns, as on any optax state."""
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax_accum.accumulate(optax.sgd(0.1), 2), wrt=nnx.Param)
  x = jnp.ones((4, 2))
  flags = []
  for _ in range(2):
    opt.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))
    flag = optax_accum.has_updated(opt.opt_state)
    assert isinstance(flag, jax.Array) and flag.dtype == jnp.bool_
    flags.append(bool(flag))
  assert flags == [False, True]
