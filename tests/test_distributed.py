"""Many devices: data parallelism with `shard_map`/`pmap`, GSPMD shardings, collective counts.

Every equivalence test compares with the single-device large batch: the micro-batches of every
device concatenated, one `jax.grad` of the global (token-weighted) mean loss, one `optax.adam`
step. The 8 devices are conftest's host CPU devices.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _hlo, count_collectives, microbatch, state_partition_specs

AX = "data"
D = 8  # devices
B = 3  # rows per micro-batch per device
F = 5  # features
# Adam divides by sqrt(v): the first steps are ~lr * sign(g), so float32 rounding in g (sums in
# another order) shows up at ~1e-6 relative in the parameters.
TOL = dict(rtol=2e-5, atol=2e-6)


def _mesh():
  return jax.make_mesh((D,), (AX,))


def _params(seed=0):
  r = np.random.default_rng(seed)
  return {
    "w": jnp.asarray(r.normal(size=(F, 2)), jnp.float32),
    "b": jnp.asarray(r.normal(size=(2,)), jnp.float32),
  }


def _data(windows, k, *, weighted, seed=1, uneven=False):
  """x, y, mask of shape (windows, k, D, B, ...): micro-step i of window t, device d."""
  r = np.random.default_rng(seed)
  x = r.normal(size=(windows, k, D, B, F)).astype(np.float32)
  y = r.normal(size=(windows, k, D, B, 2)).astype(np.float32)
  if uneven:  # device d keeps only its first 1 + d % B rows: token counts 1..B
    m = (np.arange(B)[None, None, None, :] <= (np.arange(D) % B)[None, None, :, None]) * 1.0
    m = np.broadcast_to(m, (windows, k, D, B)).astype(np.float32)
  elif weighted:
    m = r.integers(0, 2, size=(windows, k, D, B)).astype(np.float32)
    m[..., 0] = 1.0  # every micro-batch has at least one real row
  else:
    m = np.ones((windows, k, D, B), np.float32)
  return jnp.asarray(x), jnp.asarray(y), jnp.asarray(m)


def _loss(p, x, y, m):
  """Token-weighted mean squared error over the real (m == 1) rows."""
  err = jnp.sum((x @ p["w"] + p["b"] - y) ** 2, -1)
  return jnp.sum(err * m) / jnp.sum(m)


def _large_batch(params, x, y, m, inner):
  """One `inner` step per window on the window's whole batch (all micro-steps, all devices)."""
  state = inner.init(params)
  for t in range(x.shape[0]):
    flat = [a[t].reshape(-1, *a.shape[4:]) for a in (x, y, m)]
    g = jax.grad(_loss)(params, *flat)
    u, state = inner.update(g, state, params)
    params = optax.apply_updates(params, u)
  return params


def _device_grads(params, x, y, m):
  """Each device's gradient of its own rows in window 0 (all its micro-steps), stacked."""
  rows = [jnp.swapaxes(a[0], 0, 1).reshape(D, -1, *a.shape[4:]) for a in (x, y, m)]
  return jax.vmap(jax.grad(_loss), in_axes=(None, 0, 0, 0))(params, *rows)


def _dp_step(tx, *, weighted, local=True):
  """A data-parallel micro-step: per-device gradient of the local loss, `tx.update`, apply."""

  def step(params, state, x, y, m):
    p = lax.pcast(params, AX, to="varying") if local else params
    g = jax.grad(_loss)(p, x[0], y[0], m[0])
    w = jnp.sum(m[0]) if weighted else None
    u, state = tx.update(g, state, params, weight=w)
    return optax.apply_updates(params, u), state

  return step


def _train(tx, params, x, y, m, *, weighted, local=True):
  """Init in one jitted shard_map, then one jitted shard_map call per micro-step."""
  mesh = _mesh()
  pspecs = jax.tree.map(lambda _: P(), params)
  sspecs = state_partition_specs(tx, pspecs, AX)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspecs,), out_specs=sspecs))
  step = jax.jit(
    jax.shard_map(
      _dp_step(tx, weighted=weighted, local=local),
      mesh=mesh,
      in_specs=(pspecs, sspecs, P(AX), P(AX), P(AX)),
      out_specs=(pspecs, sspecs),
    )
  )
  shard = NamedSharding(mesh, P(AX))
  state = init(params)
  for t in range(x.shape[0]):
    for i in range(x.shape[1]):
      batch = [jax.device_put(a[t, i], shard) for a in (x, y, m)]
      params, state = step(params, state, *batch)
  return params, state


@pytest.mark.parametrize(("k", "weighted"), [(1, True), (3, False), (3, True)])
def test_accumulate_data_parallel_matches_large_batch(k, weighted):
  params = _params()
  x, y, m = _data(2, k, weighted=weighted)
  tx = optax_accum.accumulate(optax.adam(0.1), k, axis_name=AX)
  got, state = _train(tx, params, x, y, m, weighted=weighted)
  want = _large_batch(params, x, y, m, optax.adam(0.1))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)
  assert int(state.gradient_step) == 2
  assert int(state.mini_step) == 0
  if k > 1:  # per-device partial sums, stacked over the data axis
    assert state.acc_grads["w"].shape == (D, F, 2)
    assert state.acc_grads["w"].sharding.spec == P(AX, None, None)
    assert state.acc_weight.shape == (D,) and state.acc_weight.sharding.spec == P(AX)


def test_accumulate_uneven_tokens_is_global_token_mean():
  params = _params()
  k = 2
  x, y, m = _data(1, k, weighted=True, uneven=True)
  inner = optax.sgd(1.0)  # sgd: the update is exactly -g, so the two means are comparable
  tx = optax_accum.accumulate(inner, k, axis_name=AX)
  got, _ = _train(tx, params, x, y, m, weighted=True)
  want = _large_batch(params, x, y, m, inner)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)
  # The mean of per-device means (Levanter's choice) is a different, wrong answer here.
  per_device = _device_grads(params, x, y, m)
  mean_of_means = optax.apply_updates(params, jax.tree.map(lambda g: -g.mean(0), per_device))
  gaps = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got, mean_of_means)
  gap = max(jax.tree.leaves(gaps))
  assert gap > 1e-2


@pytest.mark.parametrize("k", [1, 3])
def test_accumulate_nonfinite_on_one_device_drops_only_its_micro_batch(k):
  params = _params()
  x, y, m = _data(1, k, weighted=True)
  bad_device = 3
  x_bad = x.at[0, 0, bad_device, 0, 0].set(jnp.nan)
  tx = optax_accum.accumulate(optax.adam(0.1), k, axis_name=AX)
  got, state = _train(tx, params, x_bad, y, m, weighted=True)
  # The large batch without that device's first micro-batch (its rows get no weight).
  m_ref = m.at[0, 0, bad_device].set(0.0)
  want = _large_batch(params, x, y, m_ref, optax.adam(0.1))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)
  np.testing.assert_array_equal(state.num_skipped, np.eye(D, dtype=np.int32)[bad_device])


def test_accumulate_over_two_mesh_axes():
  """axis_name=("x", "y"): data parallel over every device of a 2x4 mesh, sums stacked over both."""
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  axes = ("x", "y")
  params = _params()
  k = 2
  x, y, m = _data(1, k, weighted=True)
  tx = optax_accum.accumulate(optax.adam(0.1), k, axis_name=axes)
  pspecs = jax.tree.map(lambda _: P(), params)
  sspecs = state_partition_specs(tx, pspecs, axes)
  assert sspecs.acc_grads["w"] == P(axes)

  def step(params, state, x, y, m):
    g = jax.grad(_loss)(lax.pcast(params, axes, to="varying"), x[0], y[0], m[0])
    u, state = tx.update(g, state, params, weight=jnp.sum(m[0]))
    return optax.apply_updates(params, u), state

  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspecs,), out_specs=sspecs))
  step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(pspecs, sspecs, P(axes), P(axes), P(axes)),
      out_specs=(pspecs, sspecs),
    )
  )
  state, p = init(params), params
  for i in range(k):
    p, state = step(
      p, state, *(jax.device_put(a[0, i], NamedSharding(mesh, P(axes))) for a in (x, y, m))
    )
  want = _large_batch(params, x, y, m, optax.adam(0.1))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), p, want)


def test_accumulate_already_reduced_gradients_are_not_reduced_twice():
  """Gradients w.r.t. replicated parameters come all-reduced: warn, and use them as they are."""
  params = _params()
  k = 2
  x, y, m = _data(1, k, weighted=False)
  inner = optax.sgd(1.0)

  def run(reduction, loss_of_device):
    tx = optax_accum.accumulate(inner, k, reduction=reduction, axis_name=AX)
    mesh = _mesh()
    pspecs = jax.tree.map(lambda _: P(), params)
    sspecs = state_partition_specs(tx, pspecs, AX)

    def steps(p, x, y, m):
      state = tx.init(p)
      for i in range(k):
        g = jax.grad(loss_of_device)(p, x[i], y[i], m[i])  # replicated p: all-reduced grads
        u, state = tx.update(g, state, p)
        p = optax.apply_updates(p, u)
      return p

    spec = P(None, AX)
    f = jax.jit(
      jax.shard_map(steps, mesh=mesh, in_specs=(pspecs, spec, spec, spec), out_specs=pspecs)
    )
    del sspecs
    shard = NamedSharding(mesh, spec)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      out = f(params, *(jax.device_put(a[0], shard) for a in (x, y, m)))
    assert any("already reduced over 'data'" in str(w.message) for w in caught)
    return out

  # A global (pmean) loss: its gradient is the large-batch one; "mean" is not reduced again.
  got = run("mean", lambda *a: lax.pmean(_loss(*a), AX))
  want = _large_batch(params, x, y, m, inner)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)

  # "sum" of a psum loss: the large batch's sum over micro-batches, not D times it.
  def sum_loss(p, x, y, m):
    return jnp.sum(jnp.sum((x @ p["w"] + p["b"] - y) ** 2, -1) * m)

  got = run("sum", lambda *a: lax.psum(sum_loss(*a), AX))
  flat = [a[0].reshape(-1, *a.shape[4:]) for a in (x, y, m)]
  want = optax.apply_updates(params, jax.tree.map(jnp.negative, jax.grad(sum_loss)(params, *flat)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5), got, want)

  # A device-local mean loss: autodiff returns the SUM over devices of the local gradients
  # (the transpose of the implicit broadcast is a psum), and accumulate keeps it as it is.
  got = run("mean", _loss)
  g_sum = jax.tree.map(lambda g: g.sum(0), _device_grads(params, x, y, m))
  want = optax.apply_updates(params, jax.tree.map(jnp.negative, g_sum))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)


def test_accumulate_already_reduced_gradients_with_device_weights_raise():
  params = _params()
  x, y, m = _data(1, 1, weighted=True)
  tx = optax_accum.accumulate(optax.sgd(1.0), 2, axis_name=AX)
  mesh = _mesh()
  pspecs = jax.tree.map(lambda _: P(), params)
  sspecs = state_partition_specs(tx, pspecs, AX)
  step = jax.shard_map(
    _dp_step(tx, weighted=True, local=False),
    mesh=mesh,
    in_specs=(pspecs, sspecs, P(AX), P(AX), P(AX)),
    out_specs=(pspecs, sspecs),
  )
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspecs,), out_specs=sspecs))(params)
  shard = NamedSharding(mesh, P(AX))
  batch = [jax.device_put(a[0, 0], shard) for a in (x, y, m)]
  with pytest.raises(ValueError, match="`weight` differs per device but the gradients were"):
    jax.jit(step)(params, state, *batch)


def test_accumulate_pmap_matches_large_batch():
  params = _params()
  k = 2
  x, y, m = _data(2, k, weighted=True)
  tx = optax_accum.accumulate(optax.adam(0.1), k, axis_name=AX)
  # pmap maps every input and output: the state is stacked over the devices, inner state too.
  state = jax.pmap(lambda _: tx.init(params), axis_name=AX)(jnp.arange(D))
  step = jax.pmap(
    _dp_step(tx, weighted=True, local=False), axis_name=AX, in_axes=(None, 0, 0, 0, 0)
  )
  p = params
  for t in range(2):
    for i in range(k):
      # pmap's gradients are local already; every device returns the same parameters.
      p_all, state = step(p, state, *(a[t, i][:, None] for a in (x, y, m)))
      p = jax.tree.map(lambda a: a[0], p_all)
  want = _large_batch(params, x, y, m, optax.adam(0.1))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), p, want)


# ----------------------------------------------------------------------------------------------
# microbatch(axis_name=...)


def _mb_step(k, *, weighted, inner):
  def step(params, opt_state, x, y, m):
    def grad_fn(p, x, y, m):
      return jax.grad(_loss)(p, x, y, m)

    weight_fn = (lambda p, x, y, m: jnp.sum(m)) if weighted else None
    g = microbatch(grad_fn, k, batch_argnums=(1, 2, 3), weight_fn=weight_fn, axis_name=AX)(
      params, x, y, m
    )
    u, opt_state = inner.update(g, opt_state, params)
    return optax.apply_updates(params, u), opt_state

  return step


def _mb_program(k, *, weighted, inner, params):
  mesh = _mesh()
  pspecs = jax.tree.map(lambda _: P(), params)
  ospecs = state_partition_specs(inner, pspecs, None)
  return jax.jit(
    jax.shard_map(
      _mb_step(k, weighted=weighted, inner=inner),
      mesh=mesh,
      in_specs=(pspecs, ospecs, P(AX), P(AX), P(AX)),
      out_specs=(pspecs, ospecs),
    )
  ), NamedSharding(mesh, P(AX))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("k", [1, 4])
def test_microbatch_data_parallel_matches_large_batch(k, weighted):
  params = _params()
  x, y, m = _data(2, k, weighted=weighted)
  inner = optax.adam(0.1)
  step, shard = _mb_program(k, weighted=weighted, inner=inner, params=params)
  p, s = params, inner.init(params)
  for t in range(2):
    # Device d's batch: its k micro-batches, rows in "strided" order (row j*k + i is in
    # micro-batch i), so the window holds the same rows as the large batch.
    per_device = [jnp.swapaxes(a[t], 0, 1) for a in (x, y, m)]  # (D, k, B, ...)
    per_device = [jnp.swapaxes(a, 1, 2).reshape(D * B * k, *a.shape[3:]) for a in per_device]
    p, s = step(p, s, *(jax.device_put(a, shard) for a in per_device))
  want = _large_batch(params, x, y, m, inner)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), p, want)


# ----------------------------------------------------------------------------------------------
# Collectives in the compiled programs.


def _accumulate_program(k, emit=None):
  params = _params()
  tx = optax_accum.accumulate(optax.adam(0.1), k, axis_name=AX)
  mesh = _mesh()
  pspecs = jax.tree.map(lambda _: P(), params)
  sspecs = state_partition_specs(tx, pspecs, AX)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspecs,), out_specs=sspecs))(params)

  def step(params, state, x, y, m):
    p = lax.pcast(params, AX, to="varying")
    g = jax.grad(_loss)(p, x[0], y[0], m[0])
    u, state = tx.update(g, state, params, weight=jnp.sum(m[0]), emit=emit)
    return optax.apply_updates(params, u), state

  f = jax.jit(
    jax.shard_map(
      step, mesh=mesh, in_specs=(pspecs, sspecs, P(AX), P(AX), P(AX)), out_specs=(pspecs, sspecs)
    )
  )
  x, y, m = _data(1, 1, weighted=True)
  shard = NamedSharding(mesh, P(AX))
  return f.lower(params, state, *(jax.device_put(a[0, 0], shard) for a in (x, y, m)))


@pytest.mark.parametrize("k", [1, 4, 16])
def test_accumulate_all_reduces_once_per_update(k):
  text = _accumulate_program(k).compile().as_text()
  assert count_collectives(text, "all-reduce") == 1
  assert count_collectives(text, "all-reduce", where="loop") == 0
  if k > 1:
    # lax.cond(emitting, close, keep): the all-reduce is in the emitting branch only.
    branches = _hlo.conditional_branches(text, "all-reduce")
    assert sorted(map(sorted, branches))[-1] == [0, 1]
    assert all(0 in b for b in branches)
  # The static programs: accumulating has no collective, emitting has the one.
  if k == 4:
    assert count_collectives(_accumulate_program(k, emit=False).compile().as_text()) == 0
    assert count_collectives(_accumulate_program(k, emit=True).compile().as_text()) == 1


@pytest.mark.parametrize("k", [1, 4, 16])
def test_microbatch_all_reduces_after_the_loop(k):
  params = _params()
  inner = optax.adam(0.1)
  step, shard = _mb_program(k, weighted=True, inner=inner, params=params)
  rows = jnp.zeros((D * B * 16, F)), jnp.zeros((D * B * 16, 2)), jnp.ones((D * B * 16,))
  text = step.lower(params, inner.init(params), *(jax.device_put(a, shard) for a in rows))
  text = text.compile().as_text()
  assert count_collectives(text, "all-reduce", where="loop") == 0
  # XLA's all-reduce combiner fuses the reductions after the loop (sums, weights) into one.
  assert count_collectives(text, "all-reduce") == 1


def test_count_collectives_finds_loops_and_branches():
  mesh = _mesh()

  def body(x):
    def loop(c, _):
      return c + lax.psum(c, AX), None

    return lax.scan(loop, x, None, length=3)[0]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX), out_specs=P(AX)))
  text = f.lower(jax.device_put(jnp.ones(D), NamedSharding(mesh, P(AX)))).compile().as_text()
  assert count_collectives(text, where="loop") == count_collectives(text) >= 1
  with pytest.raises(ValueError, match="kind must be one of"):
    count_collectives(text, "allreduce")


# ----------------------------------------------------------------------------------------------
# Partition specs and GSPMD shardings.


def test_state_partition_specs_for_a_chain():
  tx = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax_accum.accumulate(
      optax.inject_hyperparams(optax.adam)(learning_rate=0.1), 4, axis_name=AX
    ),
  )
  specs = state_partition_specs(tx, {"w": P(None, "model"), "b": P()}, AX)
  acc = specs[1]
  assert acc.acc_grads == {"w": P(AX, None, "model"), "b": P(AX)}
  assert (acc.acc_weight, acc.num_skipped, acc.mini_step) == (P(AX), P(AX), P())
  assert acc.inner_state.inner_state[0].mu == {"w": P(None, "model"), "b": P()}
  assert acc.inner_state.hyperparams["learning_rate"] == P()


def test_state_partition_specs_rejects_bad_input():
  tx = optax_accum.accumulate(optax.sgd(0.1), 4, axis_name=AX)
  with pytest.raises(ValueError, match=r"sharded over axis_name='data'"):
    state_partition_specs(tx, {"w": P(AX)}, AX)
  with pytest.raises(ValueError, match="axis_name must be given here too, got None"):
    state_partition_specs(tx, {"w": P()}, None)
  with pytest.raises(ValueError, match="not axis_name='model'"):
    state_partition_specs(tx, {"w": P()}, "model")
  with pytest.raises(TypeError, match=r"PartitionSpec or NamedSharding at every leaf, got 3"):
    state_partition_specs(tx, {"w": 3}, AX)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_accumulate_gspmd_accumulators_keep_parameter_shardings(axis_type):
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(axis_type, axis_type))
  specs = {"w": P("a", "b"), "v": P(("a", "b")), "b": P()}  # FSDP-style and replicated
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  r = np.random.default_rng(0)
  params = {"w": r.normal(size=(8, 8)), "v": r.normal(size=(16,)), "b": r.normal(size=(8,))}
  params = jax.device_put(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params), shardings)
  tx = optax_accum.accumulate(optax.adam(0.1), 3)
  state_shardings = state_partition_specs(tx, shardings, None)
  state = jax.jit(tx.init, out_shardings=state_shardings)(params)

  # Explicit axes: the shardings are part of the types and every op keeps them. Auto axes: XLA
  # propagates shardings and may pick another (it shards the replicated "b"'s accumulator over
  # "b"), so pin the outputs, as for any GSPMD train step.
  pin = {} if axis_type == AxisType.Explicit else dict(out_shardings=(shardings, state_shardings))

  @jax.jit(**pin)
  def step(params, state, x):
    g = jax.grad(lambda p: jnp.sum((x @ p["w"] + p["b"]) ** 2) + jnp.sum(p["v"] ** 3))(params)
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state

  x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("a")))
  for _ in range(4):  # crosses a window boundary
    params, state = step(params, state, x)
  for name, s in shardings.items():
    for leaf in (state.acc_grads[name], state.inner_state[0].mu[name], params[name]):
      assert leaf.sharding.is_equivalent_to(s, leaf.ndim), (name, leaf.sharding)


# ----------------------------------------------------------------------------------------------
# Bad input.


def _force_emit_program(tx, params, force_emit_of):
  mesh = _mesh()
  pspecs = jax.tree.map(lambda _: P(), params)
  sspecs = state_partition_specs(tx, pspecs, AX)

  def step(params, state, x, y, m):
    g = jax.grad(_loss)(lax.pcast(params, AX, to="varying"), x[0], y[0], m[0])
    u, state = tx.update(g, state, params, weight=jnp.sum(m[0]), force_emit=force_emit_of(m[0]))
    return optax.apply_updates(params, u), state

  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspecs,), out_specs=sspecs))
  step = jax.jit(
    jax.shard_map(
      step, mesh=mesh, in_specs=(pspecs, sspecs, P(AX), P(AX), P(AX)), out_specs=(pspecs, sspecs)
    )
  )
  return init, step, NamedSharding(mesh, P(AX))


def test_accumulate_force_emit_agreed_across_devices_closes_a_short_window():
  params = _params()
  x, y, m = _data(1, 2, weighted=True)
  tx = optax_accum.accumulate(optax.adam(0.1), 5, axis_name=AX)

  def device_2_decides(decision):  # a per-device flag, agreed on by every device (pmax)
    return lambda m: lax.pmax(((lax.axis_index(AX) == 2) & decision).astype(jnp.int32), AX) > 0

  init, step0, shard = _force_emit_program(tx, params, device_2_decides(False))
  _, step1, _ = _force_emit_program(tx, params, device_2_decides(True))
  state, p = init(params), params
  p, state = step0(p, state, *(jax.device_put(a[0, 0], shard) for a in (x, y, m)))
  assert int(state.gradient_step) == 0
  p, state = step1(p, state, *(jax.device_put(a[0, 1], shard) for a in (x, y, m)))
  assert int(state.gradient_step) == 1 and int(state.mini_step) == 0  # a window of 2, not 5
  want = _large_batch(params, x, y, m, optax.adam(0.1))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), p, want)


def test_accumulate_per_device_force_emit_raises():
  params = _params()
  x, y, m = _data(1, 1, weighted=True)
  tx = optax_accum.accumulate(optax.sgd(0.1), 3, axis_name=AX)
  init, step, shard = _force_emit_program(tx, params, lambda m: m[-1] > 0)
  state = init(params)
  with pytest.raises(ValueError, match="force_emit differs per device .* over 'data'"):
    step(params, state, *(jax.device_put(a[0, 0], shard) for a in (x, y, m)))


def test_accumulate_unbound_axis_names_the_axis():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name=AX)
  params = {"w": jnp.ones(3)}
  mesh = _mesh()
  state = jax.jit(
    jax.shard_map(
      tx.init, mesh=mesh, in_specs=(P(),), out_specs=state_partition_specs(tx, {"w": P()}, AX)
    )
  )(params)
  with pytest.raises(
    ValueError, match=r"accumulate.update: axis_name='data' is not bound here.*shard_map"
  ):
    tx.update(params, state, params)


def test_microbatch_unbound_axis_names_the_axis():
  f = microbatch(lambda p, x: jnp.mean(x * p), 2, axis_name="batch")
  with pytest.raises(
    ValueError, match=r"microbatch: axis_name='batch' is not bound here.*shard_map"
  ):
    f(1.0, jnp.ones(4))
  mesh = _mesh()
  g = jax.shard_map(f, mesh=mesh, in_specs=(P(), P(AX)), out_specs=P())
  with pytest.raises(ValueError, match=r"axis_name='batch' is not bound here"):
    jax.jit(g)(1.0, jax.device_put(jnp.ones(16), NamedSharding(mesh, P(AX))))
