"""Issue 17 on the `accumulate` / `TrainStep` side: each bug and disagreement, named after it.

* bug 3: `state_partition_specs` on masked, multi-transform, factored (adafactor) and nested
  inner optimizers gives a spec tree of exactly the state's structure, which places the state;
* bug 4: a state records the length its open window was opened with (another `every_k`, or a
  schedule whose value changes mid-window, finishes that window as opened) and its accumulator
  dtype (another `accum_dtype` raises, naming both);
* the disagreements: `has_updated` on an nnx state (in test_flax.py), `TrainStep` inside
  `jax.jit`, `weight_fn` errors, ``every_k=1`` against ``every_k=2`` windows of one,
  `accum_dtype=None`, ``reduction="sum"``, and the unbound-`axis_name` error.

Values are compared with the large batch computed directly (a plain optax step on the mean
gradient); float32 tolerances as in `_reference.TOL`.
"""

from __future__ import annotations

import _reference as ref
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import accumulate, has_updated, state_partition_specs

AX = "data"


def _is_spec(x) -> bool:
  return isinstance(x, (P, NamedSharding))


# ----------------------------------------------------------------------------------------------
# Bug 3: state_partition_specs on optax's own state shapes.

# Big enough for adafactor to factor "w" (its min_dim_size_to_factor is 128).
SPEC_PARAMS = {
  "w": np.full((128, 256), 0.5, np.float32),
  "b": np.zeros(128, np.float32),
  "nested": {"v": np.ones((4, 8), np.float32)},
}
SPEC_MASK = {"w": True, "b": False, "nested": {"v": True}}
SPEC_LABELS = {"w": "adam", "b": "sgd", "nested": {"v": "adam"}}

INNERS = {
  "adamw_dict_mask": optax.adamw(1e-2, mask=SPEC_MASK),
  "adamw_callable_mask": optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
  "masked": optax.masked(optax.adam(1e-2), SPEC_MASK),
  "multi_transform": optax.multi_transform(
    {"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1)}, SPEC_LABELS
  ),
  "adafactor": optax.adafactor(1e-2),
  "nested_chain": optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, mask=SPEC_MASK),
  ),
}


def _specs_and_state(inner, axis_name):
  tx = accumulate(inner, 4, axis_name=axis_name)
  params_specs = jax.tree.map(lambda _: P(), SPEC_PARAMS)
  specs = state_partition_specs(tx, params_specs, axis_name, params=SPEC_PARAMS)
  return tx, specs


@pytest.mark.parametrize("name", list(INNERS))
def test_state_partition_specs_bug3_matches_the_state_structure(name):
  tx, specs = _specs_and_state(INNERS[name], None)
  state = tx.init(SPEC_PARAMS)
  assert jax.tree.structure(specs, is_leaf=_is_spec) == jax.tree.structure(state)
  # Placing the state with those specs works (every spec fits its leaf's rank and shape).
  mesh = ref.mesh()
  placed = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                              is_leaf=_is_spec))  # fmt: skip
  chex.assert_trees_all_equal(placed, state)


def test_state_partition_specs_bug3_factored_leaves_are_replicated():
  mesh = ref.mesh((4, 2), (AX, "model"))
  params = jax.device_put(SPEC_PARAMS["w"], NamedSharding(mesh, P(None, "model")))
  tx = accumulate(optax.adafactor(1e-2), 2)
  with jax.set_mesh(mesh):
    state = tx.init(params)
  specs = state_partition_specs(tx, P(None, "model"), None, params=params)
  factored = specs.inner_state[0]  # adafactor's FactoredState, a chain's first entry
  v_row, v_col, v = factored.v_row, factored.v_col, factored.v
  assert (v_row, v_col, v) == (P(), P(), P())  # (128,), (256,), and v a (1,) dummy
  assert specs.grad_sum == P(None, "model")
  placed = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                              is_leaf=_is_spec))  # fmt: skip
  chex.assert_trees_all_equal(placed, state)


@pytest.mark.parametrize("name", ["adamw_dict_mask", "multi_transform", "adafactor"])
def test_state_partition_specs_bug3_per_device_state_under_data_parallel(name):
  tx, specs = _specs_and_state(INNERS[name], AX)
  mesh = ref.mesh()
  with jax.set_mesh(mesh):
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)
    state = jax.jit(optax_accum.data_parallel(tx.init, AX), out_shardings=shardings)(SPEC_PARAMS)
  assert jax.tree.structure(specs, is_leaf=_is_spec) == jax.tree.structure(state)
  assert state.grad_sum["w"].shape == (8, *SPEC_PARAMS["w"].shape)
  assert state.acc_weight.sharding.spec == P(AX)


@pytest.mark.parametrize("name", ["adamw_dict_mask", "masked", "multi_transform", "adafactor"])
def test_train_step_bug3_axis_name_init_and_steps_with_optax_states(name):
  inner = INNERS[name]
  loss = lambda p, x: jnp.mean((x @ p["w"].T + p["b"]) ** 2) + jnp.sum(p["nested"]["v"] ** 2)
  xs = [np.random.default_rng(i).standard_normal((16, 256)).astype(np.float32) for i in range(2)]
  with jax.set_mesh(ref.mesh()):
    step = optax_accum.TrainStep(loss, inner, 2, axis_name=AX)
    params, state = SPEC_PARAMS, step.init(SPEC_PARAMS)
    for x in xs:
      params, state, _ = step(params, state, x)
  # The large batch: one plain step of the inner optimizer on the mean gradient.
  grads = jax.grad(loss)(SPEC_PARAMS, np.concatenate(xs))
  updates, _ = inner.update(grads, inner.init(SPEC_PARAMS), SPEC_PARAMS)
  chex.assert_trees_all_close(params, optax.apply_updates(SPEC_PARAMS, updates), rtol=2e-5,
                              atol=1e-6)  # fmt: skip
  assert int(state.gradient_step) == 1


# ----------------------------------------------------------------------------------------------
# Bug 4: the state knows its window.


def _sgd_windows(tx, grads, state):
  """Feeds `grads` one update each; returns the updates and the final state."""
  out, params = [], np.zeros(3, np.float32)
  update = jax.jit(tx.update)
  for g in grads:
    u, state = update(np.asarray(g, np.float32), state, params)
    out.append(np.asarray(u))
  return out, state


def test_accumulate_bug4_state_from_every_k_4_finishes_its_window_under_every_k_8():
  grads = [np.full(3, float(i + 1)) for i in range(11)]
  tx4, tx8 = accumulate(optax.sgd(1.0), 4), accumulate(optax.sgd(1.0), 8)
  _, state = _sgd_windows(tx4, grads[:2], tx4.init(np.zeros(3, np.float32)))
  assert int(state.window_k) == 4
  updates, state = _sgd_windows(tx8, grads[2:], state)
  # The window opened at 4 closes after its 4th micro-batch: the mean of grads 1..4.
  np.testing.assert_allclose(updates[1], -np.mean(grads[:4], axis=0), rtol=1e-6)
  assert not np.any(updates[0]) and not np.any(np.stack(updates[2:]))
  # The next window takes every_k=8: the 7 micro-batches since leave it open.
  assert int(state.gradient_step) == 1 and int(state.mini_step) == 7
  assert int(state.window_k) == 8


def test_train_step_bug4_state_from_every_k_4_finishes_its_window_under_every_k_8():
  loss = lambda p, x: jnp.sum(p * x)
  xs = [np.full(3, float(i + 1), np.float32) for i in range(10)]
  step4 = optax_accum.TrainStep(loss, optax.sgd(1.0), 4, donate=False)
  step8 = optax_accum.TrainStep(loss, optax.sgd(1.0), 8, donate=False)
  params = np.zeros(3, np.float32)
  state = step4.init(params)
  for x in xs[:2]:
    params, state, _ = step4(params, state, x)
  params, state, _ = step8(params, state, xs[2])
  assert int(state.gradient_step) == 0
  params, state, _ = step8(params, state, xs[3])  # the 4th micro-batch closes the window
  np.testing.assert_allclose(params, -np.mean(xs[:4], axis=0), rtol=1e-6)
  for x in xs[4:11]:  # then windows of 8: 6 more keep it open
    params, state, _ = step8(params, state, x)
  assert int(state.gradient_step) == 1 and int(state.mini_step) == 6


def test_accumulate_bug4_traced_schedule_changing_mid_window_keeps_the_opened_length():
  """A schedule closing over a traced k (4, then 3 from the window's 3rd micro-step on): the
  window opened at 4 closes after 4 micro-steps, not after 3."""

  @jax.jit
  def update(g, state, k):
    tx = accumulate(optax.sgd(1.0), lambda step: k)
    return tx.update(g, state, None)

  state = accumulate(optax.sgd(1.0), lambda step: 4).init(np.zeros(3, np.float32))
  grads = [np.full(3, float(i + 1), np.float32) for i in range(7)]
  ks = [4, 4, 3, 3, 3, 3, 3]
  applied = []
  for g, k in zip(grads, ks, strict=True):
    u, state = update(g, state, k)
    applied.append(bool(has_updated(state)))
    if applied[-1]:
      last = np.asarray(u)
  # Window 1: micro-steps 0..3 (opened at 4); window 2 opens at 3: micro-steps 4..6.
  assert applied == [False, False, False, True, False, False, True]
  np.testing.assert_allclose(last, -np.mean(grads[4:7], axis=0), rtol=1e-6)


def test_accumulate_bug4_state_with_another_accum_dtype_raises_naming_both():
  params = np.zeros(3, jnp.bfloat16)
  g = np.ones(3, jnp.bfloat16)
  narrow = accumulate(optax.sgd(1.0), 2, accum_dtype=None).init(params)  # bf16 sums
  with pytest.raises(ValueError, match=r"another accum_dtype:\n  : the state's accumulator "
                     r"bfloat16, accum_dtype=float32 makes float32"):  # fmt: skip
    accumulate(optax.sgd(1.0), 2).update(g, narrow, params)
  wide = accumulate(optax.sgd(1.0), 2).init(params)  # float32 sums
  with pytest.raises(ValueError, match=r"accumulator float32, accum_dtype=None makes bfloat16"):
    accumulate(optax.sgd(1.0), 2, accum_dtype=None).update(g, wide, params)
  step = optax_accum.TrainStep(lambda p, x: jnp.sum(p * x), optax.sgd(1.0), 2, accum_dtype=None)
  with pytest.raises(ValueError, match=r"another accum_dtype"):
    step(params, wide, g)


# ----------------------------------------------------------------------------------------------
# Disagreements.


def test_train_step_inside_jit_raises_that_it_is_a_host_side_driver():
  step = optax_accum.TrainStep(lambda p, x: jnp.sum(p * x), optax.sgd(1.0), 2)
  params = np.zeros(3, np.float32)
  state = step.init(params)
  with pytest.raises(TypeError, match=r"(?s)host-side driver.*optax_accum.accumulate"):
    jax.jit(lambda p, s, x: step(p, s, x))(params, state, np.ones(3, np.float32))


@pytest.mark.parametrize("bad", [-1, -1.0, np.nan])
def test_train_step_weight_fn_host_bad_weight_names_weight_fn(bad):
  step = optax_accum.TrainStep(
    lambda p, x: jnp.sum(p * x), optax.sgd(1.0), 2, weight_fn=lambda x: bad
  )
  params = np.zeros(3, np.float32)
  with pytest.raises(ValueError, match=r"^TrainStep: weight_fn\(\*args\) must be non-negative"):
    step(params, step.init(params), np.ones(3, np.float32))


def test_accumulate_every_k_1_emit_false_raises_instead_of_applying():
  tx = accumulate(optax.sgd(1.0), 1)
  params = np.zeros(3, np.float32)
  with pytest.raises(ValueError, match=r"emit=False with every_k=1: every call is the last"):
    tx.update(np.ones(3, np.float32), tx.init(params), params, emit=False)
  # k >= 2 accepts it: the micro-batch waits in the accumulator, nothing is applied.
  tx2 = accumulate(optax.sgd(1.0), 2)
  u, state = tx2.update(np.ones(3, np.float32), tx2.init(params), params, emit=False)
  assert not np.any(u) and not bool(has_updated(state))


# (grads, weight) per call: plain, weighted, zero weight, a traced negative weight, NaN.
_K1_CALLS = [
  (np.array([1.0, 2.0, 3.0]), None),
  (np.array([4.0, -1.0, 0.5]), 3.0),
  (np.array([2.0, 2.0, 2.0]), 0.0),
  (np.array([5.0, 5.0, 5.0]), "traced-1"),
  (np.array([np.nan, 1.0, 1.0]), 2.0),
  (np.array([-3.0, 1.0, 7.0]), 0.25),
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_accumulate_every_k_1_is_every_k_2_closing_every_window(reduction, dtype):
  """k=1 is the general contract: what k=2 gives with every window closed after one micro-batch
  (force_emit=True) — same updates (shapes, dtypes, values), drops, counts and flags."""
  params = np.zeros(3, dtype)
  runs = {}
  for k in (1, 2):
    tx = accumulate(optax.adam(0.1), k, reduction=reduction)
    update = jax.jit(tx.update)
    state, out = tx.init(params), []
    for g, w in _K1_CALLS:
      w = jnp.asarray(-1.0) if w == "traced-1" else w
      u, state = update(np.asarray(g, dtype), state, params, weight=w, force_emit=True)
      out.append((u, has_updated(state), state.num_skipped, state.gradient_step))
    runs[k] = (out, state.inner_state)
  chex.assert_trees_all_equal_shapes_and_dtypes(runs[1], runs[2])
  # mean: k=2 multiplies by w and by 1/w in float32 (an ulp); bf16 rounds both to the same.
  chex.assert_trees_all_close(runs[1], runs[2], rtol=1e-6, atol=0)
  assert [bool(a) for _, a, _, _ in runs[1][0]] == [True, True, False, False, False, True]
  assert int(runs[1][0][-1][2]) == 2  # the negative weight and the NaN gradient


def test_accumulate_axis_name_unbound_error_names_the_alternatives():
  tx = accumulate(optax.sgd(1.0), 2, axis_name=AX)
  with pytest.raises(ValueError, match=r"(?s)accumulate.init: axis_name='data' is not bound.*"
                     r"shard_map.*data_parallel.*TrainStep\(.*axis_name='data'\)"):  # fmt: skip
    tx.init(np.zeros(3, np.float32))


def test_accum_dtype_none_means_the_parameters_dtypes_in_accumulate_and_train_step():
  params = {"a": np.zeros(3, jnp.bfloat16), "b": np.zeros(3, np.float32)}
  tx = accumulate(optax.sgd(1.0), 2, accum_dtype=None)
  step = optax_accum.TrainStep(lambda p, x: x * p["a"].sum() + p["b"].sum(), optax.sgd(1.0), 2,
                               accum_dtype=None)  # fmt: skip
  for state in (tx.init(params), step.init(params)):
    chex.assert_trees_all_equal_dtypes(state.grad_sum, params)
  # A wider gradient than its accumulator raises in both, rather than being narrowed.
  wide = {"a": np.ones(3, np.float32), "b": np.ones(3, np.float32)}
  with pytest.raises(TypeError, match=r"(?s)accum_dtype=None .*\['a'\]: gradient float32, "
                     r"accumulator bfloat16"):  # fmt: skip
    tx.update(wide, tx.init(params), params)


def test_reduction_sum_is_the_weighted_sum_in_accumulate_and_train_step():
  xs = [np.array([1.0, 2.0], np.float32), np.array([3.0, -1.0], np.float32)]
  weights = [2.0, 0.5]
  want = -sum(w * x for w, x in zip(weights, xs, strict=True))  # Σ wᵢ gᵢ, sgd(1.0)
  tx = accumulate(optax.sgd(1.0), 2, reduction="sum")
  params, state = np.zeros(2, np.float32), tx.init(np.zeros(2, np.float32))
  for x, w in zip(xs, weights, strict=True):
    u, state = tx.update(x, state, params, weight=w)
  np.testing.assert_allclose(u, want, rtol=1e-6)
  step = optax_accum.TrainStep(lambda p, x: jnp.sum(p * x), optax.sgd(1.0), 2, reduction="sum")
  params, state = np.zeros(2, np.float32), step.init(np.zeros(2, np.float32))
  for x, w in zip(xs, weights, strict=True):
    params, state, _ = step(params, state, x, weight=w)
  np.testing.assert_allclose(params, want, rtol=1e-6)
