"""Unit tests of the accumulation core (`optax_accum.core._core`), against numpy float64 arithmetic.

The front ends (`accumulate`, `microbatch`) are tested against the large batch elsewhere; here
each core function is pinned down on its own: weighted sums, the finite check that drops a
micro-batch, the guarded normalisation, the cast back to the micro-batch dtypes, and what a
float32 accumulator buys over a bfloat16 one.
"""

from __future__ import annotations

import math

import _reference as ref
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from optax_accum.core import _checks, _core
from optax_accum.parallel import _collectives

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def tree_of(seed):
  """A small gradient-like tree (the kit's parameters) with a None leaf and an empty subtree."""
  return {**ref.mlp_params(seed, (3, 4)), "none": None, "empty": {}}


def float64(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


# ----------------------------------------------------------------------------------------------
# zeros / accum_dtype_for


def test_zeros_dtypes_shapes_and_structure():
  tree = {
    "f32": jnp.ones((2, 3), F32),
    "bf16": jnp.ones(4, BF16),
    "i8": jnp.ones(2, jnp.int8),
    "bool": jnp.ones(1, jnp.bool_),
    "spec": jax.ShapeDtypeStruct((5,), F16),
    "none": None,
    "empty": {},
  }
  acc = _core.zeros(tree, F32)
  assert jax.tree.structure(acc) == jax.tree.structure(tree)
  assert {k: (v.shape, v.dtype) for k, v in acc.items() if v is not None and k != "empty"} == {
    "f32": ((2, 3), F32),
    "bf16": ((4,), F32),  # floating leaves: the accumulator dtype
    "i8": ((2,), jnp.int32),  # counts: exact, widened to int32
    "bool": ((1,), jnp.int32),
    "spec": ((5,), F32),
  }
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(acc))
  own = _core.zeros(tree, None)  # None: the leaves' own floating dtypes
  assert (own["f32"].dtype, own["bf16"].dtype, own["spec"].dtype) == (F32, BF16, F16)


# ----------------------------------------------------------------------------------------------
# all_finite


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("leaf", ["w0", "b0"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_all_finite_detects_any_bad_element(bad, leaf, dtype):
  tree = jax.tree.map(lambda x: x.astype(dtype), tree_of(0))
  assert bool(_core.all_finite(tree))
  tree[leaf] = tree[leaf].copy()
  tree[leaf].reshape(-1)[-1] = bad
  assert not bool(jax.jit(_core.all_finite)(tree))
  assert not bool(_core.all_finite(tree))


def test_all_finite_ignores_integer_leaves_and_empty_trees():
  assert bool(_core.all_finite({"count": np.array([1, 2], np.int32), "none": None}))
  assert bool(_core.all_finite({}))
  assert bool(_core.all_finite(None))


# ----------------------------------------------------------------------------------------------
# add


def accumulate_all(trees, weights, *, accum_dtype=F32, skip_nonfinite=True):
  """Runs `_core.add` over the micro-batches in one jitted lax.scan; returns (sums, total, n)."""
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *trees)
  weights = None if weights is None else np.asarray(weights, np.float32)

  @jax.jit
  def run(stacked, weights):
    sums = _core.zeros(jax.tree.map(lambda x: x[0], stacked), accum_dtype)

    def body(carry, xs):
      sums, total, dropped = carry
      tree, w = xs
      sums, total, d = _core.add(sums, total, tree, w, skip_nonfinite=skip_nonfinite)
      return (sums, total, dropped + d.astype(jnp.int32)), None

    init = (sums, jnp.zeros((), F32), jnp.zeros((), jnp.int32))
    return lax.scan(body, init, (stacked, weights))[0]

  return run(stacked, weights)


def test_add_weighted_sums_match_float64():
  trees = [tree_of(seed) for seed in range(5)]
  weights = [1.0, 3.0, 0.5, 0.0, 7.0]
  sums, total, dropped = accumulate_all(trees, weights)
  want = jax.tree.map(
    lambda *xs: sum(w * x for w, x in zip(weights, xs, strict=True)), *float64(trees)
  )
  chex.assert_trees_all_close(sums, want, **ref.TOL)
  assert float(total) == sum(weights)
  assert int(dropped) == 0


def test_add_without_weight_counts_one_each():
  trees = [tree_of(seed) for seed in range(3)]
  sums, total, _ = accumulate_all(trees, None)
  want, _, _ = accumulate_all(trees, [1.0, 1.0, 1.0])
  chex.assert_trees_all_equal(sums, want, strict=True)  # None is exactly weight 1
  assert float(total) == 3.0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_add_drops_nonfinite_microbatch(bad):
  trees = [tree_of(seed) for seed in range(3)]
  trees[1]["b0"][0] = bad
  weights = [1.0, 5.0, 2.0]
  sums, total, dropped = accumulate_all(trees, weights)
  # Neither the gradient nor the weight of the bad micro-batch enters the sums (a select, not
  # a multiplication by zero: 0 * nan would be nan).
  want, want_total, _ = accumulate_all([trees[0], trees[2]], [1.0, 2.0])
  chex.assert_trees_all_equal(sums, want, strict=True)
  assert float(total) == float(want_total) == 3.0
  assert int(dropped) == 1
  # Without the check the bad value poisons the sums, and nothing is counted as dropped.
  sums, total, dropped = accumulate_all(trees, weights, skip_nonfinite=False)
  assert not np.all(np.isfinite(np.asarray(sums["b0"])))
  assert int(dropped) == 0 and float(total) == 8.0


def test_add_restart_starts_from_zero():
  old, new = tree_of(4), tree_of(5)
  sums = _core.zeros(old, F32)
  sums, total, _ = _core.add(sums, jnp.zeros((), F32), old, 2.0, skip_nonfinite=True)
  for restart, factor in ((True, 0.0), (False, 1.0)):
    got, got_total, _ = _core.add(
      sums, total, new, 3.0, skip_nonfinite=True, restart=jnp.asarray(restart)
    )
    want = jax.tree.map(lambda o, n, f=factor: f * 2.0 * o + 3.0 * n, *float64((old, new)))
    chex.assert_trees_all_close(got, want, **ref.TOL)
    assert float(got_total) == factor * 2.0 + 3.0


# ----------------------------------------------------------------------------------------------
# normalise


def test_normalise_mean_sum_and_cast_back():
  rng = np.random.default_rng(5)
  like = {"w": rng.standard_normal((2, 2)).astype(BF16), "b": np.zeros(3, F16), "n": None}
  sums = {"w": np.full((2, 2), 6.0, np.float32), "b": np.full(3, 3.0, np.float32), "n": None}
  total = jnp.asarray(4.0, F32)
  mean = _core.normalise(sums, total, like, "mean")
  assert (mean["w"].dtype, mean["b"].dtype, mean["n"]) == (BF16, F16, None)
  np.testing.assert_array_equal(np.asarray(mean["w"], np.float32), 1.5)
  np.testing.assert_array_equal(np.asarray(mean["b"], np.float32), 0.75)
  summed = _core.normalise(sums, total, like, "sum")
  assert (summed["w"].dtype, summed["b"].dtype) == (BF16, F16)
  np.testing.assert_array_equal(np.asarray(summed["w"], np.float32), 6.0)


def test_normalise_zero_total_gives_zeros_not_nan():
  like = {"w": np.ones(3, np.float32)}
  sums = {"w": np.zeros(3, np.float32)}
  out = jax.jit(lambda s, t: _core.normalise(s, t, like, "mean"))(sums, np.float32(0.0))
  np.testing.assert_array_equal(np.asarray(out["w"]), 0.0)


def test_normalise_integer_mean_stays_float():
  out = _core.normalise({"c": np.array([3, 4], np.int32)}, jnp.asarray(2.0), {"c": 0}, "mean")
  assert jnp.issubdtype(out["c"].dtype, jnp.floating)
  np.testing.assert_array_equal(np.asarray(out["c"]), [1.5, 2.0])


# ----------------------------------------------------------------------------------------------
# The weighted mean on values no dtype holds exactly, and the slips it must catch.
#
# Each check runs on the core and, in `test_core_mutation_controls`, on mutants of it: a slip
# that a check lets through shows up there as a mutant that passes.

# Weights below 1 (fractional token weights): their total, 0.65, is below 1 too; 0.1 and 0.3
# are not binary fractions. Values: standard normal float32 (no bfloat16 or float16 holds them).
FRACTIONAL = [0.1, 0.25, 0.3]


def check_weighted_mean(add=_core.add, normalise=_core.normalise):
  """Σ wᵢ xᵢ / Σ wᵢ of float32 values against float64, in one jitted scan of `add`, then
  `normalise`. float32 rounds each of the 3 products, 2 sums and the scaled mean once: a few
  ulp (1.2e-7 relative) of values O(1)."""
  trees = [ref.mlp_params(seed, (3, 4)) for seed in range(len(FRACTIONAL))]
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *trees)

  @jax.jit
  def run(stacked, weights):
    def body(carry, xs):
      sums, total, _ = add(*carry, *xs, skip_nonfinite=True)
      return (sums, total), None

    sums = _core.zeros(trees[0], F32)
    (sums, total), _ = lax.scan(body, (sums, jnp.zeros((), F32)), (stacked, weights))
    return normalise(sums, total, trees[0], "mean")

  got = run(stacked, np.asarray(FRACTIONAL, np.float32))
  w = np.asarray(FRACTIONAL, np.float32).astype(np.float64)  # the weights the core is given
  want = jax.tree.map(lambda *xs: sum(wi * x for wi, x in zip(w, xs, strict=True)) / w.sum(),
                      *float64(trees))  # fmt: skip
  chex.assert_trees_all_close(got, want, rtol=5e-7, atol=3e-7)


def test_weighted_mean_of_inexact_values_with_weights_below_one():
  check_weighted_mean()


def check_dropped_is_selected(add=_core.add):
  """A dropped micro-batch (a NaN in it) and one of weight 0 leave the sums exactly as the others
  make them (selected away: ``0 * nan`` is nan)."""
  good, bad = tree_of(1), tree_of(2)
  bad["b0"][1] = math.nan
  sums = _core.zeros(good, F32)
  for skip in (True, False):
    got, total, _ = add(sums, jnp.zeros((), F32), good, 0.5, skip_nonfinite=skip)
    got, total, _ = add(got, total, bad, 0.0 if not skip else 2.0, skip_nonfinite=skip)
    want, _, _ = add(sums, jnp.zeros((), F32), good, 0.5, skip_nonfinite=skip)
    chex.assert_trees_all_equal(got, want)
    assert float(total) == 0.5


def test_dropped_and_zero_weight_micro_batches_add_exact_zeros():
  check_dropped_is_selected()


def _mean_guarded_by_one(sums, total, like, reduction):
  """The slip of issue 42: ``maximum(total, 1)`` for the ``total > 0`` guard, right for integer
  counts, a wrong mean for any window whose weight is below 1."""
  return _core.normalise(sums, jnp.maximum(total, 1.0), like, reduction)


def _mean_of_means(sums, total, like, reduction):
  """Levanter's slip: the mean over micro-batches (their count, here 3) instead of their
  weight."""
  del total
  return _core.normalise(sums, jnp.float32(len(FRACTIONAL)), like, reduction)


def _add_multiplying(sums, total, tree, weight, **kw):
  """A drop by multiplying by 0 instead of selecting (``0 * nan`` is nan)."""
  w = jnp.asarray(1.0 if weight is None else weight, F32)
  keep = _core.all_finite(tree) if kw["skip_nonfinite"] else jnp.asarray(True)
  w = w * keep
  sums = jax.tree.map(lambda s, x: s + w * x, sums, tree)
  return sums, total + w, jnp.logical_not(keep)


def _add_in_bfloat16(sums, total, tree, weight, **kw):
  """Each product rounded to bfloat16 before the add: exact for the bfloat16 values the older
  tests used, off for float32 values."""
  tree = jax.tree.map(lambda x: (x * weight).astype(BF16).astype(F32) / weight, tree)
  return _core.add(sums, total, tree, weight, **kw)


@pytest.mark.parametrize(
  "check, mutant",
  [
    (lambda: check_weighted_mean(normalise=_mean_guarded_by_one), "maximum(total, 1)"),
    (lambda: check_weighted_mean(normalise=_mean_of_means), "mean of means"),
    (lambda: check_weighted_mean(add=_add_in_bfloat16), "bfloat16 products"),
    (lambda: check_dropped_is_selected(add=_add_multiplying), "0 * nan"),
  ],
  ids=lambda v: v if isinstance(v, str) else "",
)
def test_core_mutation_controls(check, mutant):
  # Each mutant must fail the check that guards against it.
  with pytest.raises(AssertionError):
    check()


# ----------------------------------------------------------------------------------------------
# bf16 gradients into an fp32 accumulator


def test_bf16_gradients_fp32_accumulator_error():
  # 64 bf16 micro-batch gradients of similar size (the usual case: many small contributions to
  # a large sum). The reference is the float64 mean of the very same bf16 values, so any error
  # comes from the accumulation alone.
  k = 64
  rng = np.random.default_rng(6)
  grads = [{"g": (1.0 + 0.1 * rng.standard_normal(256)).astype(BF16)} for _ in range(k)]
  want = np.mean([np.asarray(g["g"], np.float64) for g in grads], axis=0)

  def mean_error(accum_dtype):
    sums, total, _ = accumulate_all(grads, None, accum_dtype=accum_dtype)
    assert sums["g"].dtype == accum_dtype
    mean = _core.normalise(sums, total, grads[0], "mean")
    assert mean["g"].dtype == BF16  # cast back to the gradients' dtype
    raw = np.asarray(sums["g"], np.float64) / k  # before the final cast
    return np.max(np.abs(raw - want) / np.abs(want)), np.asarray(mean["g"], np.float64)

  err32, mean32 = mean_error(F32)
  err16, _ = mean_error(BF16)
  # fp32: bf16 values (8-bit mantissas) of similar size add up exactly in a 24-bit mantissa,
  # up to rounding at most a few ulps of 2**-24. bf16: a running sum near 64 has a bf16 spacing
  # of 0.25, so each add rounds away up to 0.125: errors of percent size.
  assert err32 < 1e-6
  assert err16 > 1e-3
  assert err16 > 100 * err32
  # After the cast back to bf16 the fp32-accumulated mean is the correctly rounded one: within
  # half a bf16 ulp (2**-9 relative) of the exact mean.
  assert np.max(np.abs(mean32 - want) / np.abs(want)) <= 2**-8


# ----------------------------------------------------------------------------------------------
# check_weight, axes


def test_check_weight_accepts_scalars_and_traced():
  assert _checks.weight(None, "f") is None
  assert float(_checks.weight(3, "f")) == 3.0
  assert float(_checks.weight(np.float32(0.0), "f")) == 0.0
  traced = jax.jit(lambda w: _checks.weight(w, "f") * 2)(np.float32(1.5))
  assert float(traced) == 3.0


@pytest.mark.parametrize(
  "weight, error, match",
  [
    (-2, ValueError, r"f: weight must be non-negative and finite, got -2\.0"),
    (math.inf, ValueError, "f: weight must be non-negative and finite, got inf"),
    (np.ones((2, 1)), ValueError, r"f: weight must be a scalar .*shape \(2, 1\).*pass its sum"),
    ("x", TypeError, "f: weight must be .*got 'x'"),
    (1 + 2j, TypeError, "f: weight must be a real number, got dtype complex"),
  ],
)
def test_check_weight_rejects(weight, error, match):
  with pytest.raises(error, match=match):
    _checks.weight(weight, "f")


def test_axis_helpers_without_axis_are_identities():
  tree = {"a": np.ones(2, np.float32)}
  axis = _collectives.resolve(None)
  axis.check_bound("f")
  assert axis.reduce(tree) is tree
  assert axis.reduce_window(tree, 1.0, tree, "mean") == (tree, 1.0)
  assert axis.to_varying(tree) is tree


def test_check_axis_unbound_names_the_axis():
  with pytest.raises(ValueError, match=r"f: axis_name='batch' is not bound here"):
    _collectives.resolve("batch").check_bound("f")
