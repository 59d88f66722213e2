"""The eleven faults of issue 24, one test each (named after its item), plus the helpers they
rest on. References are computed independently: the large batch on one device (a direct
`jax.grad` over all rows, then one plain optax step), or the same call without the axis.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import accumulate, microbatch, state_partition_specs
from optax_accum.parallel import _collectives

AX = "data"
TP = dict(w0=P(None, "model"), b0=P("model"), w1=P("model", None), b1=P())
TOL = dict(rtol=2e-5, atol=2e-6)  # Adam's first step on tiny entries (see tests/test_layouts.py)
EXACT = dict(rtol=1e-6, atol=1e-7)  # SGD: float32 rounding of sums in another order


def _mesh(shape=(4, 2), names=(AX, "model"), kind=AxisType.Auto):
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return dict(
    w0=rng.standard_normal((4, 8)).astype(np.float32) * 0.5,
    b0=rng.standard_normal(8).astype(np.float32) * 0.1,
    w1=rng.standard_normal((8, 2)).astype(np.float32) * 0.5,
    b1=rng.standard_normal(2).astype(np.float32) * 0.1,
  )


def _data(n, seed=1):
  rng = np.random.default_rng(seed)
  return rng.standard_normal((n, 4)).astype(np.float32), rng.standard_normal((n, 2)).astype(
    np.float32
  )


def _loss(p, x, y):
  h = jnp.tanh(x @ p["w0"] + p["b0"])
  return jnp.mean(jnp.sum((h @ p["w1"] + p["b1"] - y) ** 2, axis=-1))


def _tp_loss(p, x, y):
  """`_loss` inside a shard_map manual over (data, model): the hidden layer split over "model"."""
  out = lax.psum(jnp.tanh(x @ p["w0"] + p["b0"]) @ p["w1"], "model") + p["b1"]
  return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))


def _sgd_reference(params, xs, ys, lr):
  g = jax.grad(_loss)(params, np.concatenate(xs), np.concatenate(ys))
  return jax.tree.map(lambda p, g: p - lr * g, params, g)


# ----------------------------------------------------------------------------------------------
# Item 1: shard_map over (data, model) with tensor-parallel parameters.


def _tp_accumulate(emit_static, poison=None, k=2, rows=8, lr=0.5, noise_scale=False):
  mesh = _mesh()
  tx = accumulate(optax.sgd(lr), k, axis_name=AX, noise_scale=noise_scale)
  sspecs = state_partition_specs(tx, TP, AX)
  params = _params()
  xs, ys = zip(*[_data(rows, seed=10 + i) for i in range(k)], strict=True)

  def step(p, s, x, y, i):
    g = jax.grad(_tp_loss)(lax.pcast(p, AX, to="varying"), x, y)
    if poison is not None:  # a fault in some shards' gradient only
      g = poison(g, i)
    u, s = tx.update(g, s, p, emit=(i == k - 1) if emit_static else None)
    return optax.apply_updates(p, u), s

  sm = lambda f, i, o: jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o)  # noqa: E731
  p = jax.device_put(params, {n: NamedSharding(mesh, s) for n, s in TP.items()})
  state = jax.jit(sm(tx.init, (TP,), sspecs))(p)
  for i in range(k):
    f = jax.jit(sm(lambda p, s, x, y, i=i: step(p, s, x, y, i), (TP, sspecs, P(AX), P(AX)),
                   (TP, sspecs)))  # fmt: skip
    p, state = f(p, state, xs[i], ys[i])
  return jax.device_get(p), state, params, xs, ys


@pytest.mark.parametrize("emit_static", [False, True])
def test_shard_map_data_by_model_accumulate_regression_issue_24_item_1(emit_static):
  """Both emissions run and give the large batch; the state's per-device scalars are one value
  across "model" (they pass out_specs P('data'))."""
  got, state, params, xs, ys = _tp_accumulate(emit_static)
  chex.assert_trees_all_close(got, _sgd_reference(params, xs, ys, 0.5), **EXACT)
  assert int(state.gradient_step) == 1
  assert state.acc_weight.sharding.spec == P(AX)


def test_shard_map_nan_in_one_model_shard_drops_it_on_every_shard_regression_issue_24_item_1():
  """A NaN in the gradient of model shard 1 only, on data device 0 in micro-batch 0: that piece
  is dropped on BOTH model shards (one decision), so the result is the large batch without data
  device 0's rows of micro-batch 0 (item 11's per-piece rule) — not a mix of shards."""

  def poison(g, i):
    hit = (lax.axis_index("model") == 1) & (lax.axis_index(AX) == 0) & (i == 0)
    return {**g, "w0": jnp.where(hit, jnp.nan, g["w0"])}  # this shard's slice of w0 only

  got, state, params, xs, ys = _tp_accumulate(True, poison)
  # Device 0 of 4 holds rows 0..1 of each 8-row micro-batch: the kept pieces are 7 of 8.
  kept_x = [xs[0][2:], xs[1]]
  kept_y = [ys[0][2:], ys[1]]
  # The window mean is Σ pieces / 7 pieces (each piece the mean over its 2 rows): the mean over
  # the 14 kept rows, since pieces are equal in size.
  chex.assert_trees_all_close(got, _sgd_reference(params, kept_x, kept_y, 0.5), **EXACT)
  assert np.asarray(state.num_skipped).tolist() == [1, 0, 0, 0]


def test_sum_over_shards_counts_model_slices_once_regression_issue_24_item_1():
  """`_collectives.sum_over_shards` (the helper for the noise partials): Σ|g|² of a gradient
  whose leaves are split over "model" is the whole gradient's, whatever the sharding."""
  mesh = _mesh()
  g = {k: v for k, v in _params().items()}
  want = sum(float(np.sum(v.astype(np.float64) ** 2)) for v in g.values())

  def f(g):
    local = lax.pcast(g, AX, to="varying")
    parts = jax.tree.map(lambda x: jnp.sum(x * x), local)
    total = _collectives.resolve(AX).sum_over_shards(parts, local)
    return lax.pmax(total, AX)  # the same on every data device: check it is also over model

  got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(TP,), out_specs=P()))(g)
  np.testing.assert_allclose(float(got), want, rtol=1e-6)


def _data_only_noise(k=2, rows=8, lr=0.5):
  """The window's noise figures of `_tp_accumulate`'s run on a 1-D data mesh of the same 4 data
  devices, with replicated parameters: the same pieces, no model axis."""
  mesh = jax.make_mesh((4,), (AX,), axis_types=(AxisType.Auto,))
  tx = accumulate(optax.sgd(lr), k, axis_name=AX, noise_scale=True)
  sspecs = state_partition_specs(tx, P(), AX)
  xs, ys = zip(*[_data(rows, seed=10 + i) for i in range(k)], strict=True)

  def step(p, s, x, y):
    u, s = tx.update(jax.grad(_loss)(lax.pcast(p, AX, to="varying"), x, y), s, p)
    return optax.apply_updates(p, u), s

  sm = lambda f, i, o: jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o)  # noqa: E731
  p = _params()
  state = jax.jit(sm(tx.init, (P(),), sspecs))(p)
  f = jax.jit(sm(step, (P(), sspecs, P(AX), P(AX)), (P(), sspecs)))
  for i in range(k):
    p, state = f(p, state, xs[i], ys[i])
  return optax_accum.noise_scale(state)


def test_shard_map_data_by_model_noise_partials_are_whole_regression_issue_24_item_1():
  """With tensor-parallel parameters, each micro-batch's |g|² and the window's |ḡ|² are the
  whole gradient's (summed over the model shards, a replicated leaf once): T and Q on the
  (data, model) mesh are those of the same data devices with no model axis."""
  *_, state = _tp_accumulate(True, noise_scale=True)[:2]
  got = optax_accum.noise_scale(state)
  want = _data_only_noise()
  assert np.all(np.isfinite(np.asarray(want.window_trace_cov)))
  for name in ("window_trace_cov", "window_grad_sq", "trace_cov", "grad_sq"):
    np.testing.assert_allclose(
      np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), rtol=1e-5, err_msg=name
    )


# ----------------------------------------------------------------------------------------------
# Item 2: accumulate(adafactor) on an Explicit (data, model) mesh.


def test_accumulate_adafactor_on_explicit_mesh_regression_issue_24_item_2():
  mesh = _mesh(kind=AxisType.Explicit)
  inner = optax.adafactor(1e-2, min_dim_size_to_factor=2)
  tx = accumulate(inner, 2)
  w = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
  xs = [np.random.default_rng(i).standard_normal((8, 4)).astype(np.float32) for i in (1, 2)]

  def loss(p, x):
    out = jnp.einsum("bi,ij->bj", x, p["w"], out_sharding=P(jax.typeof(x).sharding.spec[0], None))
    return jnp.mean(out**2)

  with jax.set_mesh(mesh):
    p = {"w": jax.device_put(w, P(None, "model"))}
    specs = state_partition_specs(tx, {"w": P(None, "model")}, None, params=p)
    assert specs.inner_state[0].v_col == {"w": P()}  # factored: replicated, as placed
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda s: isinstance(s, P))  # fmt: skip
    state = jax.jit(tx.init, out_shardings=shardings)(p)

    @jax.jit
    def step(p, s, x):
      u, s = tx.update(jax.grad(loss)(p, x), s, p)
      return optax.apply_updates(p, u), s

    for x in xs:
      p, state = step(p, state, jax.device_put(x, P(AX, None)))
    # The state keeps the sharding it was placed with (a stable type across calls).
    assert state.inner_state[0].v_col["w"].sharding.spec in (P(), P(None))
  g = jax.grad(lambda p, x: jnp.mean((x @ p["w"]) ** 2))({"w": w}, np.concatenate(xs))
  u, _ = inner.update(g, inner.init({"w": w}), {"w": w})
  chex.assert_trees_all_close(jax.device_get(p), optax.apply_updates({"w": w}, u), **TOL)


# ----------------------------------------------------------------------------------------------
# Item 3: "concat" with split="contiguous" under an Explicit mesh, k < devices.


def test_microbatch_contiguous_concat_explicit_k_below_devices_regression_issue_24_item_3():
  mesh = jax.make_mesh((4,), (AX,), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
  w = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
  x = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32)
  fun = lambda w, x: (jnp.mean((x @ w) ** 2), x @ w)  # noqa: E731
  kw = dict(reduction=("mean", "concat"), split="contiguous")
  want = microbatch(fun, 2, **kw)(w, x)
  with jax.set_mesh(mesh):
    got = jax.jit(microbatch(fun, 2, axis_name=AX, **kw))(w, jax.device_put(x, P(AX, None)))
  chex.assert_trees_all_close(jax.device_get(got), want, **EXACT)
  # Rows in batch order (float32 dots in another order than NumPy's: a few ulps of the row).
  np.testing.assert_allclose(np.asarray(got[1]), x @ w, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Items 4 and 5: state_partition_specs for lookahead and factored states.


@pytest.mark.parametrize("with_params", [False, True])
def test_state_partition_specs_lookahead_regression_issue_24_item_4(with_params):
  tx = accumulate(optax.lookahead(optax.adam(1e-3), 2, 0.5), 2, axis_name=AX)
  specs = {"w": P(None, "model")}
  shapes = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32)}
  kw = {"params": optax.LookaheadParams(shapes, shapes)} if with_params else {}
  got = state_partition_specs(tx, optax.LookaheadParams(specs, specs), AX, **kw)
  assert got.grad_sum == {"w": P(AX, None, "model")}
  adam = got.inner_state.fast_state[0]
  assert adam.mu == adam.nu == {"w": P(None, "model")}
  # The fast weights' specs alone (lookahead's init then warns that it got no LookaheadParams).
  if not with_params:
    plain = state_partition_specs(tx, specs, AX)
    assert plain.grad_sum == got.grad_sum


def test_state_partition_specs_factored_without_params_regression_issue_24_item_5():
  tx = accumulate(optax.adafactor(1e-2), 2, axis_name=AX)
  with pytest.raises(ValueError, match=r"v_row\['w'\].*depend on the parameters' shapes.*params="):
    state_partition_specs(tx, {"w": P(None, "model")}, AX)
  # With the parameters: every spec fits its leaf (a (1,) dummy is replicated).
  params = {"w": np.ones((128, 256), np.float32)}
  specs = state_partition_specs(tx, {"w": P(None, "model")}, AX, params=params)
  factored = specs.inner_state[0]
  assert (factored.v_row, factored.v_col, factored.v) == ({"w": P()}, {"w": P()}, {"w": P()})
  assert specs.grad_sum == {"w": P(AX, None, "model")}
  # Replicated parameters need no shapes: nothing can be mis-sharded.
  rep = state_partition_specs(tx, {"w": P()}, AX)
  assert rep.inner_state[0].v_row == {"w": P()}


# ----------------------------------------------------------------------------------------------
# Item 8: integer sums are exact.


def test_microbatch_narrow_integer_sums_do_not_wrap_regression_issue_24_item_8():
  total = microbatch(jnp.sum, 4, batch_argnums=0, reduction="sum")
  got = total(jnp.full(4, 100, jnp.int8))
  assert int(got) == 400 and got.dtype == jnp.int32
  got = microbatch(jnp.sum, 2, batch_argnums=0, reduction="sum")(jnp.full(2, 200, jnp.uint8))
  assert int(got) == 400 and jnp.issubdtype(got.dtype, jnp.integer)
  got = total(jnp.ones(4, jnp.bool_))
  assert int(got) == 4 and got.dtype == jnp.int32
  got = total(jnp.arange(4, dtype=jnp.int32))  # int32 stays int32
  assert int(got) == 6 and got.dtype == jnp.int32


# ----------------------------------------------------------------------------------------------
# Item 9: which outputs decide a drop, and a fully dropped step is visible.


def _with_metric(w, x):
  """(loss, metrics, grad): the metric is NaN on micro-batch 3 (its first row is 3)."""
  loss = jnp.mean((x * w) ** 2)
  metric = jnp.where(x[0] == 3.0, jnp.nan, jnp.mean(x))
  return loss, {"metric": metric}, jax.grad(lambda w: jnp.mean((x * w) ** 2))(w)


def test_microbatch_metric_nan_does_not_drop_the_gradient_regression_issue_24_item_9():
  x, w = jnp.arange(8.0), jnp.float32(1.5)
  want = jax.grad(lambda w: jnp.mean((x * w) ** 2))(w)
  # The gradient decides (its entry in the output): the NaN metric stays a NaN metric.
  for skip in (2, lambda out: out[2]):
    (loss, metrics, g), info = microbatch(_with_metric, 4, skip_nonfinite=skip, return_info=True)(
      w, x
    )
    np.testing.assert_allclose(g, want, rtol=1e-6)
    assert np.isnan(metrics["metric"]) and int(info.num_skipped) == 0
  # The default (every "mean"/"sum" output decides) drops micro-batch 3, and says so.
  (_, metrics, g), info = microbatch(_with_metric, 4, return_info=True)(w, x)
  rows = jnp.array([0, 4, 1, 5, 2, 6])  # micro-batches 0, 1, 2 of the strided split
  np.testing.assert_allclose(g, jax.grad(lambda w: jnp.mean((x[rows] * w) ** 2))(w), rtol=1e-6)
  assert int(info.num_skipped) == 1
  with pytest.raises(ValueError, match="skip_nonfinite must select outputs reduced by 'mean'"):
    microbatch(_with_metric, 4, skip_nonfinite=1, reduction=("mean", "last", "mean"))(w, x)
  with pytest.raises(TypeError, match="skip_nonfinite must be a bool, got 'grad'; or name"):
    microbatch(_with_metric, 4, skip_nonfinite="grad")


def test_microbatch_fully_dropped_step_is_nan_regression_issue_24_item_9():
  w = jnp.float32(1.0)
  loss, metrics, g = microbatch(_with_metric, 4)(w, jnp.full(8, jnp.nan))
  assert np.isnan(loss) and np.isnan(g) and np.isnan(metrics["metric"])
  # Zero weights (nothing dropped) still give zeros, as documented for an empty window.
  zero = microbatch(_with_metric, 4, weight_fn=lambda w, x: 0.0)(w, jnp.arange(8.0) + 10)
  assert float(zero[0]) == 0.0


# ----------------------------------------------------------------------------------------------
# Item 10: a loss written for an Explicit (data, model) mesh inside the library's binding.


def test_explicit_mesh_spec_naming_the_data_axis_is_explained_regression_issue_24_item_10():
  mesh = _mesh(kind=AxisType.Explicit)
  params = _params()
  x, y = _data(32)

  def loss(p, x, y, spec):
    h = jnp.tanh(x @ p["w0"] + p["b0"])
    out = jnp.matmul(h, p["w1"], out_sharding=spec(h)) + p["b1"]
    return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))

  wrong = lambda h: P(AX, None)  # noqa: E731  (right under plain jit only)
  right = lambda h: P(jax.typeof(h).sharding.spec[0], None)  # noqa: E731
  with jax.set_mesh(mesh):
    p = jax.device_put(params, {n: NamedSharding(mesh, s) for n, s in TP.items()})
    xb, yb = jax.device_put((x, y), P(AX, None))
    step = lambda spec: microbatch(  # noqa: E731
      jax.value_and_grad(lambda p, x, y: loss(p, x, y, spec)), 2, batch_argnums=(1, 2),
      axis_name=AX,
    )  # fmt: skip
    with pytest.raises(
      ValueError, match=r"(?s)names the data axis 'data'.*Manual.*sharding\.spec\[0\]"
    ):
      jax.jit(step(wrong))(p, xb, yb)
    got = jax.jit(step(right))(p, xb, yb)
    plain = jax.jit(jax.value_and_grad(lambda p, x, y: loss(p, x, y, right)))(p, xb, yb)
    step_ts = optax_accum.TrainStep(lambda p, x, y: loss(p, x, y, wrong), optax.sgd(0.1), 2,
                                    axis_name=AX)  # fmt: skip
    with pytest.raises(ValueError, match="names the data axis 'data'"):
      step_ts(p, step_ts.init(p), xb, yb)
  chex.assert_trees_all_close(jax.device_get(got), jax.device_get(plain), **EXACT)
  chex.assert_trees_all_close(jax.device_get(got), jax.value_and_grad(_loss)(params, x, y), **EXACT)


# ----------------------------------------------------------------------------------------------
# Item 11: with an axis, a non-finite piece drops that device's rows only.


def test_nonfinite_piece_with_axis_drops_only_that_device_rows_regression_issue_24_item_11():
  """The unit dropped is one device's piece of a micro-batch (with an axis) or the whole
  micro-batch (without): documented in the contract page and the docstrings; here microbatch
  under plain jit (bound) against the same rows without the piece, and the unbound call
  against the whole micro-batch's removal."""
  mesh = _mesh((4,), (AX,))
  params = _params()
  x, y = _data(16)
  x[5] = np.nan  # row 5: micro-batch 1 of the strided split (k=4), on device 1 (rows 4..7)
  vg = jax.value_and_grad(_loss)
  with jax.set_mesh(mesh):
    (_, g), info = jax.jit(microbatch(vg, 4, batch_argnums=(1, 2), axis_name=AX,
                                      return_info=True))(params, x, y)  # fmt: skip
  # Device 1's piece of micro-batch 1 is rows {5}: each device holds 4 rows, 1 per micro-batch.
  keep = np.setdiff1d(np.arange(16), [5])
  np.testing.assert_equal(int(info.num_skipped), 1)
  chex.assert_trees_all_close(jax.device_get(g), jax.grad(_loss)(params, x[keep], y[keep]), **EXACT)
  # Without the axis: the whole of micro-batch 1 (rows 1, 5, 9, 13) goes.
  (_, g1), info1 = microbatch(vg, 4, batch_argnums=(1, 2), return_info=True)(params, x, y)
  keep1 = np.setdiff1d(np.arange(16), [1, 5, 9, 13])
  assert int(info1.num_skipped) == 1
  chex.assert_trees_all_close(g1, jax.grad(_loss)(params, x[keep1], y[keep1]), **EXACT)


@pytest.mark.parametrize("name", ["adam", "masked", "lookahead", "adafactor"])
def test_state_partition_specs_matrix_optimizers_fit_the_state(name):
  """Every optimizer of the layout matrix: with `params=` each spec fits its leaf (placement on
  the (data, model) mesh works for the real state); without it, the elementwise ones give the
  same specs and adafactor raises naming `params=`."""
  inners = {
    "adam": optax.adam(1e-2),
    "masked": optax.masked(optax.adam(1e-2), dict(w0=True, b0=False, w1=True, b1=False)),
    "lookahead": optax.lookahead(optax.adam(1e-2), 1, 0.5),
    "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=2),
  }
  tx = accumulate(inners[name], 2, axis_name=AX)
  params, specs = _params(), dict(TP)
  if name == "lookahead":
    params, specs = optax.LookaheadParams(params, params), optax.LookaheadParams(specs, specs)
  mesh = _mesh()
  got = state_partition_specs(tx, specs, AX, params=params)
  shardings = jax.tree.map(
    lambda s: NamedSharding(mesh, s), got, is_leaf=lambda s: isinstance(s, P)
  )
  with jax.set_mesh(mesh):
    state = jax.jit(optax_accum.data_parallel(tx.init, AX), out_shardings=shardings)(params)
  assert state.grad_sum["w0"].sharding.spec == P(AX, None, "model")
  assert state.grad_sum["w0"].shape == (4, 4, 8)
  if name == "adafactor":
    with pytest.raises(ValueError, match="params="):
      state_partition_specs(tx, specs, AX)
  else:
    assert state_partition_specs(tx, specs, AX) == got
