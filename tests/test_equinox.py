"""Equinox as a first-class user (issue 24, item 7): modules with non-array leaves (activation
functions, static fields) through every front end, against the large batch computed directly
(`eqx.filter_value_and_grad` over the whole batch, then one plain optax step on
``eqx.filter(model, eqx.is_array)``), and an `eqx.nn.State` threaded through `microbatch`'s
state arguments against ``k`` sequential small steps.
"""

from __future__ import annotations

import inspect
import pathlib

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum import accumulate, microbatch

K = 4
TOL = dict(rtol=1e-6, atol=1e-7)  # float32: micro-batch means summed in another order
ADAM_TOL = dict(rtol=2e-5, atol=2e-6)  # Adam's first step ~lr·g/|g| on tiny entries


def _model():
  return eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))


def _data(n=16, seed=1):
  rng = np.random.default_rng(seed)
  return (
    jnp.asarray(rng.standard_normal((n, 3)), jnp.float32),
    jnp.asarray(rng.standard_normal((n, 2)), jnp.float32),
  )


def _loss(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _arrays(tree):
  return eqx.filter(tree, eqx.is_array)


def _large_batch_step(inner, model, x, y):
  grads = eqx.filter_grad(_loss)(model, x, y)
  updates, _ = inner.update(grads, inner.init(_arrays(model)), _arrays(model))
  return eqx.apply_updates(model, updates)


def _copy(model):
  """A copy of the model's arrays (TrainStep donates what it is given)."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, model)


@pytest.mark.parametrize("jit", [False, True])
def test_equinox_microbatch_mlp_matches_large_batch_regression_issue_24_item_7(jit):
  model, (x, y) = _model(), _data()
  step = microbatch(eqx.filter_value_and_grad(_loss), K, batch_argnums=(1, 2))
  if jit:
    step = eqx.filter_jit(lambda m, x, y: microbatch(eqx.filter_value_and_grad(_loss), K,
                                                     batch_argnums=(1, 2))(m, x, y))  # fmt: skip
  value, grads = step(model, x, y)
  want_value, want_grads = eqx.filter_value_and_grad(_loss)(model, x, y)
  chex.assert_trees_all_close((value, _arrays(grads)), (want_value, _arrays(want_grads)), **TOL)
  assert jax.tree.structure(grads) == jax.tree.structure(want_grads)


def test_equinox_train_step_on_a_whole_module_regression_issue_24_item_7():
  model, (x, y) = _model(), _data()
  inner = optax.adam(1e-2)
  want = _large_batch_step(inner, model, x, y)
  step = optax_accum.TrainStep(_loss, inner, K)
  state = step.init(model)
  # The state is the one `accumulate` makes from the arrays: checkpoints are interchangeable.
  assert jax.tree.structure(state) == jax.tree.structure(step.tx.init(_arrays(model)))
  m = _copy(model)
  b = len(x) // K
  for i in range(K):
    m, state, _ = step(m, state, x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])
  assert isinstance(m, eqx.nn.MLP) and m.activation is model.activation
  chex.assert_trees_all_close(_arrays(m), _arrays(want), **ADAM_TOL)
  assert int(state.gradient_step) == 1


def test_equinox_accumulate_with_filter_jit_matches_large_batch():
  model, (x, y) = _model(), _data()
  inner = optax.adam(1e-2)
  tx = accumulate(inner, K)
  state = tx.init(_arrays(model))

  @eqx.filter_jit
  def step(model, state, x, y):
    grads = eqx.filter_grad(_loss)(model, x, y)
    updates, state = tx.update(grads, state, _arrays(model))
    return eqx.apply_updates(model, updates), state

  m, b = model, len(x) // K
  for i in range(K):
    m, state = step(m, state, x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])
  chex.assert_trees_all_close(_arrays(m), _arrays(_large_batch_step(inner, model, x, y)),
                              **ADAM_TOL)  # fmt: skip


class _Norm(eqx.Module):
  """A linear layer and a BatchNorm: mutable state (running statistics) in an `eqx.nn.State`."""

  linear: eqx.nn.Linear
  norm: eqx.nn.BatchNorm

  def __init__(self, key):
    self.linear = eqx.nn.Linear(3, 4, key=key)
    self.norm = eqx.nn.BatchNorm(4, axis_name="batch", momentum=0.5, mode="batch")

  def __call__(self, x, state):
    return self.norm(jax.nn.relu(self.linear(x)), state)


def _norm_loss(model, state, x, y):
  out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
  return jnp.mean((out[:, :2] - y) ** 2), state


# "error": `eqx.filter_jit` of a wrapper whose `__wrapped__` holds `filter_value_and_grad`'s
# `has_aux=True` warned that it might hide parameters (the wrappers no longer keep one).
@pytest.mark.filterwarnings("error")
def test_equinox_state_threads_through_microbatch_state_arguments():
  model, state = eqx.nn.make_with_state(_Norm)(jax.random.key(0))
  x, y = _data(16)
  vg = eqx.filter_value_and_grad(_norm_loss, has_aux=True)
  step = microbatch(vg, K, batch_argnums=(2, 3), state_argnums=1, state_out=lambda out: out[0][1])
  (value, new_state), grads = eqx.filter_jit(step)(model, state, x, y)
  # K sequential small steps on the strided micro-batches (rows i, i+K, ...), each seeing the
  # state the previous one left.
  s, values, gs = state, [], []
  for i in range(K):
    (v, s), g = vg(model, s, x[i::K], y[i::K])
    values.append(v)
    gs.append(_arrays(g))
  chex.assert_trees_all_close(value, np.mean(values), **TOL)
  # BatchNorm over 4 rows divides by their standard deviation: the gradient amplifies float32
  # rounding (the loop's fused program against these eager steps) to ~2e-5 relative.
  norm_tol = dict(rtol=5e-5, atol=1e-6)
  chex.assert_trees_all_close(_arrays(grads), jax.tree.map(lambda *g: sum(g) / K, *gs), **norm_tol)
  chex.assert_trees_all_close(_arrays(new_state), _arrays(s), **TOL)
  assert not np.allclose(  # the running statistics did move
    jax.tree.leaves(_arrays(new_state))[0], jax.tree.leaves(_arrays(state))[0]
  )


@pytest.mark.parametrize(
  "wrap",
  [
    lambda f: optax_accum.microbatch(f, K, batch_argnums=(1, 2)),
    lambda f: optax_accum.data_parallel(f, axis_name="data", batch_argnums=(1, 2)),
  ],
  ids=["microbatch", "data_parallel"],
)
def test_wrappers_keep_name_and_signature_but_no_wrapped_reference(wrap):
  # Equinox follows `__wrapped__` and warns when the chain holds array-like leaves (the
  # `has_aux=True` of `filter_value_and_grad`), as if the wrapper hid parameters.
  vg = eqx.filter_value_and_grad(_loss)
  f = wrap(vg)
  assert not hasattr(f, "__wrapped__")
  assert inspect.signature(f) == inspect.signature(vg)
  assert f.__doc__ == vg.__doc__


def test_item17_train_step_donation_is_said_where_an_equinox_user_looks():
  """Issue 34, item 17: TrainStep donates the module it is given to the call that updates it
  (the default, which saves a copy of the parameters per update). Reading the old module then
  raises JAX's own error, which the docs name; passing it again raises TrainStep's, which names
  the leaf and the fix. An accumulating call only reads the module: it returns the same one."""
  model, (x, y) = _model(), _data()
  step = optax_accum.TrainStep(_loss, optax.adam(1e-2), K)
  old = _copy(model)
  state = step.init(old)
  new = old
  for i in range(K):
    before = new
    new, state, _ = step(new, state, x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4])
    assert (new is before) == (i < K - 1)
  assert int(state.gradient_step) == 1
  with pytest.raises(RuntimeError, match="Array has been deleted"):
    old.layers[0].weight + 1
  said = (
    r"(?s)params\.layers\[0\]\.weight is a deleted array.*"
    r"params, state, loss = step\(params, state, batch\).*donate=False"
  )
  with pytest.raises(ValueError, match=said):
    step(old, state, x[4:8], y[4:8])
  new, state, _ = step(new, state, x[4:8], y[4:8])  # rebinding works
  assert int(state.mini_step) == 1
  # donate=False keeps the caller's module intact
  keeping = optax_accum.TrainStep(_loss, optax.adam(1e-2), K, donate=False)
  kept = _copy(model)
  s = keeping.init(kept)
  keeping(kept, s, x[:4], y[:4])
  chex.assert_trees_all_equal(_arrays(kept), _arrays(model))
  # ... and it is said where the user looks: the docstring and the Equinox guide
  doc = inspect.getdoc(optax_accum.TrainStep)
  guide = (pathlib.Path(__file__).parent.parent / "docs" / "guides" / "equinox.md").read_text()
  for text in (doc, guide):
    assert "Array has been deleted" in text and "donate=False" in text
