"""`accumulate` inside optax pipelines, each against the same pipeline run on the large batch.

The rule these tests pin down: `accumulate` is exact when it is the *outermost* stateful piece,
i.e. `accumulate(optax.chain(...), k)`, because only then does everything else see one update
per window. Stateless transformations (`scale`, ...) may also sit outside it, and
`multi_transform` may hold one `accumulate` per group. `optax.masked(accumulate(...))` passes
the raw micro-batch gradient through for masked-out leaves (optax.masked's documented
pass-through), which the last test shows explicitly.

Both sides run through `_reference.run_steps`: the pipeline on the large batches (the reference),
and the pipeline holding `accumulate` on their K micro-batches.
"""

from __future__ import annotations

import math

import _reference as ref
import chex
import jax
import numpy as np
import optax
import pytest

import optax_accum

K = 4
MICRO = 3  # examples per micro-batch
P0 = ref.mlp_params(0)
BIG = ref.split(ref.regression_data(1, 6 * K * MICRO), 6)  # the large batches, one per window
LOSS = ref.mlp_loss


def run_large(tx, n, **kw):
  """The reference: `tx` on the first `n` large batches, one update each."""
  return ref.run_steps(tx, P0, LOSS, BIG[:n], **kw)


def run_accumulated(tx, n, **kw):
  """`tx` (holding an `accumulate`) fed the K micro-batches of each of the first `n` large
  batches, one `update` call each."""
  return ref.run_steps(tx, P0, LOSS, ref.micro(BIG[:n], K), **kw)


def test_chain_accumulate_outermost_matches_large_batch():
  pipeline = lambda: optax.chain(  # noqa: E731
    optax.clip_by_global_norm(0.5),  # clips the window's mean gradient, as for the large batch
    optax.add_decayed_weights(1e-2),
    optax.adam(0.05),
  )
  want, _ = run_large(pipeline(), 3)
  got, state = run_accumulated(optax_accum.accumulate(pipeline(), K), 3)
  assert ref.max_abs_diff(want, P0) > 1e-2  # it trained
  chex.assert_trees_all_close(got, want, **ref.TOL)
  assert int(state.gradient_step) == 3


@pytest.mark.parametrize("mode", ["scan", "eager"])
def test_chain_stateless_outside_accumulate_matches_large_batch(mode):
  kw = {"scan": True} if mode == "scan" else {"jit": False}
  want, _ = run_large(optax.chain(ref.ADAM, optax.scale(0.5)), 2, **kw)
  tx = optax.chain(optax_accum.accumulate(ref.ADAM, K), optax.scale(0.5))
  got, state = run_accumulated(tx, 2, **kw)
  chex.assert_trees_all_close(got, want, **ref.TOL)
  assert bool(optax_accum.has_updated(state))  # finds the AccumulateState inside the chain


def test_inject_hyperparams_learning_rate_changed_mid_training():
  lrs = [0.1, 0.1, 0.01, 0.01]  # the learning rate in force for each optimizer step
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=lrs[0])
  tx = optax_accum.accumulate(inner, K)
  assert float(optax.tree.get(tx.init(P0), "learning_rate")) == pytest.approx(lrs[0])
  want, want_state = P0, inner.init(P0)
  got, state = P0, tx.init(P0)
  for s, lr in enumerate(lrs):
    # Set between windows, as a user would: on the accumulate state optax.tree finds the inner
    # hyperparameters.
    want_state = optax.tree.set(want_state, learning_rate=np.float32(lr))
    want, want_state = ref.run_steps(inner, want, LOSS, BIG[s : s + 1], state=want_state)
    state = optax.tree.set(state, learning_rate=np.float32(lr))
    got, state = ref.run_steps(tx, got, LOSS, ref.micro(BIG[s : s + 1], K), state=state)
    np.testing.assert_allclose(optax.tree.get(state, "learning_rate"), lr)
  chex.assert_trees_all_close(got, want, **ref.TOL)
  # The same optimizer without the change ends elsewhere: the change took effect.
  unchanged, _ = run_large(inner, 4)
  assert ref.max_abs_diff(unchanged, got) > 1e-4


def test_inject_hyperparams_schedule_counts_optimizer_steps_not_micro_steps():
  schedule = optax.piecewise_constant_schedule(0.1, {2: 0.1})  # 0.1, 0.1, 0.01, 0.01
  want, _ = run_large(optax.inject_hyperparams(optax.adam)(learning_rate=schedule), 4)
  tx = optax_accum.accumulate(optax.inject_hyperparams(optax.adam)(learning_rate=schedule), K)
  got, state = run_accumulated(tx, 4)
  chex.assert_trees_all_close(got, want, **ref.TOL)
  # The schedule saw 4 optimizer steps (not 16 micro-steps): it is on its second value.
  np.testing.assert_allclose(state.inner_state.hyperparams["learning_rate"], 0.01)


def test_inject_hyperparams_around_accumulate():
  want, _ = run_large(optax.adam(0.05), 3)
  factory = lambda learning_rate: optax_accum.accumulate(optax.adam(learning_rate), K)  # noqa: E731
  tx = optax.inject_hyperparams(factory)(learning_rate=0.05)
  got, state = run_accumulated(tx, 3)
  chex.assert_trees_all_close(got, want, **ref.TOL)
  np.testing.assert_allclose(optax.tree.get(state, "learning_rate"), 0.05)


LABELS = {"w0": "adam", "b0": "sgd", "w1": "adam", "b1": "sgd"}


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_multi_transform_with_accumulate_inside_and_outside(where):
  groups = lambda: {"adam": optax.adam(0.05), "sgd": optax.sgd(0.3)}  # noqa: E731
  want, _ = run_large(optax.multi_transform(groups(), LABELS), 3)
  if where == "inside":  # one accumulator per group
    inner = {name: optax_accum.accumulate(t, K) for name, t in groups().items()}
    tx = optax.multi_transform(inner, LABELS)
  else:
    tx = optax_accum.accumulate(optax.multi_transform(groups(), LABELS), K)
  got, _ = run_accumulated(tx, 3)
  assert ref.max_abs_diff(want, P0) > 1e-2  # it trained
  chex.assert_trees_all_close(got, want, **ref.TOL)


MASK = {"w0": True, "b0": False, "w1": True, "b1": False}


def test_masked_inside_accumulate_matches_large_batch():
  pipeline = lambda: optax.chain(  # noqa: E731
    optax.masked(optax.add_decayed_weights(0.1), MASK), optax.adam(0.05)
  )
  want, _ = run_large(pipeline(), 3)
  got, _ = run_accumulated(optax_accum.accumulate(pipeline(), K), 3)
  chex.assert_trees_all_close(got, want, **ref.TOL)


def test_masked_outside_accumulate_passes_masked_out_gradients_through():
  """`optax.masked(accumulate(...))`: exact on masked-in leaves; masked-out leaves get the raw
  micro-batch gradient on every call (optax.masked's pass-through), never accumulated."""
  tx = optax.masked(optax_accum.accumulate(optax.sgd(0.3), K), MASK)
  state = tx.init(P0)
  grads = [jax.grad(LOSS)(P0, mb) for mb in ref.split(BIG[0], K)]
  for g in grads:
    updates, state = tx.update(g, state, P0)
    for name in ("b0", "b1"):  # passed through, unscaled
      np.testing.assert_array_equal(updates[name], g[name])
  want = jax.grad(LOSS)(P0, BIG[0])
  for name in ("w0", "w1"):  # masked-in: the large-batch sgd step
    chex.assert_trees_all_close(updates[name], -0.3 * want[name], **ref.TOL)


def test_reduce_on_plateau_sees_only_the_emitting_calls_value():
  # The inner optimizer's extra arguments are those of the window's emitting call. The other
  # calls pass NaN: if the inner optimizer ever saw one, the plateau logic would break.
  values = [{"value": np.float32(v)} for v in ref.PLATEAU_VALUES]
  want, want_state = run_large(ref.PLATEAU, 3, extra_args=values)
  micro_values = [
    {"value": np.float32(v["value"] if i == K - 1 else math.nan)} for v in values for i in range(K)
  ]
  tx = optax_accum.accumulate(ref.PLATEAU, K)
  got, state = run_accumulated(tx, 3, extra_args=micro_values)
  assert float(optax.tree.get(want_state, "scale")) < 1.0  # the plateau logic did act
  assert float(optax.tree.get(state, "scale")) == float(optax.tree.get(want_state, "scale"))
  chex.assert_trees_all_close(got, want, **ref.TOL)


def test_reduce_on_plateau_without_value_raises_clear_error():
  tx = optax_accum.accumulate(optax.chain(optax.adam(0.05), optax.contrib.reduce_on_plateau()), K)
  state = tx.init(P0)
  with pytest.raises(TypeError, match="value"):
    tx.update(P0, state, P0)


def test_schedule_free_adamw_inside_accumulate():
  opt = lambda: optax.contrib.schedule_free_adamw(0.05, warmup_steps=2)  # noqa: E731
  want, want_state = run_large(opt(), 3)
  got, state = run_accumulated(optax_accum.accumulate(opt(), K), 3)
  chex.assert_trees_all_close(got, want, **ref.TOL)
  chex.assert_trees_all_close(
    optax.contrib.schedule_free_eval_params(state.inner_state, got),
    optax.contrib.schedule_free_eval_params(want_state, want),
    **ref.TOL,
  )


def test_parameter_dependent_piece_outside_accumulate_runs_every_micro_step():
  """`chain(accumulate(...), add_decayed_weights(wd))` decays on every micro-step, not once
  per window: such pieces belong inside `accumulate` (the README's composition rule)."""
  tx = optax.chain(optax_accum.accumulate(optax.sgd(0.1), K), optax.add_decayed_weights(0.5))
  state = tx.init(P0)
  g = jax.grad(LOSS)(P0, ref.split(BIG[0], K)[0])
  updates, state = tx.update(g, state, P0)
  assert not bool(optax_accum.has_updated(state))
  # A non-emitting micro-step still moves the parameters: by wd * params.
  chex.assert_trees_all_close(updates, jax.tree.map(lambda p: 0.5 * p, P0), **ref.TOL)
