"""Flax Linen and NNX with `accumulate` and `microbatch`, each against a direct computation.

BatchNorm under accumulation: in training mode every forward pass normalises with the statistics
of the batch it sees, which is one *micro*-batch. So (a) the running averages after a window
are k sequential updates with micro-batch statistics, not one update with the large batch's,
and (b) the accumulated gradient is the mean of the micro-batch gradients, each taken with its
own micro-batch's statistics — not the large batch's gradient. The tests below pin both down
against numpy / per-micro-batch references, and show the difference to the large batch.
"""

from __future__ import annotations

import functools

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


def _data(k, steps=1, seed=0):
  kx, ky = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (steps, k * MICRO, FEATURES)) * 2.0 + 1.0
  y = jax.random.normal(ky, (steps, k * MICRO))
  return x, y


def _micro(a, i, k):
  return a[i::k]  # strided split: rows i, i+k, ... (what `microbatch` does by default)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  # Float32: micro-batch means are summed in another order than the large batch's mean.
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=rtol, atol=atol), a, b)


def max_diff(a, b):
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in pairs)


# ---------------------------------------------------------------------------------------------
# Linen: TrainState(tx=accumulate(...)).


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(8)(x))
    return nn.Dense(1)(x)[..., 0]


def _mse(apply_fn, params, x, y):
  return jnp.mean((apply_fn({"params": params}, x) - y) ** 2)


@pytest.mark.parametrize("k, jit", [(4, True), (2, False)])
def test_linen_train_state_accumulate_matches_large_batch(k, jit):
  model = MLP()
  x, y = _data(k, steps=2 if jit else 1)
  params = model.init(jax.random.key(1), x[0])["params"]
  loss = functools.partial(_mse, model.apply)

  def step(state, x, y):
    grads = jax.grad(loss)(state.params, x, y)
    return state.apply_gradients(grads=grads)

  step = jax.jit(step) if jit else step
  ref = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(0.1))
  acc = train_state.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax_accum.accumulate(optax.adam(0.1), k)
  )
  for s in range(x.shape[0]):
    ref = step(ref, x[s], y[s])
    for i in range(k):
      acc = step(acc, _micro(x[s], i, k), _micro(y[s], i, k))
  assert max_diff(ref.params, params) > 1e-2  # it trained
  assert_trees_close(acc.params, ref.params)
  # TrainState.step counts apply_gradients calls (micro-steps); the optimizer counts updates.
  assert int(acc.step) == k * x.shape[0]
  assert int(acc.opt_state.gradient_step) == x.shape[0]


# ---------------------------------------------------------------------------------------------
# Linen BatchNorm.

MOMENTUM = 0.8


class BNNet(nn.Module):
  """BatchNorm straight on the inputs, so its statistics can be computed with numpy."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.BatchNorm(use_running_average=not train, momentum=MOMENTUM)(x)
    x = nn.tanh(nn.Dense(8)(x))
    return nn.Dense(1)(x)[..., 0]


class BNState(train_state.TrainState):
  batch_stats: dict


def _bn_loss(params, batch_stats, x, y):
  """The loss of one batch in training mode, and the BatchNorm statistics it leaves behind."""
  out, updated = BNNet().apply(
    {"params": params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
  )
  return jnp.mean((out - y) ** 2), updated["batch_stats"]


def _bn_state(x, tx):
  variables = BNNet().init(jax.random.key(1), x, train=False)
  return BNState.create(
    apply_fn=BNNet().apply,
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    tx=tx,
  )


# The references: one jitted training-mode pass (compiled once per batch shape, not op by op).
_bn_grad = jax.jit(jax.value_and_grad(_bn_loss, has_aux=True))


@jax.jit
def _bn_step(state, x, y):
  """The model's own training step: batch_stats updated on every call (every micro-batch)."""
  (_, batch_stats), grads = jax.value_and_grad(_bn_loss, has_aux=True)(
    state.params, state.batch_stats, x, y
  )
  return state.apply_gradients(grads=grads).replace(batch_stats=batch_stats)


def _numpy_running_stats(batches, mean, var):
  """Flax BatchNorm's running averages after training-mode passes over `batches`, by numpy."""
  for b in batches:
    b = np.asarray(b, np.float64)
    mean = MOMENTUM * mean + (1 - MOMENTUM) * b.mean(0)
    var = MOMENTUM * var + (1 - MOMENTUM) * b.var(0)  # biased variance, as Flax computes it
  return mean, var


@pytest.mark.parametrize("k", [2, 4])
def test_linen_batchnorm_accumulate_running_stats_are_micro_batch_statistics(k):
  x, y = _data(k, steps=1)
  state = _bn_state(x[0], optax_accum.accumulate(optax.sgd(0.1), k))
  for i in range(k):
    state = _bn_step(state, _micro(x[0], i, k), _micro(y[0], i, k))
  stats = state.batch_stats["BatchNorm_0"]

  init_mean, init_var = np.zeros(FEATURES), np.ones(FEATURES)
  micro_batches = [_micro(x[0], i, k) for i in range(k)]
  want_mean, want_var = _numpy_running_stats(micro_batches, init_mean, init_var)
  np.testing.assert_allclose(stats["mean"], want_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stats["var"], want_var, rtol=1e-5, atol=1e-6)

  # One update with the large batch's statistics gives other running averages.
  large_mean, large_var = _numpy_running_stats([x[0]], init_mean, init_var)
  assert np.max(np.abs(stats["mean"] - large_mean)) > 1e-2
  assert np.max(np.abs(stats["var"] - large_var)) > 1e-2


@pytest.mark.parametrize("k", [4])
def test_linen_batchnorm_accumulated_gradient_is_mean_of_micro_batch_gradients(k):
  x, y = _data(k, steps=1)
  state = _bn_state(x[0], optax_accum.accumulate(optax.sgd(1.0), k))
  params0, stats0 = state.params, state.batch_stats
  for i in range(k):
    state = _bn_step(state, _micro(x[0], i, k), _micro(y[0], i, k))
  emitted = jax.tree.map(lambda new, old: new - old, state.params, params0)  # -1.0 * gradient

  # Reference: each micro-batch's gradient with its own statistics, at the window's parameters
  # (they do not move inside a window); the running stats do not enter a training-mode pass.
  grads = [_bn_grad(params0, stats0, _micro(x[0], i, k), _micro(y[0], i, k))[1] for i in range(k)]
  want = jax.tree.map(lambda *g: -sum(g) / k, *grads)
  assert_trees_close(emitted, want)

  large = _bn_grad(params0, stats0, x[0], y[0])[1]
  assert max_diff(emitted, jax.tree.map(jnp.negative, large)) > 1e-3  # not the large batch's


@pytest.mark.parametrize("k", [2, 4])
def test_linen_batchnorm_microbatch_threads_batch_stats(k):
  """`microbatch(..., state_argnums=1, state_out=...)` == k sequential small training passes."""
  x, y = _data(k, steps=1)
  state = _bn_state(x[0], optax.sgd(1.0))
  params0, stats0 = state.params, state.batch_stats
  grad_fn = jax.value_and_grad(_bn_loss, has_aux=True)
  step = jax.jit(
    optax_accum.microbatch(
      grad_fn, k, batch_argnums=(2, 3), state_argnums=1, state_out=lambda out: out[0][1]
    )
  )
  (loss, stats), grads = step(params0, stats0, x[0], y[0])

  # Reference: k sequential calls of the model's own training pass, stats handed on.
  ref_stats, ref_losses, ref_grads = stats0, [], []
  for i in range(k):
    (loss_i, ref_stats), g = _bn_grad(params0, ref_stats, _micro(x[0], i, k), _micro(y[0], i, k))
    ref_losses.append(loss_i)
    ref_grads.append(g)
  assert_trees_close(stats, ref_stats)
  np.testing.assert_allclose(loss, np.mean(ref_losses), rtol=1e-5)
  assert_trees_close(grads, jax.tree.map(lambda *g: sum(g) / k, *ref_grads))
  want_mean, _ = _numpy_running_stats(
    [_micro(x[0], i, k) for i in range(k)], np.zeros(FEATURES), np.ones(FEATURES)
  )
  np.testing.assert_allclose(stats["BatchNorm_0"]["mean"], want_mean, rtol=1e-5, atol=1e-6)

  # accumulate across steps with the model's own step lands on the same parameters and stats.
  acc = _bn_state(x[0], optax_accum.accumulate(optax.sgd(1.0), k))
  for i in range(k):
    acc = _bn_step(acc, _micro(x[0], i, k), _micro(y[0], i, k))
  assert_trees_close(acc.batch_stats, stats)
  assert_trees_close(acc.params, jax.tree.map(lambda p, g: p - g, params0, grads))


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
    return self.fc2(h)[..., 0]


def _nnx_loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("k", [4])
def test_nnx_optimizer_accumulate_matches_large_batch(k):
  x, y = _data(k, steps=2)
  ref_model, model = NNXNet(nnx.Rngs(0)), NNXNet(nnx.Rngs(0))
  ref_opt = nnx.Optimizer(ref_model, optax.adam(0.1), wrt=nnx.Param)
  opt = nnx.Optimizer(model, optax_accum.accumulate(optax.adam(0.1), k), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    grads = nnx.grad(_nnx_loss)(model, x, y)
    optimizer.update(model, grads)

  params0 = jax.tree.map(jnp.array, nnx.state(model, nnx.Param))  # a copy: the model updates
  for s in range(x.shape[0]):
    step(ref_model, ref_opt, x[s], y[s])
    for i in range(k):
      step(model, opt, _micro(x[s], i, k), _micro(y[s], i, k))
  got, want = nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param)
  assert max_diff(want, params0) > 1e-2  # it trained
  assert_trees_close(got, want)
  assert int(opt.opt_state.gradient_step) == x.shape[0]


def _nnx_split_loss(graphdef, params, batch_stats, rest, x, y, key):
  """The loss of one batch with the model rebuilt from its state, and the new BatchNorm stats."""
  # copy=True: fresh Variables at this trace level (inside grad and the scan) that BatchNorm
  # may write to; the arguments' own Variables belong to the caller's trace.
  model = nnx.merge(graphdef, params, batch_stats, rest, copy=True)
  loss = jnp.mean((model(x, key) - y) ** 2)
  return loss, nnx.state(model, nnx.BatchStat)


@functools.cache  # one compiled step per k, shared by the tests
def _nnx_microbatch_step(k):
  @nnx.jit
  def train_step(model, optimizer, x, y, key):
    graphdef, params, batch_stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
    loss_fn = functools.partial(_nnx_split_loss, graphdef)

    def fun(params, batch_stats, x, y, key):
      return jax.value_and_grad(loss_fn, has_aux=True)(params, batch_stats, rest, x, y, key)

    grad_fn = optax_accum.microbatch(
      fun,
      k,
      batch_argnums=(2, 3),
      rng_argnums=4,
      state_argnums=1,
      state_out=lambda out: out[0][1],
    )
    (loss, batch_stats), grads = grad_fn(params, batch_stats, x, y, key)
    nnx.update(model, batch_stats)
    optimizer.update(model, grads)
    return loss

  return train_step


@pytest.mark.parametrize("k", [2])
def test_nnx_microbatch_dropout_batchnorm_matches_sequential_reference(k):
  x, y = _data(k, steps=1)
  key = jax.random.key(42)
  model = NNXNet(nnx.Rngs(0), dropout=0.5, batchnorm=True)
  graphdef, params0, stats0, rest = jax.tree.map(
    jnp.array, nnx.split(model, nnx.Param, nnx.BatchStat, ...)
  )  # copies: the train step updates the model in place
  optimizer = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)
  loss = _nnx_microbatch_step(k)(model, optimizer, x[0], y[0], key)

  # Reference, computed directly: micro-batch i with its own key fold_in(key, i) (microbatch's
  # documented derivation) and the BatchNorm stats micro-batch i-1 left behind.
  grad_fn = jax.jit(jax.value_and_grad(functools.partial(_nnx_split_loss, graphdef), has_aux=True))
  stats, losses, grads = stats0, [], []
  for i in range(k):
    (loss_i, stats), g = grad_fn(
      params0, stats, rest, _micro(x[0], i, k), _micro(y[0], i, k), jax.random.fold_in(key, i)
    )
    losses.append(loss_i)
    grads.append(g)
  mean_grad = jax.tree.map(lambda *g: sum(g) / k, *grads)
  np.testing.assert_allclose(loss, np.mean(losses), rtol=1e-5)
  assert_trees_close(nnx.state(model, nnx.BatchStat), stats)
  assert_trees_close(
    nnx.state(model, nnx.Param), jax.tree.map(lambda p, g: p - g, params0, mean_grad)
  )

  # Each micro-batch had its own dropout key: one shared key gives another gradient.
  same_key = [
    grad_fn(params0, stats0, rest, _micro(x[0], i, k), _micro(y[0], i, k), key)[1] for i in range(k)
  ]
  same_key = jax.tree.map(lambda *g: sum(g) / k, *same_key)
  assert max_diff(same_key, mean_grad) > 1e-4


@pytest.mark.parametrize("k", [4])
def test_nnx_microbatch_train_step_matches_large_batch(k):
  """Without dropout or BatchNorm (nothing couples examples) the in-step form is the large batch."""
  x, y = _data(k, steps=2)
  ref_model, model = NNXNet(nnx.Rngs(0)), NNXNet(nnx.Rngs(0))
  ref_opt = nnx.Optimizer(ref_model, optax.adam(0.1), wrt=nnx.Param)
  opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)

  @nnx.jit
  def ref_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_nnx_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss

  step = _nnx_microbatch_step(k)
  for s in range(x.shape[0]):
    want = ref_step(ref_model, ref_opt, x[s], y[s])
    np.testing.assert_allclose(step(model, opt, x[s], y[s], jax.random.key(s)), want, rtol=1e-5)
  assert_trees_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))


def test_nnx_microbatch_dropout_is_deterministic_for_a_key():
  x, y = _data(2, steps=1)
  results = []
  for key in (jax.random.key(1), jax.random.key(1), jax.random.key(2)):
    model = NNXNet(nnx.Rngs(0), dropout=0.5, batchnorm=True)
    optimizer = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)
    _nnx_microbatch_step(2)(model, optimizer, x[0], y[0], key)
    results.append(nnx.state(model, nnx.Param))
  assert max_diff(results[0], results[1]) == 0.0
  assert max_diff(results[0], results[2]) > 1e-4
