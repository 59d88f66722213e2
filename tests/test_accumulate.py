"""Tests of `optax_accum.accumulate`, each against an independently computed large batch.

The reference side is always a plain optax step on a direct `jax.grad` of the loss over the
whole (k·b) batch (`_reference.run_steps`); the side under test feeds the k micro-batches of
size b, one `update` call each, to `accumulate(inner, k)`.

Tolerances: float32 results are compared with `ref.TOL` (a mean of micro-batch means and the
large-batch mean round differently in the last bits, nothing more). Exact equality is asserted
where the same update program runs on the same numbers (resume, static vs dynamic emission,
every_k=1 at the update level). Compositions with other optax pieces (chain, inject_hyperparams,
extra arguments of contrib optimizers) are tested in test_optax_compose.py.

Compilation dominates the run time, so optimizers, transformations and jitted steps are module
level objects shared between tests (`accumulated`, `micro_step`, `ref.run_steps` all cache their
programs), and data are host numpy arrays.
"""

from __future__ import annotations

import functools
import math

import _reference as ref
import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum import AccumulateState, accumulate, has_updated

B = 12  # examples per window (the large batch): divisible by every k tested
N_WINDOWS = 3

P0 = ref.mlp_params(0)
DATA = ref.regression_data(1, N_WINDOWS * B)
BIG = ref.split(DATA, N_WINDOWS)  # the large batches, one per window
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32

SGD, MOMENTUM, ADAM, ADAMW = ref.SGD, ref.MOMENTUM, ref.ADAM, ref.ADAMW
OPTIMIZERS = ref.OPTIMIZERS
micro = ref.micro


def poison_first_leaf(grads, poison):
  """Adds `poison` (0.0, nan or inf) to one element of the first leaf: 0.0 changes nothing."""
  leaves, treedef = jax.tree.flatten(grads)
  first = leaves[0]
  leaves[0] = first.at[(0,) * first.ndim].add(poison.astype(first.dtype))
  return jax.tree.unflatten(treedef, leaves)


@functools.cache
def accumulated(inner, every_k, **kwargs):
  """`accumulate(inner, every_k, **kwargs)`, one object per arguments (shares compilations)."""
  return accumulate(inner, every_k, **kwargs)


@functools.cache
def _jitted_step(tx, static_force_emit):
  def step(params, state, batch, poison, weight, force_emit, emit, extra):
    grads = poison_first_leaf(jax.grad(ref.mlp_loss)(params, batch), poison)
    updates, state = tx.update(
      grads, state, params, weight=weight, force_emit=force_emit, emit=emit, **extra
    )
    return optax.apply_updates(params, updates), state, updates

  static = ("emit", "force_emit") if static_force_emit else ("emit",)
  return jax.jit(step, static_argnames=static)


def micro_step(
  tx,
  params,
  state,
  batch,
  *,
  poison=0.0,
  weight=1.0,
  force_emit=False,
  emit=None,
  static_force_emit=False,
  **extra,
):
  """One jitted micro-step: gradient of `ref.mlp_loss` on `batch` (plus `poison` in one
  element), ``tx.update(..., weight=, force_emit=, emit=, **extra)``, apply. Returns (params,
  state, updates). Every argument is always passed, with fixed dtypes, so one compiled program
  per `tx` serves every test that uses it; `emit` is static, `force_emit` too on request.
  """
  step = _jitted_step(tx, static_force_emit)
  if not static_force_emit:
    force_emit = np.bool_(force_emit)
  weight = None if weight is None else np.float32(weight)
  extra = {k: np.float32(v) for k, v in extra.items()}
  return step(params, state, batch, np.float32(poison), weight, force_emit, emit, extra)


@functools.cache
def large_batch_reference(name):
  """`N_WINDOWS` plain steps of optimizer `name` on the large batches (computed once)."""
  return ref.run_steps(OPTIMIZERS[name], P0, ref.mlp_loss, BIG, scan=True)


# ----------------------------------------------------------------------------------------------
# Equivalence with the large batch, optimizer by optimizer.


def test_reference_problem_is_not_trivial():
  # The equivalence tests below could not fail if the optimizers barely moved the parameters
  # or if clipping never acted; make sure neither is the case.
  grad_norm = optax.tree.norm(jax.grad(ref.mlp_loss)(P0, BIG[0]))
  assert grad_norm > 2 * ref.CLIP
  for name in OPTIMIZERS:
    params, _ = large_batch_reference(name)
    assert ref.max_abs_diff(params, P0) > 1e-3, name


# Three k (1 included) across the two drivers: a jitted step per micro-batch, or all micro-steps
# in one jitted lax.scan with the state as carry. (k, mode) pairs rather than their product keep
# the number of compilations, which dominates the run time, down; k=2 is covered by the
# property test and most tests below.
@pytest.mark.parametrize("k, mode", [(1, "jit"), (3, "jit"), (4, "scan")])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_accumulate_matches_large_batch(name, k, mode):
  want_params, want_state = large_batch_reference(name)
  tx = accumulate(OPTIMIZERS[name], k)
  params, state = ref.run_steps(tx, P0, ref.mlp_loss, micro(BIG, k), scan=mode == "scan")
  chex.assert_trees_all_close(params, want_params, **ref.TOL)
  # The inner optimizer's own state (moments, counts, schedule steps) matches too.
  chex.assert_trees_all_close(state.inner_state, want_state, **ref.TOL)
  assert int(state.gradient_step) == N_WINDOWS
  assert int(state.mini_step) == 0


def test_accumulate_matches_large_batch_without_jit():
  tx = accumulate(MOMENTUM, 2)
  params, state = P0, tx.init(P0)
  for batch in micro(BIG[:1], 2):  # eager: every op dispatched on its own, no jax.jit
    grads = jax.grad(ref.mlp_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  want, _ = ref.run_steps(MOMENTUM, P0, ref.mlp_loss, BIG[:1])
  chex.assert_trees_all_close(params, want, **ref.TOL)


def check_large_batch_property(k, b, d_in, hidden, seed, weights):
  """Two windows of k micro-batches of b rows, micro-batch i of each window weighing
  ``b·weights[i]`` (its rows' weights: the large batch's loss is the mean over its rows weighted
  so), against one SGD-with-momentum step per large batch. SGD with momentum: linear in the
  gradient, so any shape/seed stays within rounding (Adam's g/sqrt(v) can turn a rounding-size
  gradient component into a full step of either sign)."""
  params = ref.mlp_params(seed, (d_in, hidden, 2))
  data = ref.regression_data(seed + 1, 2 * k * b, d_in=d_in)
  rows = np.repeat(np.asarray(weights, np.float32), b)  # micro-batch i's rows weigh weights[i]
  data["mask"] = np.tile(rows, 2)  # mlp_loss: the mean weighted by the mask
  big = ref.split(data, 2)
  mbs = micro(big, k)
  inner = optax.sgd(0.05, momentum=0.9)
  extra = [{"weight": np.float32(mb["mask"].sum())} for mb in mbs]  # below 1 when b·wᵢ is

  @jax.jit  # both runs in one program: one compilation per example
  def both(params, big, mbs, extra):
    want, _ = ref.run_steps(inner, params, ref.mlp_loss, big, scan=True)
    got, state = ref.run_steps(
      accumulate(inner, k), params, ref.mlp_loss, mbs, scan=True, extra_args=extra
    )
    return want, got, state.gradient_step

  want, got, gradient_step = both(params, big, mbs, extra)
  chex.assert_trees_all_close(got, want, **ref.TOL)
  assert int(gradient_step) == 2


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(
  k=st.integers(1, 4),
  b=st.integers(1, 3),
  d_in=st.integers(1, 4),
  hidden=st.integers(1, 5),
  seed=st.integers(0, 2**16),
  # fractional weights (a token weight, a sampling rate), below 1 included, as their total may be
  weights=st.lists(st.floats(0.0625, 2.0, width=32), min_size=4, max_size=4),
)
def test_accumulate_matches_large_batch_property(k, b, d_in, hidden, seed, weights):
  check_large_batch_property(k, b, d_in, hidden, seed, weights[:k])


def test_large_batch_property_mutation_control(monkeypatch):
  # The core's `total > 0` guard written as maximum(total, 1) (issue 42): a wrong mean whenever a
  # window weighs less than 1. The property check must catch it on one such example.
  normalise = optax_accum.core._core.normalise
  monkeypatch.setattr(
    optax_accum.core._core,
    "normalise",
    lambda sums, total, like, r: normalise(sums, jnp.maximum(total, 1.0), like, r),
  )
  with pytest.raises(AssertionError):
    check_large_batch_property(2, 1, 3, 4, 0, [0.1, 0.3])


# ----------------------------------------------------------------------------------------------
# Token weighting.

T = 6  # tokens per sequence
LENGTHS = [[6, 5], [1, 2], [6, 3], [1, 1]]  # real tokens of the b=2 sequences of each micro-batch


@pytest.mark.parametrize("inner", [optax.sgd(0.5), optax.adamw(0.05)], ids=["sgd", "adamw"])
def test_accumulate_token_weights_match_global_token_mean(inner):
  k, b = 4, 2  # each micro-batch: b sequences with LENGTHS[i] real tokens
  params = ref.mlp_params(2, (3, 1))  # linear: per-token predictions
  windows = [ref.token_data(i, LENGTHS, T) for i in range(2)]
  # Reference: one step per window on the loss averaged over all its real tokens.
  want, _ = ref.run_steps(inner, params, ref.mlp_loss, windows)

  tx = accumulate(inner, k)
  results = {}
  for weighted in (True, False):
    p, s = params, tx.init(params)
    for mb in micro(windows, k):
      assert mb["x"].shape[0] == b
      weight = np.sum(mb["mask"]) if weighted else 1.0  # traced inside the step
      p, s, _ = micro_step(tx, p, s, mb, weight=weight)
    results[weighted] = p
  chex.assert_trees_all_close(results[True], want, **ref.TOL)
  # Without weights every micro-batch counts the same whatever its token count: a mean of
  # means, visibly different from the token mean.
  assert ref.max_abs_diff(results[False], want) > 1e-2 * ref.max_abs_diff(want, params)


# ----------------------------------------------------------------------------------------------
# The inner update runs once per window; its schedule advances per update.


def counting(inner, calls):
  """`inner`, recording on the host each time its update actually executes."""

  def update_fn(updates, state, params=None, **extra_args):
    jax.debug.callback(lambda: calls.append(1))
    return inner.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def test_accumulate_inner_update_runs_once_per_window():
  k = 3
  calls = []
  tx = accumulate(counting(ADAM, calls), k)
  params, state = P0, tx.init(P0)
  for i, batch in enumerate(micro(BIG, k)):
    params, state, _ = micro_step(tx, params, state, batch)
    jax.effects_barrier()
    windows_closed = (i + 1) // k
    assert len(calls) == windows_closed, f"micro-step {i}"
    assert int(optax.tree.get(state, "count")) == windows_closed  # adam's own step count

  # Same under lax.scan: k * N_WINDOWS micro-steps, N_WINDOWS inner updates.
  calls.clear()
  ref.run_steps(tx, P0, ref.mlp_loss, micro(BIG, k), scan=True)
  jax.effects_barrier()
  assert len(calls) == N_WINDOWS


def test_accumulate_schedule_advances_per_update():
  k = 2
  schedule = optax.linear_schedule(1.0, 0.25, transition_steps=4)
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
  tx = accumulate(inner, k)
  params, state = P0, tx.init(P0)

  def learning_rate(state):  # the value used by the last inner update (schedule(0) at init)
    return optax.tree.get(state, "learning_rate", filtering=lambda _, v: isinstance(v, jax.Array))

  for i, batch in enumerate(micro(BIG, k)):
    params, state, _ = micro_step(tx, params, state, batch)
    windows_closed = (i + 1) // k
    np.testing.assert_allclose(learning_rate(state), schedule(max(windows_closed - 1, 0)))
  want, _ = ref.run_steps(optax.sgd(schedule), P0, ref.mlp_loss, BIG)
  chex.assert_trees_all_close(params, want, **ref.TOL)


# ----------------------------------------------------------------------------------------------
# Non-finite micro-batches and empty windows.


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_accumulate_drops_nonfinite_microbatch(bad):
  k = 4
  tx = accumulated(ADAM, k)
  params, state = P0, tx.init(P0)
  mbs = micro(BIG[:2], k)
  for i, mb in enumerate(mbs):
    params, state, _ = micro_step(tx, params, state, mb, poison=bad if i == 1 else 0.0)
  assert int(state.num_skipped) == 1
  chex.assert_tree_all_finite(params)
  # Reference: window 0 without its micro-batch 1 (3 of 4 equal micro-batches), then window 1.
  window0 = ref.concat([mbs[0], mbs[2], mbs[3]])
  want, _ = ref.run_steps(ADAM, P0, ref.mlp_loss, [window0, BIG[1]])
  chex.assert_trees_all_close(params, want, **ref.TOL)


def test_accumulate_nonfinite_poisons_without_skip():
  # The counterpart that shows the test above can fail: with skip_nonfinite=False one NaN
  # micro-batch reaches the parameters.
  tx = accumulated(ADAM, 4, skip_nonfinite=False)
  params, state = P0, tx.init(P0)
  for i, mb in enumerate(micro(BIG[:1], 4)):
    params, state, _ = micro_step(tx, params, state, mb, poison=math.nan if i == 1 else 0.0)
  assert int(state.num_skipped) == 0
  with pytest.raises(AssertionError, match="non-finite"):
    chex.assert_tree_all_finite(params)


@pytest.mark.parametrize("empty", ["nonfinite", "zero_weight"])
def test_accumulate_empty_window_does_not_step(empty):
  k = 2
  tx = accumulated(ADAM, k)
  state0 = tx.init(P0)
  params, state = P0, state0
  for mb in micro(BIG[:1], k):
    if empty == "nonfinite":
      params, state, updates = micro_step(tx, params, state, mb, poison=math.nan)
    else:
      params, state, updates = micro_step(tx, params, state, mb, weight=0.0)
  chex.assert_trees_all_equal(updates, jax.tree.map(np.zeros_like, P0), strict=True)
  assert not bool(has_updated(state))
  assert int(state.gradient_step) == 0
  assert int(state.mini_step) == 0
  assert int(state.num_skipped) == (k if empty == "nonfinite" else 0)
  chex.assert_trees_all_equal(params, P0, strict=True)
  chex.assert_trees_all_equal(state.inner_state, state0.inner_state, strict=True)
  chex.assert_tree_all_finite(state.grad_sum)  # whatever the reset strategy, no NaN is kept

  # The next window is the inner optimizer's first step, as if the empty one never happened.
  for mb in micro(BIG[1:2], k):
    params, state, _ = micro_step(tx, params, state, mb)
  assert bool(has_updated(state))
  assert int(state.gradient_step) == 1
  want, _ = ref.run_steps(ADAM, P0, ref.mlp_loss, BIG[1:2])
  chex.assert_trees_all_close(params, want, **ref.TOL)


# ----------------------------------------------------------------------------------------------
# force_emit: a short last window.


@pytest.mark.parametrize("kind", ["python_bool", "traced_array"])
def test_accumulate_force_emit_short_window(kind):
  k = 4
  tx = accumulated(ADAM, k)
  mbs = micro(BIG[:1], k) + micro(BIG[1:2], k)[:2] + micro(BIG[2:], k)
  params, state = P0, tx.init(P0)
  emitted = []
  for i, mb in enumerate(mbs):
    force = i == 5  # micro-batch 5 ends the short window (micro-batches 4 and 5)
    params, state, _ = micro_step(
      tx, params, state, mb, force_emit=force, static_force_emit=kind == "python_bool"
    )
    emitted.append(bool(has_updated(state)))
  assert emitted == [False, False, False, True, False, True, False, False, False, True]
  assert int(state.gradient_step) == 3
  # Reference: a full window, the concatenation of the two short-window micro-batches, a full
  # window again (the window after a forced emission is a whole one).
  want, _ = ref.run_steps(ADAM, P0, ref.mlp_loss, [BIG[0], ref.concat(mbs[4:6]), BIG[2]])
  chex.assert_trees_all_close(params, want, **ref.TOL)


# ----------------------------------------------------------------------------------------------
# Resume at every position of a window.


def test_accumulate_resume_is_bit_identical():
  k = 3
  tx = accumulated(ADAMW, k)
  mbs = micro(BIG[:2], k)
  weights = [1.0, 3.0, 2.0, 0.5, 4.0, 1.0]

  def run(params, state, start, stop):
    for i in range(start, stop):
      params, state, _ = micro_step(tx, params, state, mbs[i], weight=weights[i])
    return params, state

  want_params, want_state = run(P0, tx.init(P0), 0, len(mbs))
  for pos in range(len(mbs) + 1):
    params, state = run(P0, tx.init(P0), 0, pos)
    saved = jax.device_get((params, state))  # host numpy arrays, as a checkpoint holds them
    assert isinstance(saved[1], AccumulateState)
    assert all(isinstance(x, np.ndarray | np.generic) for x in jax.tree.leaves(saved))
    assert int(saved[1].mini_step) == pos % k
    params, state = jax.device_put(saved)
    params, state = run(params, state, pos, len(mbs))
    chex.assert_trees_all_equal(params, want_params, strict=True)
    chex.assert_trees_all_equal(state, want_state, strict=True)


# ----------------------------------------------------------------------------------------------
# every_k as a schedule of gradient_step (batch-size ramp).


def grow(step):
  return jnp.where(step < 2, 2, 4)


def shrink(step):
  return jnp.where(step < 1, 4, 2)


@pytest.mark.parametrize("ramp, lengths", [(grow, [2, 2, 4]), (shrink, [4, 2, 2])])
def test_accumulate_every_k_schedule(ramp, lengths):
  tx = accumulated(ADAM, ramp)
  data = ref.regression_data(7, 3 * sum(lengths))
  mbs = ref.split(data, sum(lengths))  # micro-batches of 3 examples
  params, state = P0, tx.init(P0)
  emitted = []
  for mb in mbs:
    params, state, _ = micro_step(tx, params, state, mb)
    emitted.append(bool(has_updated(state)))
  assert emitted == [j == n - 1 for n in lengths for j in range(n)]
  bounds = np.cumsum([0, *lengths])
  windows = [ref.concat(mbs[s:e]) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
  want, _ = ref.run_steps(ADAM, P0, ref.mlp_loss, windows)
  chex.assert_trees_all_close(params, want, **ref.TOL)


def two_then_three(step):
  return jnp.where(step < 1, 2, 3)


def test_accumulate_every_k_schedule_length_fixed_at_window_open():
  # k depends on gradient_step, which moves only when a window applies an update: a window
  # that is dropped (zero weight) leaves the next one with the same length, and a window keeps
  # the length it opened with.
  tx = accumulated(SGD, two_then_three)
  mbs = ref.split(ref.regression_data(3, 9 * 2), 9)
  weights = [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # the first window (k=2) is empty
  params, state = P0, tx.init(P0)
  trace = []
  for mb, w in zip(mbs, weights, strict=True):
    params, state, _ = micro_step(tx, params, state, mb, weight=w)
    trace.append((int(state.mini_step), int(state.gradient_step)))
  # windows: [0, 1] empty (k=2), [2, 3] (k=2 still), [4, 5, 6] (k=3), [7, 8, ...] open (k=3)
  assert trace == [(1, 0), (0, 0), (1, 0), (0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2)]
  want, _ = ref.run_steps(SGD, P0, ref.mlp_loss, [ref.concat(mbs[2:4]), ref.concat(mbs[4:7])])
  chex.assert_trees_all_close(params, want, **ref.TOL)


# ----------------------------------------------------------------------------------------------
# every_k = 1: the inner optimizer itself.


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_accumulate_every_k_1_is_inner(name):
  inner = OPTIMIZERS[name]
  tx = accumulate(inner, 1)
  state = tx.init(P0)
  grads = jax.grad(ref.mlp_loss)(P0, BIG[0])
  # Same update program on the same numbers: bit-identical updates and inner state.
  want_updates, want_inner = jax.jit(inner.update)(grads, inner.init(P0), P0)
  updates, state = jax.jit(tx.update)(grads, state, P0)
  chex.assert_trees_all_equal(updates, want_updates, strict=True)
  chex.assert_trees_all_equal_dtypes(updates, want_updates)  # strict reads bf16 as f32
  chex.assert_trees_all_equal(state.inner_state, want_inner, strict=True)
  # The same tree as an accumulator, one boolean scalar per leaf: no buffer (issue 34, item 13).
  assert jax.tree.structure(state.grad_sum) == jax.tree.structure(P0)
  assert all(a.shape == () and a.dtype == jnp.bool_ for a in jax.tree.leaves(state.grad_sum))
  assert bool(has_updated(state)) and int(state.gradient_step) == 1
  # Over a run the inner update sits behind a lax.cond (to drop non-finite / zero-weight
  # gradients), which XLA does not fuse with the gradient computation: last-bit rounding only.
  got, _ = ref.run_steps(tx, P0, ref.mlp_loss, BIG, scan=True)
  want, _ = large_batch_reference(name)
  chex.assert_trees_all_close(got, want, **ref.TOL)


# ----------------------------------------------------------------------------------------------
# Structure, shapes and dtypes of updates and state.


@functools.cache
def typed_step(tx, grad_dtype):
  @jax.jit
  def step(params, state, batch):
    grads = optax.tree.cast(jax.grad(ref.mlp_loss)(params, batch), grad_dtype)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates, grads

  return step


@pytest.mark.parametrize(
  "param_dtype, grad_dtype",
  [(BF16, BF16), (BF16, F32), (F32, BF16), (BF16, F16), ("mixed", BF16)],
)
def test_accumulate_updates_have_inner_types(param_dtype, grad_dtype):
  if param_dtype == "mixed":  # bf16 matrices, f32 biases
    params = {k: v.astype(BF16 if k.startswith("w") else F32) for k, v in P0.items()}
  else:
    params = jax.tree.map(lambda p: p.astype(param_dtype), P0)
  tx = accumulated(ADAMW, 2)
  step = typed_step(tx, grad_dtype)
  state = tx.init(params)
  state0 = state
  for mb in micro(BIG[:2], 2):
    new_params, state, updates, grads = step(params, state, mb)
    want = jax.eval_shape(ADAMW.update, grads, state.inner_state, params)[0]
    # On emitting and non-emitting steps alike; and the state's dtypes never drift.
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, want)
    chex.assert_trees_all_equal_shapes_and_dtypes(state, state0)
    chex.assert_trees_all_equal_shapes_and_dtypes(new_params, params)
    params = new_params
  assert jax.tree.map(lambda a: a.dtype, state.grad_sum) == jax.tree.map(lambda _: F32, P0)
  assert int(state.gradient_step) == 2


@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_accumulate_scan_carry_bf16(name):
  # bf16 parameters and gradients, state as the lax.scan carry: scan itself rejects a carry
  # whose dtypes change, so running at all proves the state is stable.
  params = jax.tree.map(lambda p: p.astype(BF16), P0)
  batches = [jax.tree.map(lambda x: x.astype(BF16), mb) for mb in micro(BIG, 4)]
  tx = accumulate(OPTIMIZERS[name], 4)
  got, state = ref.run_steps(tx, params, ref.mlp_loss, batches, scan=True)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, tx.init(params))
  assert int(state.gradient_step) == N_WINDOWS
  # Against the large batch in the same precision (plain optax on bf16 parameters and the bf16
  # large batches), not the float32 one: rounding the parameters to bf16 after every update
  # moves a float32-trained run by about as much as three Adam steps move it (0.02 of 0.03),
  # so only a bf16 reference can tell a run that trained from one that did not. The two bf16
  # runs differ by where their gradient means round (float32 sums of micro-batch gradients vs
  # one bf16 large-batch gradient), which can flip a parameter's rounding: up to about one
  # bf16 ulp (2^-8 at the parameters' scale, < 1) per update, measured 1e-3. A quarter of the
  # movement allows that and still fails a run that did not move (it misses by 4x).
  bf16_big = [jax.tree.map(lambda x: x.astype(BF16), b) for b in BIG]
  want, _ = ref.run_steps(OPTIMIZERS[name], params, ref.mlp_loss, bf16_big, scan=True)
  movement = ref.max_abs_diff(want, params)
  assert movement > 1e-2  # several bf16 ulps: the runs train
  chex.assert_trees_all_close(got, want, rtol=0.0, atol=movement / 4)


def sparse_loss(p, batch):
  return jnp.mean(jnp.sum((batch["x"] @ p["w"] + p["nested"]["b"] - batch["y"]) ** 2, -1))


def test_accumulate_none_leaves_and_empty_subtrees():
  params = {
    "w": P0["w0"][:, :2],
    "none": None,
    "empty": {},
    "tup": (),
    "nested": {"b": P0["b1"], "z": None},
  }
  tx = accumulate(ADAM, 2)
  state = tx.init(params)
  assert jax.tree.structure(state.grad_sum) == jax.tree.structure(params)
  want, _ = ref.run_steps(ADAM, params, sparse_loss, BIG, scan=True)
  for mode in ("jit", "scan"):
    got, state = ref.run_steps(tx, params, sparse_loss, micro(BIG, 2), scan=mode == "scan")
    assert jax.tree.structure(got) == jax.tree.structure(params)
    chex.assert_trees_all_close(got, want, **ref.TOL)


# ----------------------------------------------------------------------------------------------
# Extra arguments of the inner update with the static spelling.


@functools.cache
def plateau_reference():
  """`ref.PLATEAU` on the large batches, with `ref.PLATEAU_VALUES` (computed once)."""
  values = [{"value": np.float32(v)} for v in ref.PLATEAU_VALUES]
  return ref.run_steps(ref.PLATEAU, P0, ref.mlp_loss, BIG, extra_args=values)


def test_accumulate_static_emit_extra_args_only_when_emitting():
  # With the static spelling the accumulating program never runs the inner optimizer, so it
  # needs none of its extra arguments.
  k = 2
  tx = accumulated(ref.PLATEAU, k)
  params, state = P0, tx.init(P0)
  for i, mb in enumerate(micro(BIG, k)):
    if i % k == k - 1:
      params, state, _ = micro_step(
        tx, params, state, mb, emit=True, value=ref.PLATEAU_VALUES[i // k]
      )
    else:
      params, state, updates = micro_step(tx, params, state, mb, emit=False)
      chex.assert_trees_all_equal_shapes_and_dtypes(updates, P0)
  want, _ = plateau_reference()
  chex.assert_trees_all_close(params, want, **ref.TOL)


# ----------------------------------------------------------------------------------------------
# has_updated, reduction="sum", accum_dtype=None, static emission.


def test_has_updated():
  tx = accumulated(SGD, 2)
  state = tx.init(P0)
  assert not bool(has_updated(state))
  flags = []
  params = P0
  for mb in micro(BIG[:2], 2):
    params, state, _ = micro_step(tx, params, state, mb)
    flags.append(bool(has_updated(state)))
  assert flags == [False, True, False, True]
  with pytest.raises(ValueError, match="exactly one AccumulateState, found 0"):
    has_updated(SGD.init(P0))


SUM_WEIGHTS = [1.0, 2.0, 0.5]


def summed_loss(params, big):
  """Σ wᵢ · (mean loss of micro-batch i) over the k = len(big)/4 micro-batches of `big`."""
  k = big["x"].shape[0] // 4
  parts = [jax.tree.map(lambda x, i=i: x[4 * i : 4 * (i + 1)], big) for i in range(k)]
  return sum(w * ref.mlp_loss(params, p) for w, p in zip(SUM_WEIGHTS, parts, strict=False))


@pytest.mark.parametrize("k", [1, 3])
def test_accumulate_reduction_sum(k):
  inner = optax.sgd(0.01)
  data = ref.regression_data(5, N_WINDOWS * 4 * k)  # micro-batches of 4 examples
  big = ref.split(data, N_WINDOWS)
  want, _ = ref.run_steps(inner, P0, summed_loss, big)
  tx = accumulate(inner, k, reduction="sum")
  params, state = P0, tx.init(P0)
  for i, mb in enumerate(micro(big, k)):
    params, state, _ = micro_step(tx, params, state, mb, weight=SUM_WEIGHTS[i % k])
  chex.assert_trees_all_close(params, want, **ref.TOL)


def test_accumulate_accum_dtype_none():
  # None: the accumulator takes the gradients' own dtype (here f32, so the result is exact).
  tx = accumulate(ADAM, 2, accum_dtype=None)
  got, _ = ref.run_steps(tx, P0, ref.mlp_loss, micro(BIG, 2))
  want, _ = large_batch_reference("adam")
  chex.assert_trees_all_close(got, want, **ref.TOL)
  bf16 = jax.tree.map(lambda p: p.astype(BF16), P0)
  assert all(a.dtype == BF16 for a in jax.tree.leaves(tx.init(bf16).grad_sum))
  default = accumulated(ADAM, 2)  # float32 accumulator by default
  assert all(a.dtype == F32 for a in jax.tree.leaves(default.init(bf16).grad_sum))


GRAD_FN = jax.jit(jax.grad(ref.mlp_loss))
APPLY = jax.jit(optax.apply_updates)


@pytest.mark.parametrize("name", ["adam", "extra_args"])
def test_accumulate_static_emit_equals_dynamic(name):
  # The gradient, the update and the apply are separate programs here so that both paths run the
  # same numbers through the same update code: inside one bigger jitted step XLA may fuse the
  # gradient with the (unconditional) static update differently, a last-bit difference that
  # says nothing about accumulate.
  k = 3
  tx = accumulate(ADAM if name == "adam" else ref.PLATEAU, k)
  update = jax.jit(tx.update, static_argnames=("emit",))
  dynamic = static = (P0, tx.init(P0))
  for i, mb in enumerate(micro(BIG[:2], k)):
    kw = {"weight": np.float32(i + 1), "value": np.float32(1.0 + i)}
    (dp, ds), (sp, ss) = dynamic, static
    du, ds = update(GRAD_FN(dp, mb), ds, dp, **kw)
    su, ss = update(GRAD_FN(sp, mb), ss, sp, emit=i % k == k - 1, **kw)
    dynamic, static = (APPLY(dp, du), ds), (APPLY(sp, su), ss)
    chex.assert_trees_all_equal(su, du, strict=True)
    chex.assert_trees_all_equal(static, dynamic, strict=True)
  assert int(dynamic[1].gradient_step) == 2


def test_accumulate_static_emit_bad_input():
  tx = accumulated(SGD, 2)
  grads = jax.grad(ref.mlp_loss)(P0, BIG[0])
  with pytest.raises(TypeError, match="emit must be None or a Python bool, got 'yes'"):
    tx.update(grads, tx.init(P0), P0, emit="yes")
  with pytest.raises(ValueError, match="emit=False contradicts force_emit=True"):
    tx.update(grads, tx.init(P0), P0, emit=False, force_emit=True)


# ----------------------------------------------------------------------------------------------
# Bad input: errors name the argument and the bad value.


@pytest.mark.parametrize(
  "every_k, error, match",
  [
    (0, ValueError, "every_k must be a positive int, got 0"),
    (-1, ValueError, "every_k must be a positive int, got -1"),
    (2.5, TypeError, "every_k must be a positive int .*got 2.5 of type float"),
    (True, TypeError, "every_k must be a positive int .*got True of type bool"),
    ("4", TypeError, "every_k must be a positive int .*got '4' of type str"),
  ],
)
def test_accumulate_bad_every_k(every_k, error, match):
  with pytest.raises(error, match=match):
    accumulate(SGD, every_k)


def test_accumulate_bad_reduction():
  with pytest.raises(ValueError, match=r"reduction must be one of .*got 'avg'.*meant 'mean'"):
    accumulate(SGD, 2, reduction="avg")


@pytest.mark.parametrize(
  "weight, error, match",
  [
    (-1.0, ValueError, r"weight must be non-negative and finite, got -1\.0"),
    (np.array([1.0, 2.0]), ValueError, r"weight must be a scalar .*shape \(2,\)"),
    (math.nan, ValueError, "weight must be non-negative and finite, got nan"),
    ("3", TypeError, "weight must be .*got '3'"),
  ],
)
@pytest.mark.parametrize("every_k", [1, 2])
def test_accumulate_bad_weight(every_k, weight, error, match):
  tx = accumulated(SGD, every_k)
  grads = jax.tree.map(np.ones_like, P0)
  with pytest.raises(error, match=match):
    tx.update(grads, tx.init(P0), P0, weight=weight)
  with pytest.raises(error, match=match):  # at trace time too (the weight is a constant)
    jax.jit(lambda g, s: tx.update(g, s, P0, weight=weight))(grads, tx.init(P0))


def test_accumulate_grads_tree_mismatch():
  tx = accumulated(SGD, 2)
  state = tx.init(P0)
  grads = jax.tree.map(np.ones_like, P0)
  missing = {k: v for k, v in grads.items() if k != "b1"}
  with pytest.raises(ValueError, match="grads do not match the tree the state was initialised"):
    tx.update(missing, state, P0)
  reshaped = {**grads, "w1": grads["w1"].T}
  with pytest.raises(ValueError, match=r"(?s)grads have other shapes .*\['w1'\]: grads \(2, 8\)"):
    jax.jit(tx.update)(reshaped, state, P0)


def test_accumulate_every_k_schedule_bad_return():
  tx = accumulate(SGD, lambda step: 2.5)
  grads = jax.tree.map(np.ones_like, P0)
  with pytest.raises(TypeError, match="every_k.*must return an integer scalar, got float"):
    tx.update(grads, tx.init(P0), P0)


def test_accumulate_public_names():
  # The package root exports this module's public objects (not copies or wrappers) and lists
  # them in __all__; each is documented with an example that the doctests run.
  from optax_accum.core import _state
  from optax_accum.front_ends import _accumulate

  for name, module in (
    ("accumulate", _accumulate),
    ("AccumulateState", _state),
    ("has_updated", _state),
  ):
    assert name in optax_accum.__all__, name
    assert getattr(optax_accum, name) is getattr(module, name), name
  assert ">>>" in accumulate.__doc__ and ">>>" in has_updated.__doc__
  assert isinstance(accumulate(SGD, 2), optax.GradientTransformationExtraArgs)
