"""`microbatch`'s batch arguments: by keyword, along any axis, sized by `microbatch_size`.

Each result is compared with a direct computation on the whole batch (or with the positional,
axis-0 form computed the same way, where the claim is that two spellings agree exactly).
"""

import _reference as ref
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_accum import microbatch

TOL = ref.TOL


def _data(batch=24, seed=0):
  """The kit's parameters and regression data, as ``(params, x, y)``."""
  data = ref.regression_data(seed, batch)
  return ref.mlp_params(0), data["x"], data["y"]


def _loss(params, x, y, mask=None):
  """The kit's loss, with the batch's parts as separate arguments."""
  batch = {"x": x, "y": y} if mask is None else {"x": x, "y": y, "mask": mask}
  return ref.mlp_loss(params, batch)


def _loss_kw(params, *, x, y):
  return _loss(params, x, y)


_VG = jax.jit(jax.value_and_grad(_loss))  # the reference on the whole batch, compiled once


# ----------------------------------------------------------------------------------------------
# Keyword batch arguments.


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_keyword_batch_matches_large_batch_and_positional_form(split, jit):
  w, x, y = _data()
  want = _VG(w, x, y)
  positional = microbatch(jax.value_and_grad(_loss), 4, batch_argnums=(1, 2), split=split)
  only_kw = microbatch(jax.value_and_grad(_loss_kw), 4, batch_argnames=("x", "y"), split=split)
  mixed = microbatch(jax.value_and_grad(_loss), 4, batch_argnums=1, batch_argnames="y", split=split)
  maybe_jit = jax.jit if jit else (lambda f: f)
  got_pos = maybe_jit(positional)(w, x, y)
  chex.assert_trees_all_close(got_pos, want, **TOL)
  # The same micro-batches in the same order: the same floating-point operations.
  chex.assert_trees_all_equal(maybe_jit(only_kw)(w, x=x, y=y), got_pos)
  chex.assert_trees_all_equal(maybe_jit(only_kw)(w, y=y, x=x), got_pos)
  chex.assert_trees_all_equal(maybe_jit(mixed)(w, x, y=y), got_pos)


def test_microbatch_keyword_batch_with_weights_and_non_batch_keywords():
  w, x, y = _data()
  mask = (np.arange(24) % 5 != 0).astype(np.float32)

  def loss(w, *, x, y, mask, scale):
    return _loss(w, x * scale, y, mask)

  want = jax.value_and_grad(loss)(w, x=x, y=y, mask=mask, scale=3.0)
  step = microbatch(
    jax.value_and_grad(loss),
    4,
    batch_argnames=("x", "y", "mask"),
    weight_fn=lambda w, *, x, y, mask, scale: jnp.sum(mask),
  )
  got = jax.jit(step)(w, x=x, y=y, mask=mask, scale=3.0)  # `scale` goes to every micro-batch
  chex.assert_trees_all_close(got, want, **TOL)


# ----------------------------------------------------------------------------------------------
# Batch axes.


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_batch_axis_1_equals_axis_0_on_transposed_data(split):
  w, x, y = _data()

  def loss_t(w, xt, y):  # sequence-major style: the batch is axis 1 of xt
    return _loss(w, xt.T, y)

  want = _VG(w, x, y)
  axis0 = jax.jit(microbatch(jax.value_and_grad(_loss), 4, batch_argnums=(1, 2), split=split))
  axis1 = jax.jit(
    microbatch(jax.value_and_grad(loss_t), 4, batch_argnums=(1, 2), batch_axes=(1, 0), split=split)
  )
  got0, got1 = axis0(w, x, y), axis1(w, x.T, y)
  chex.assert_trees_all_close(got1, want, **TOL)
  chex.assert_trees_all_close(got1, got0, **TOL)
  # Negative axes count from the end, per leaf.
  neg = microbatch(
    jax.value_and_grad(loss_t), 4, batch_argnums=(1, 2), batch_axes=(-1, -2), split=split
  )
  chex.assert_trees_all_equal(jax.jit(neg)(w, x.T, y), got1)


def test_microbatch_batch_axes_follow_argnums_then_argnames_order():
  # The two arguments of a contraction, one batch-major and one batch-minor, in every spelling.
  rng = np.random.default_rng(1)
  a = jnp.asarray(rng.normal(size=(12, 4, 5)), jnp.float32)
  b = jnp.transpose(a, (1, 0, 2))

  def fun(a, b):
    return jnp.einsum("bij,kbj->ik", a, b)

  want = fun(a, b)
  spellings = [
    dict(batch_argnums=(0, 1), batch_axes=(0, 1)),
    dict(batch_argnums=(1, 0), batch_axes=(1, 0)),
    dict(batch_argnums=0, batch_argnames="b", batch_axes=(0, 1)),
  ]
  for kw in spellings:
    f = microbatch(fun, 3, reduction="sum", **kw)
    got = f(a, b=b) if "batch_argnames" in kw else f(a, b)
    chex.assert_trees_all_close(got, want, **TOL)
  for names, axes in ((("a", "b"), (0, 1)), (("b", "a"), (1, 0))):
    f = microbatch(fun, 3, reduction="sum", batch_argnames=names, batch_axes=axes)
    chex.assert_trees_all_close(f(a=a, b=b), want, **TOL)
    chex.assert_trees_all_close(f(b=b, a=a), want, **TOL)


def test_microbatch_batch_axis_keeps_its_place_in_each_microbatch():
  seen = []

  def fun(x):
    seen.append(x.shape)
    return jnp.sum(x, axis=(0, 2))  # per example: (b,)

  x = jnp.arange(7 * 8 * 3, dtype=jnp.float32).reshape(7, 8, 3)
  got = microbatch(fun, 4, batch_argnums=0, batch_axes=1, reduction="concat")(x)
  assert seen[-1] == (7, 2, 3)
  chex.assert_trees_all_equal(got, jnp.sum(x, axis=(0, 2)))  # original example order


# ----------------------------------------------------------------------------------------------
# microbatch_size.


@pytest.mark.parametrize("size, k", [(6, 4), (24, 1), (1, 24)])
def test_microbatch_size_is_batch_over_k(size, k):
  w, x, y = _data()
  by_size = jax.jit(
    microbatch(jax.value_and_grad(_loss), microbatch_size=size, batch_argnums=(1, 2))
  )
  by_k = jax.jit(microbatch(jax.value_and_grad(_loss), k, batch_argnums=(1, 2)))
  got = by_size(w, x, y)
  chex.assert_trees_all_close(got, _VG(w, x, y), **TOL)
  chex.assert_trees_all_equal(got, by_k(w, x, y))


def test_microbatch_size_same_function_serves_several_batch_sizes():
  w, x, y = _data(batch=24)
  step = microbatch(jax.value_and_grad(_loss), microbatch_size=4, batch_argnums=(1, 2))
  for n in (8, 24):  # k = 2, then 6
    chex.assert_trees_all_close(step(w, x[:n], y[:n]), _VG(w, x[:n], y[:n]), **TOL)


# ----------------------------------------------------------------------------------------------
# The same results as optax.microbatching.microbatch, spelled our way.


def test_microbatch_agrees_with_optax_microbatching():
  rng = np.random.default_rng(2)
  c = jnp.asarray(rng.normal(size=()), jnp.float32)
  a, b = (jnp.asarray(rng.normal(size=(10, 3)), jnp.float32) for _ in range(2))

  def fun(c, a, *, b):
    return {"rows": a * b, "sum": jnp.sum(c + a + 2 * b, axis=0), "mean": jnp.mean(c * a)}

  types = optax.microbatching.AccumulationType
  theirs = optax.microbatching.microbatch(
    fun,
    argnums=1,
    argnames="b",
    microbatch_size=2,
    accumulator={"rows": types.CONCAT, "sum": types.SUM, "mean": types.MEAN},
  )(c, a, b=b)
  ours = microbatch(
    fun,
    microbatch_size=2,
    batch_argnums=1,
    batch_argnames="b",
    reduction={"rows": "concat", "sum": "sum", "mean": "mean"},
  )(c, a, b=b)
  chex.assert_trees_all_close(ours, theirs, **TOL)
  chex.assert_trees_all_close(ours, fun(c, a, b=b), **TOL)


# ----------------------------------------------------------------------------------------------
# Bad input.


def _sum(w, x):
  return jnp.sum(x * w)


def test_microbatch_rejects_missing_keyword_batch_argument():
  f = microbatch(lambda w, *, x: jnp.sum(x * w), 2, batch_argnames="x")
  with pytest.raises(
    ValueError,
    match=r"batch_argnames names 'x', but the function was called without a keyword argument "
    r"'x' \(keywords given: none\)\. Pass it by keyword \(x=\.\.\.\), or name its position",
  ):
    f(1.0, jnp.ones(4))
  g = microbatch(lambda w, x, z: jnp.sum(x * w * z), 2, batch_argnames=("x", "y"))
  with pytest.raises(ValueError, match=r"names 'y', .* \(keywords given: 'x', 'z'\)"):
    g(1.0, x=jnp.ones(4), z=2.0)


def test_microbatch_rejects_axes_that_disagree_on_batch_size():
  f = microbatch(lambda a, b: jnp.sum(a) + jnp.sum(b), 2, batch_argnums=0, batch_argnames="b")
  with pytest.raises(
    ValueError,
    match=r"disagree on the batch size \(along batch_axes\):\n  argument 0: 8 \(axis 0\)\n"
    r"  keyword argument b: 3 \(axis 0\)",
  ):
    f(jnp.ones((8, 3)), b=jnp.ones((3, 8)))
  g = microbatch(
    lambda a, b: jnp.sum(a) + jnp.sum(b),
    2,
    batch_argnums=0,
    batch_argnames="b",
    batch_axes=(0, 1),
    reduction="sum",
  )
  chex.assert_trees_all_close(g(jnp.ones((8, 3)), b=jnp.ones((3, 8))), jnp.float32(48.0))


def test_microbatch_rejects_bad_batch_axes():
  with pytest.raises(ValueError, match=r"batch_axes has 1 entries, \(0,\), but there are 2 batch"):
    microbatch(_sum, 2, batch_argnums=(0, 1), batch_axes=(0,))
  with pytest.raises(TypeError, match="batch_axes must be an int or a sequence of ints"):
    microbatch(_sum, 2, batch_axes="rows")
  f = microbatch(_sum, 2, batch_axes=2)
  with pytest.raises(ValueError, match=r"batch_axes gives axis 2 for argument 1, which has shape"):
    f(1.0, jnp.ones((4, 3)))


def test_microbatch_rejects_bad_batch_argnames():
  with pytest.raises(TypeError, match=r"batch_argnames must be a str or a sequence of str, got 3"):
    microbatch(_sum, 2, batch_argnames=3)
  with pytest.raises(ValueError, match="batch_argnames has repeated names"):
    microbatch(_sum, 2, batch_argnames=("x", "x"))
  with pytest.raises(ValueError, match="name at least one batch argument"):
    microbatch(_sum, 2, batch_argnums=())


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(), TypeError, "give exactly one of num_microbatches .* got neither"),
    (dict(num_microbatches=2, microbatch_size=2), TypeError, "got both"),
    (dict(microbatch_size=0), ValueError, "microbatch_size must be a positive int, got 0"),
    (dict(microbatch_size=2.0), TypeError, "microbatch_size must be a positive int, got 2.0"),
  ],
)
def test_microbatch_rejects_bad_sizes(kwargs, error, match):
  with pytest.raises(error, match=match):
    microbatch(_sum, **kwargs)


def test_microbatch_size_must_divide_batch():
  f = microbatch(_sum, microbatch_size=4)
  with pytest.raises(
    ValueError, match=r"argument 1 has leading size 10, which is not divisible by microbatch_size=4"
  ):
    f(1.0, jnp.ones((10, 2)))
  g = microbatch(_sum, microbatch_size=4, batch_axes=1)
  with pytest.raises(
    ValueError,
    match=r"argument 1 has size 6 along axis 1, which is not divisible by microbatch_size=4",
  ):
    g(1.0, jnp.ones((2, 6)))
