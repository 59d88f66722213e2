"""`accumulate` inside optax pipelines, each against the same pipeline run on the large batch.

The rule these tests pin down: `accumulate` is exact when it is the *outermost* stateful piece,
i.e. `accumulate(optax.chain(...), k)`, because only then does everything else see one update
per window. Stateless transformations (`scale`, ...) may also sit outside it, and
`multi_transform` may hold one `accumulate` per group. `optax.masked(accumulate(...))` passes
the raw micro-batch gradient through for masked-out leaves (optax.masked's documented
pass-through), which the last test shows explicitly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

K = 4
MICRO = 3  # examples per micro-batch
STEPS = 3  # optimizer steps (windows)


def _params():
  kw, kb, kv = jax.random.split(jax.random.key(0), 3)
  return {
    "w": jax.random.normal(kw, (5, 3)),
    "b": jax.random.normal(kb, (3,)) * 0.1,
    "v": jax.random.normal(kv, (3,)),
  }


def _batches(steps=STEPS):
  kx, ky = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (steps, K * MICRO, 5))
  y = jax.random.normal(ky, (steps, K * MICRO))
  return x, y


def _loss(params, x, y):
  pred = jnp.tanh(x @ params["w"] + params["b"]) @ params["v"]
  return jnp.mean((pred - y) ** 2)


def _micro(x, i):
  return x[i::K]  # the strided split: micro-batch i holds rows i, i+K, ...


def run_large(tx, params, x, y, extra=None, jit=True):
  """The reference: `tx` on the whole batch, one update per step."""
  extra = extra or (lambda loss, step: {})

  def step(params, state, x, y, step_i):
    loss, g = jax.value_and_grad(_loss)(params, x, y)
    u, state = tx.update(g, state, params, **extra(loss, step_i))
    return optax.apply_updates(params, u), state

  step = jax.jit(step) if jit else step
  state = tx.init(params)
  for s in range(x.shape[0]):
    params, state = step(params, state, x[s], y[s], s)
  return params, state


def run_accumulated(tx, params, x, y, extra=None, jit=True):
  """`tx` (holding an `accumulate`) fed K micro-batches per step, one `update` each."""
  extra = extra or (lambda loss, step: {})

  def step(params, state, x, y, step_i, running):
    loss, g = jax.value_and_grad(_loss)(params, x, y)
    running = running + loss
    # Only the emitting call's extra args reach the inner optimizer: pass the window's mean.
    u, state = tx.update(g, state, params, **extra(running / K, step_i))
    return optax.apply_updates(params, u), state, running

  step = jax.jit(step) if jit else step
  state = tx.init(params)
  for s in range(x.shape[0]):
    running = jnp.zeros(())
    for i in range(K):
      params, state, running = step(params, state, _micro(x[s], i), _micro(y[s], i), s, running)
  return params, state


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  # Float32: the micro-batch means are summed in another order than the large batch's mean.
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=rtol, atol=atol), a, b)


def assert_moved(params, start):
  pairs = zip(jax.tree.leaves(params), jax.tree.leaves(start), strict=True)
  assert any(not np.allclose(a, b) for a, b in pairs)


def test_chain_accumulate_outermost_matches_large_batch(jit=True):
  params0, (x, y) = _params(), _batches()
  pipeline = lambda: optax.chain(  # noqa: E731
    optax.clip_by_global_norm(0.5),  # clips the window's mean gradient, as for the large batch
    optax.add_decayed_weights(1e-2),
    optax.adam(0.05),
  )
  want, _ = run_large(pipeline(), params0, x, y, jit=jit)
  got, state = run_accumulated(optax_accum.accumulate(pipeline(), K), params0, x, y, jit=jit)
  assert_moved(want, params0)
  assert_trees_close(got, want)
  assert int(state.gradient_step) == STEPS


@pytest.mark.parametrize("jit", [True, False])
def test_chain_stateless_outside_accumulate_matches_large_batch(jit):
  params0, (x, y) = _params(), _batches(steps=2)
  want, _ = run_large(optax.chain(optax.sgd(0.1), optax.scale(0.5)), params0, x, y, jit=jit)
  tx = optax.chain(optax_accum.accumulate(optax.sgd(0.1), K), optax.scale(0.5))
  got, state = run_accumulated(tx, params0, x, y, jit=jit)
  assert_trees_close(got, want)
  assert bool(optax_accum.has_updated(state))  # finds the AccumulateState inside the chain


def test_inject_hyperparams_learning_rate_changed_mid_training():
  params0, (x, y) = _params(), _batches(steps=4)
  lrs = [0.1, 0.1, 0.01, 0.01]  # the learning rate in force for each optimizer step

  ref_tx = optax.inject_hyperparams(optax.adam)(learning_rate=lrs[0])
  ref_state = ref_tx.init(params0)
  ref = params0
  for s in range(4):
    ref_state = optax.tree.set(ref_state, learning_rate=jnp.asarray(lrs[s]))
    ref, ref_state = run_large_step(ref_tx, ref, ref_state, x[s], y[s])

  tx = optax_accum.accumulate(optax.inject_hyperparams(optax.adam)(learning_rate=lrs[0]), K)
  state = tx.init(params0)
  params = params0
  step = jax.jit(micro_step(tx))
  for s in range(4):
    # Set between windows, on the accumulate state: optax.tree finds the inner hyperparams.
    state = optax.tree.set(state, learning_rate=jnp.asarray(lrs[s]))
    for i in range(K):
      params, state = step(params, state, _micro(x[s], i), _micro(y[s], i))
    np.testing.assert_allclose(optax.tree.get(state, "learning_rate"), lrs[s])
  assert_trees_close(params, ref)

  # The same optimizer without the change ends elsewhere: the change took effect.
  unchanged, _ = run_large(optax.adam(0.1), params0, x, y)
  assert not np.allclose(unchanged["w"], params["w"], atol=1e-4)


@functools.partial(jax.jit, static_argnums=0)
def run_large_step(tx, params, state, x, y):
  g = jax.grad(_loss)(params, x, y)
  u, state = tx.update(g, state, params)
  return optax.apply_updates(params, u), state


def micro_step(tx):
  def step(params, state, x, y):
    g = jax.grad(_loss)(params, x, y)
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state

  return step


def test_inject_hyperparams_schedule_counts_optimizer_steps_not_micro_steps():
  params0, (x, y) = _params(), _batches(steps=4)
  schedule = optax.piecewise_constant_schedule(0.1, {2: 0.1})  # 0.1, 0.1, 0.01, 0.01
  want, _ = run_large(optax.inject_hyperparams(optax.adam)(learning_rate=schedule), params0, x, y)
  tx = optax_accum.accumulate(optax.inject_hyperparams(optax.adam)(learning_rate=schedule), K)
  got, state = run_accumulated(tx, params0, x, y)
  assert_trees_close(got, want)
  # The schedule saw 4 optimizer steps (not 16 micro-steps): it is on its second value.
  np.testing.assert_allclose(state.inner_state.hyperparams["learning_rate"], 0.01)


def test_inject_hyperparams_around_accumulate():
  params0, (x, y) = _params(), _batches()
  want, _ = run_large(optax.adam(0.05), params0, x, y)
  factory = lambda learning_rate: optax_accum.accumulate(optax.adam(learning_rate), K)  # noqa: E731
  tx = optax.inject_hyperparams(factory)(learning_rate=0.05)
  got, state = run_accumulated(tx, params0, x, y)
  assert_trees_close(got, want)
  np.testing.assert_allclose(optax.tree.get(state, "learning_rate"), 0.05)


LABELS = {"w": "adam", "b": "sgd", "v": "adam"}


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_multi_transform_with_accumulate_inside_and_outside(where):
  params0, (x, y) = _params(), _batches()
  groups = lambda: {"adam": optax.adam(0.05), "sgd": optax.sgd(0.3)}  # noqa: E731
  want, _ = run_large(optax.multi_transform(groups(), LABELS), params0, x, y)
  if where == "inside":  # one accumulator per group
    inner = {name: optax_accum.accumulate(t, K) for name, t in groups().items()}
    tx = optax.multi_transform(inner, LABELS)
  else:
    tx = optax_accum.accumulate(optax.multi_transform(groups(), LABELS), K)
  got, _ = run_accumulated(tx, params0, x, y)
  assert_moved(want, params0)
  assert_trees_close(got, want)


MASK = {"w": True, "b": False, "v": True}


def test_masked_inside_accumulate_matches_large_batch():
  params0, (x, y) = _params(), _batches()
  pipeline = lambda: optax.chain(  # noqa: E731
    optax.masked(optax.add_decayed_weights(0.1), MASK), optax.adam(0.05)
  )
  want, _ = run_large(pipeline(), params0, x, y)
  got, _ = run_accumulated(optax_accum.accumulate(pipeline(), K), params0, x, y)
  assert_trees_close(got, want)


def test_masked_outside_accumulate_passes_masked_out_gradients_through():
  """`optax.masked(accumulate(...))`: exact on masked-in leaves; masked-out leaves get the raw
  micro-batch gradient on every call (optax.masked's pass-through), never accumulated."""
  params0, (x, y) = _params(), _batches(steps=1)
  tx = optax.masked(optax_accum.accumulate(optax.sgd(0.3), K), MASK)
  state = tx.init(params0)
  grads = [jax.grad(_loss)(params0, _micro(x[0], i), _micro(y[0], i)) for i in range(K)]
  for i in range(K):
    updates, state = tx.update(grads[i], state, params0)
    np.testing.assert_array_equal(updates["b"], grads[i]["b"])  # passed through, unscaled
  want = jax.grad(_loss)(params0, x[0], y[0])
  assert_trees_close(updates["w"], -0.3 * want["w"])  # masked-in: the large-batch sgd step


def test_reduce_on_plateau_receives_the_window_loss():
  params0, (x, y) = _params(), _batches(steps=6)
  plateau = lambda: optax.contrib.reduce_on_plateau(factor=0.5, patience=1, rtol=0.0, atol=10.0)  # noqa: E731
  want, want_state = run_large(
    optax.chain(optax.adam(0.05), plateau()), params0, x, y, extra=lambda loss, s: {"value": loss}
  )
  tx = optax_accum.accumulate(optax.chain(optax.adam(0.05), plateau()), K)
  got, state = run_accumulated(tx, params0, x, y, extra=lambda loss, s: {"value": loss})
  # atol=10 makes every step a non-improvement: the scale halves, so the test can tell.
  assert float(optax.tree.get(want_state, "scale")) < 1.0
  np.testing.assert_allclose(optax.tree.get(state, "scale"), optax.tree.get(want_state, "scale"))
  assert_trees_close(got, want)


def test_reduce_on_plateau_without_value_raises_clear_error():
  params0 = _params()
  tx = optax_accum.accumulate(optax.chain(optax.adam(0.05), optax.contrib.reduce_on_plateau()), K)
  state = tx.init(params0)
  with pytest.raises(TypeError, match="value"):
    tx.update(params0, state, params0)


def test_schedule_free_adamw_inside_accumulate():
  params0, (x, y) = _params(), _batches()
  opt = lambda: optax.contrib.schedule_free_adamw(0.05, warmup_steps=2)  # noqa: E731
  want, want_state = run_large(opt(), params0, x, y)
  got, state = run_accumulated(optax_accum.accumulate(opt(), K), params0, x, y)
  assert_trees_close(got, want)
  assert_trees_close(
    optax.contrib.schedule_free_eval_params(state.inner_state, got),
    optax.contrib.schedule_free_eval_params(want_state, want),
  )


def test_parameter_dependent_piece_outside_accumulate_runs_every_micro_step():
  """`chain(accumulate(...), add_decayed_weights(wd))` decays on every micro-step, not once
  per window: such pieces belong inside `accumulate` (the README's composition rule)."""
  params0, (x, y) = _params(), _batches(steps=1)
  tx = optax.chain(optax_accum.accumulate(optax.sgd(0.1), K), optax.add_decayed_weights(0.5))
  state = tx.init(params0)
  g = jax.grad(_loss)(params0, _micro(x[0], 0), _micro(y[0], 0))
  updates, state = tx.update(g, state, params0)
  assert not bool(optax_accum.has_updated(state))
  # A non-emitting micro-step still moves the parameters: by wd * params.
  assert_trees_close(updates, jax.tree.map(lambda p: 0.5 * p, params0))
