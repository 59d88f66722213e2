"""TrainStep: the static two-program path equals the large batch and the dynamic path."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

N_FEATURES = 6


def _loss(params, x, y):
  pred = jnp.tanh(x @ params["w1"]) @ params["w2"]
  return jnp.mean((pred[:, 0] - y) ** 2)


def _data(n, seed=0):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (n, N_FEATURES)), jax.random.normal(ky, (n,))


def _params():
  k1, k2 = jax.random.split(jax.random.key(42))
  return {
    "w1": jax.random.normal(k1, (N_FEATURES, 8)) * 0.3,
    "w2": jax.random.normal(k2, (8, 1)) * 0.3,
  }


def _large_batch(inner, x, y, n_updates):
  """n optimizer steps on batches of k·b rows: the reference."""
  params, state = _params(), inner.init(_params())
  for xb, yb in zip(jnp.split(x, n_updates), jnp.split(y, n_updates), strict=True):
    updates, state = inner.update(jax.grad(_loss)(params, xb, yb), state, params)
    params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("donate", [True, False])
def test_train_step_matches_large_batch(k, donate):
  b, n_updates = 4, 3
  x, y = _data(k * b * n_updates)
  step = optax_accum.TrainStep(_loss, optax.adam(0.05), every_k=k, donate=donate)
  params = _params()
  state = step.init(params)
  for xb, yb in zip(jnp.split(x, k * n_updates), jnp.split(y, k * n_updates), strict=True):
    params, state, _ = step(params, state, xb, yb)
  expected = _large_batch(optax.adam(0.05), x, y, n_updates)
  assert int(state.gradient_step) == n_updates
  close = lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)
  jax.tree.map(close, params, expected)


def test_train_step_equals_dynamic_accumulate():
  """Same numbers as the dynamic path; the counters exactly, the floats to rounding.

  Not bitwise: TrainStep applies the update inside the emitting branch, where XLA fuses the Adam
  update into the apply and may contract multiply-adds differently (1 ulp).
  """
  k, b = 3, 4
  x, y = _data(k * b * 2, seed=1)
  step = optax_accum.TrainStep(_loss, optax.adam(0.05), every_k=k, donate=False)
  tx = optax_accum.accumulate(optax.adam(0.05), k)

  @jax.jit
  def dynamic(params, state, xb, yb):
    updates, state = tx.update(jax.grad(_loss)(params, xb, yb), state, params)
    return optax.apply_updates(params, updates), state

  p1, p2 = _params(), _params()
  s1, s2 = step.init(p1), tx.init(p2)
  for xb, yb in zip(jnp.split(x, 2 * k), jnp.split(y, 2 * k), strict=True):
    p1, s1, _ = step(p1, s1, xb, yb)
    p2, s2 = dynamic(p2, s2, xb, yb)
  assert int(s1.gradient_step) == int(s2.gradient_step) == 2
  assert int(s1.mini_step) == int(s2.mini_step) == 0
  for a, e in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2)), strict=True):
    np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)


def test_train_step_resyncs_with_a_restored_state():
  """A state restored mid-window (not the object the step returned) is read once, then used."""
  k, b = 4, 2
  x, y = _data(k * b * 2, seed=2)
  xs, ys = jnp.split(x, 2 * k), jnp.split(y, 2 * k)
  step = optax_accum.TrainStep(_loss, optax.sgd(0.1), every_k=k, donate=False)
  params = _params()
  state = step.init(params)
  for i in range(3):
    params, state, _ = step(params, state, xs[i], ys[i])
  saved = jax.device_get((params, state))

  fresh = optax_accum.TrainStep(_loss, optax.sgd(0.1), every_k=k, donate=False)
  p2, s2 = jax.device_put(saved)
  for i in range(3, 2 * k):
    params, state, _ = step(params, state, xs[i], ys[i])
    p2, s2, _ = fresh(p2, s2, xs[i], ys[i])
  for a, e in zip(jax.tree.leaves((params, state)), jax.tree.leaves((p2, s2)), strict=True):
    np.testing.assert_array_equal(a, e)
  assert int(s2.gradient_step) == 2


def test_train_step_force_emit_closes_a_short_window():
  k, b = 4, 3
  x, y = _data(2 * b, seed=3)
  step = optax_accum.TrainStep(_loss, optax.sgd(0.1), every_k=k, donate=False)
  params = _params()
  state = step.init(params)
  params, state, _ = step(params, state, x[:b], y[:b])
  params, state, _ = step(params, state, x[b:], y[b:], force_emit=True)
  expected = _large_batch(optax.sgd(0.1), x, y, 1)
  assert int(state.gradient_step) == 1 and int(state.mini_step) == 0
  jax.tree.map(
    lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7), params, expected
  )


def test_train_step_has_aux_returns_aux():
  def loss_aux(params, x, y):
    value = _loss(params, x, y)
    return value, {"twice": 2 * value}

  step = optax_accum.TrainStep(loss_aux, optax.sgd(0.1), every_k=2, has_aux=True, donate=False)
  params = _params()
  state = step.init(params)
  x, y = _data(4)
  params, state, (value, aux) = step(params, state, x, y)
  np.testing.assert_allclose(aux["twice"], 2 * value, rtol=1e-6)


def test_train_step_static_programs_have_no_conditional_in_the_accumulating_one():
  step = optax_accum.TrainStep(_loss, optax.adam(0.1), every_k=4, skip_nonfinite=False)
  params = _params()
  state = step.init(params)
  x, y = _data(4)
  text = step.lower(params, state, x, y, emit=False).compile().as_text()
  assert "conditional(" not in text
  # The accumulating program does not run Adam: no sqrt of the second moment.
  assert "sqrt" not in text and "rsqrt" not in text
  emit_text = step.lower(params, state, x, y, emit=True).compile().as_text()
  assert "sqrt" in emit_text


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4", lambda step: 4])
def test_train_step_rejects_non_static_every_k(bad):
  with pytest.raises((TypeError, ValueError), match="every_k"):
    optax_accum.TrainStep(_loss, optax.sgd(0.1), every_k=bad)


def test_train_step_rejects_traced_force_emit():
  step = optax_accum.TrainStep(_loss, optax.sgd(0.1), every_k=2, donate=False)
  params = _params()
  state = step.init(params)
  x, y = _data(2)
  with pytest.raises(TypeError, match="force_emit must be a Python bool"):
    step(params, state, x, y, force_emit=jnp.asarray(True))
