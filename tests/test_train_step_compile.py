"""`TrainStep`'s compile path (both programs compiled together, run as compiled, `jax.jit` for
inputs unlike those) and its errors in its own words (issue 25)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum


def _loss(params, x):
  return jnp.mean((x @ params["w"] + params["b"]) ** 2)


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.zeros(3)}


def _batches(n, rows=2):
  rng = np.random.default_rng(0)
  return [rng.normal(size=(rows, 4)).astype(np.float32) for _ in range(n)]


def _train(step, batches, compile_first=False):
  params = _params()
  state = step.init(params)
  if compile_first:
    step = step.compile(params, state, batches[0])
  for x in batches:
    params, state, _ = step(params, state, x)
  return params, state


def test_train_step_compile_runs_what_jit_runs_bit_for_bit():
  batches = _batches(6)
  make = lambda: optax_accum.TrainStep(_loss, optax.adam(1e-2), every_k=3)  # noqa: E731
  got, got_state = _train(make(), batches, compile_first=True)
  want, _ = _train(make(), batches)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert int(got_state.gradient_step) == 2
  # the reference: Adam on each window's concatenated rows, directly
  params, adam = _params(), optax.adam(1e-2)
  opt = adam.init(params)
  for w in range(2):
    grads = jax.grad(_loss)(params, np.concatenate(batches[3 * w : 3 * w + 3]))
    updates, opt = adam.update(grads, opt, params)
    params = optax.apply_updates(params, updates)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, params)


def test_train_step_compiles_each_program_once_per_argument_type():
  step = optax_accum.TrainStep(_loss, optax.sgd(0.1), every_k=2)
  params = _params()
  state = step.init(params)
  with jax.log_compiles(False):
    for x in _batches(4):
      params, state, _ = step(params, state, x)
  assert len(step._compiled) == 1 and set(next(iter(step._compiled.values()))) == {False, True}
  for x in _batches(2, rows=5):  # another micro-batch shape: its own pair of programs
    params, state, _ = step(params, state, x)
  assert len(step._compiled) == 2 and int(state.gradient_step) == 3


def test_train_step_inputs_unlike_the_compiled_ones_fall_back_to_jit():
  step = optax_accum.TrainStep(_loss, optax.sgd(0.1), every_k=2, donate=False)
  params = _params()
  state = step.init(params)
  x = _batches(1)[0]
  params, state, _ = step(params, state, x)
  half = jax.tree.map(lambda a: jnp.asarray(a, jnp.float16), params)  # other parameter types
  out, state, _ = step(half, state, x)  # unlike the compiled programs': run through jax.jit
  assert int(state.gradient_step) == 1  # (the compiled pair stays, for inputs like its own)
  assert all(a.dtype == jnp.float16 for a in jax.tree.leaves(out))
  want = jax.tree.map(  # the window: sgd on the mean of the two micro-batches' gradients
    lambda p, g1, g2: p - 0.1 * ((g1 + g2.astype(jnp.float32)) / 2).astype(p.dtype),
    half, jax.grad(_loss)(params, x), jax.grad(_loss)(half, x),
  )  # fmt: skip
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3), out, want)
  other = {"w": params["w"][:, :2], "b": params["b"][:2]}  # other shapes, same tree
  fresh = optax_accum.TrainStep(_loss, optax.sgd(0.1), every_k=2, donate=False)
  fresh_state = fresh.init(params)
  fresh(params, fresh_state, x)
  with pytest.raises(ValueError, match=r"^TrainStep: grads have other shapes"):
    fresh(other, fresh_state, x)


def test_train_step_errors_in_its_own_words_regression_issue_25():
  params = _params()
  with_noise = optax_accum.TrainStep(_loss, optax.sgd(0.1), every_k=2, noise_scale=True)
  plain = optax_accum.TrainStep(_loss, optax.sgd(0.1), every_k=2)
  own = optax_accum.TrainStep(_loss, optax.sgd(0.1), every_k=2, accum_dtype=None)
  half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  one = optax_accum.TrainStep(_loss, optax.sgd(0.1), every_k=1)
  x = _batches(1)[0]
  cases = [
    (
      plain,
      with_noise.init(params),
      "made with noise_scale=True but this TrainStep has noise_scale=False",
    ),
    (plain, one.init(params), "made with every_k=1 (it holds no accumulator)"),
    (plain, own.init(half), "made with another accum_dtype"),  # bf16 sums, float32 asked for
  ]
  for step, state, said in cases:
    with pytest.raises(ValueError) as e:
      step(half if said.endswith("accum_dtype") else params, state, x)
    message = str(e.value)
    assert message.startswith("TrainStep: this state was ") and said in message, message
    assert "accumulate.update" not in message and "tx.init" not in message
    assert "make the state with the object that updates it: `step.init(params)`" in message.lower()
