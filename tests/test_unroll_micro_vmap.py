"""Issue 34, items 18 and 19: `microbatch(..., unroll=)`, and the counterparts of optax's
`micro_vmap` and `micro_grad`.

Item 18: a conv net inside `microbatch`'s loop runs several times slower on CPU than the same
micro-batches unrolled (XLA:CPU's convolution weight gradient inside a loop body;
`benchmarks/small_models.py` measures it). `unroll=` unrolls the loop as `lax.scan` does; its
results are those of the rolled loop (float32 rounding) and of the large batch.

Item 19: optax's `micro_vmap` is ``microbatch(jax.vmap(f), reduction="concat")`` and its
`micro_grad` a vmap of the per-example gradient with ``reduction=("sum", "concat")``; the
migration guide gives both recipes, and these tests check them against optax's own functions.
"""

import _reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from optax.microbatching import AccumulationType

from optax_accum import microbatch
from optax_accum.core import _hlo

K, B = 4, 16
DIMS = ("NHWC", "HWIO", "NHWC")


# ----------------------------------------------------------------------------------------------
# A small conv net (the shape of the case that motivated `unroll`) and the MLP of the suite.


def _conv_params(seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return {
    "conv": jax.random.normal(k1, (3, 3, 1, 4)) * 0.3,
    "dense": jax.random.normal(k2, (4 * 4 * 4, 10)) * 0.1,
    "bias": jax.random.normal(k3, (10,)) * 0.1,
  }


def _conv_loss(params, batch):
  x, y = batch
  h = lax.conv_general_dilated(x, params["conv"], (1, 1), "SAME", dimension_numbers=DIMS)
  h = lax.reduce_window(jax.nn.relu(h), 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
  logits = h.reshape(h.shape[0], -1) @ params["dense"] + params["bias"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _conv_data(seed=1, n=B):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (n, 8, 8, 1)), jax.random.randint(ky, (n,), 0, 10)


CASES = {
  "conv": (_conv_loss, _conv_params(), _conv_data()),
  "mlp": (ref.mlp_loss, ref.mlp_params(0), ref.regression_data(0, B)),
}


def _assert_close(got, want, **tol):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), **tol)


# ----------------------------------------------------------------------------------------------
# Item 18: unroll=.


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("unroll", [3, True])  # 3: a partial unroll, k not a multiple
def test_item18_unroll_matches_rolled_loop_and_large_batch(case, unroll):
  loss, params, data = CASES[case]
  vg = jax.value_and_grad(loss)
  rolled = jax.jit(microbatch(vg, K))(params, data)
  unrolled = jax.jit(microbatch(vg, K, unroll=unroll))(params, data)
  # The same micro-batches summed in the same order: equal but for XLA fusing the unrolled
  # body differently (float32 rounding of a few ulps).
  _assert_close(unrolled, rolled, rtol=2e-6, atol=1e-7)
  # And both are the large batch (a sum of 4 means against one mean: a few more ulps).
  _assert_close(unrolled, jax.jit(vg)(params, data), rtol=1e-5, atol=1e-6)


def test_item18_unroll_true_leaves_no_loop_and_default_keeps_one():
  loss, params, data = CASES["conv"]
  vg = jax.value_and_grad(loss)

  def whiles(**kw):
    text = jax.jit(microbatch(vg, K, **kw)).lower(params, data).compile().as_text()
    return _hlo.hlo_stats(text).whiles

  assert whiles() == 1  # the default: one rolled loop, flat in k
  assert whiles(unroll=True) == 0  # every micro-batch inline: no loop left
  assert whiles(unroll=K) == 0
  assert whiles(unroll=2) == 1  # a partial unroll still loops (2 micro-batches per iteration)


def test_item18_unroll_with_every_reduction_and_python_int_count():
  loss, params, data = CASES["mlp"]

  def fun(p, batch):
    value, grad = jax.value_and_grad(loss)(p, batch)
    rows = batch["x"][:, 0]  # one row per example
    return value, grad, rows, value, value

  red = ("mean", "sum", "concat", "stack", "last")
  for n in (None, 3):
    rolled = microbatch(fun, K, reduction=red, split="strided", num_real_microbatches=n)(
      params, data
    )
    unrolled = microbatch(
      fun, K, reduction=red, split="strided", num_real_microbatches=n, unroll=True
    )(params, data)
    _assert_close(unrolled, rolled, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize(
  "bad, error, match",
  [
    (0, ValueError, r"unroll must be a positive int or True, got 0"),
    (-2, ValueError, r"unroll must be a positive int or True, got -2"),
    (1.5, TypeError, r"unroll must be a positive int .* got 1.5 of type float"),
    ("all", TypeError, r"unroll must be a positive int .* got 'all' of type str"),
    (None, TypeError, r"unroll must be a positive int .* got None of type NoneType"),
  ],
)
def test_item18_unroll_bad_values_refused_at_construction(bad, error, match):
  with pytest.raises(error, match=match):
    microbatch(jax.value_and_grad(ref.mlp_loss), K, unroll=bad)


@pytest.mark.parametrize("unroll", [2, True])
def test_item18_unroll_with_traced_count_refused(unroll):
  loss, params, data = CASES["mlp"]
  step = jax.jit(
    lambda p, d, n: microbatch(
      jax.value_and_grad(loss), K, split="strided", num_real_microbatches=n, unroll=unroll
    )(p, d)
  )
  with pytest.raises(ValueError, match=r"unroll=.* needs a trip count known when tracing"):
    step(params, data, 2)
  # unroll=1 (the default) with the traced count still runs, and unroll with a host count.
  n = 2
  rolled = microbatch(
    jax.value_and_grad(loss), K, split="strided", num_real_microbatches=jnp.int32(n)
  )
  host = microbatch(
    jax.value_and_grad(loss), K, split="strided", num_real_microbatches=n, unroll=unroll
  )
  _assert_close(host(params, data), jax.jit(rolled)(params, data), rtol=2e-6, atol=1e-7)


def test_item18_unroll_false_is_one():
  loss, params, data = CASES["mlp"]
  vg = jax.value_and_grad(loss)
  text = jax.jit(microbatch(vg, K, unroll=False)).lower(params, data).compile().as_text()
  assert _hlo.hlo_stats(text).whiles == 1


# ----------------------------------------------------------------------------------------------
# Item 19: optax's micro_vmap and micro_grad, as the migration guide writes them.


def test_item19_micro_vmap_recipe_matches_optax():
  def f(w, x):  # one example in, a row and a scalar out
    return jnp.tanh(x @ w), jnp.sum(x**2)

  w = jax.random.normal(jax.random.key(0), (3, 2))
  x = jax.random.normal(jax.random.key(1), (12, 3))
  theirs = optax.microbatching.micro_vmap(f, in_axes=(None, 0), microbatch_size=4)(w, x)
  # The recipe: vmap the per-example function, and concatenate its rows.
  ours = microbatch(
    jax.vmap(f, in_axes=(None, 0)), microbatch_size=4, batch_argnums=1, reduction="concat"
  )(w, x)
  _assert_close(ours, theirs, rtol=0, atol=0)  # the same rows computed the same way
  _assert_close(ours, jax.vmap(f, in_axes=(None, 0))(w, x), rtol=1e-6, atol=1e-7)
  # micro_vmap with a reduction: accumulator=SUM sums over the examples.
  theirs_sum = optax.microbatching.micro_vmap(
    f, in_axes=(None, 0), microbatch_size=4, accumulator=AccumulationType.SUM
  )(w, x)
  ours_sum = microbatch(
    lambda w, x: jax.tree.map(lambda v: v.sum(0), jax.vmap(f, in_axes=(None, 0))(w, x)),
    microbatch_size=4,
    batch_argnums=1,
    reduction="sum",
  )(w, x)
  _assert_close(ours_sum, theirs_sum, rtol=1e-6, atol=1e-6)


def _clip(grad, c=0.5):
  norm = optax.tree.norm(grad)
  return jax.tree.map(lambda g: g * jnp.minimum(1.0, c / norm), grad)


def test_item19_micro_grad_recipe_matches_optax():
  params = ref.mlp_params(0)
  data = ref.regression_data(1, B)
  theirs_g, theirs_aux = optax.microbatching.micro_grad(
    ref.mlp_loss,
    batch_argnums=1,
    microbatch_size=4,
    transform_fn=_clip,
    metrics_fn=optax.tree.norm,
  )(params, data)

  # The recipe: per-example gradients (each example a batch of one, as keep_batch_dim=True),
  # transformed and summed in each micro-batch, the per-example values and metrics as rows.
  def per_example(params, example):
    one = jax.tree.map(lambda v: v[None], example)
    value, grad = jax.value_and_grad(ref.mlp_loss)(params, one)
    return _clip(grad), (value, optax.tree.norm(grad))

  def summed(params, batch):
    grads, rows = jax.vmap(per_example, in_axes=(None, 0))(params, batch)
    return jax.tree.map(lambda g: g.sum(0), grads), rows

  grads, (values, metrics) = microbatch(summed, microbatch_size=4, reduction=("sum", "concat"))(
    params, data
  )
  _assert_close(grads, theirs_g, rtol=1e-6, atol=1e-6)
  _assert_close((values, metrics), (theirs_aux.values, theirs_aux.metrics), rtol=1e-6, atol=0)
  # Independent reference: the clipped per-example gradients summed directly, in float64.
  with jax.enable_x64(True):
    p64 = jax.tree.map(lambda v: jnp.asarray(v, jnp.float64), params)
    d64 = jax.tree.map(lambda v: jnp.asarray(v, jnp.float64), data)
    g64, (v64, _) = jax.vmap(per_example, in_axes=(None, 0))(p64, d64)
    want = jax.tree.map(lambda g: np.asarray(g.sum(0)), g64)
    v64 = np.asarray(v64)
  _assert_close(grads, want, rtol=1e-5, atol=1e-6)
  _assert_close(values, v64, rtol=1e-5, atol=1e-7)
