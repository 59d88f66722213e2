"""Many devices: data parallelism with `shard_map`/`pmap`, GSPMD shardings, partition specs.

Every equivalence test compares with the single-device large batch (`_reference.run_steps`): the
micro-batches of every device concatenated, one `jax.grad` of the global (token-weighted) mean
loss, one plain optax step. The data-parallel side is `_reference.train_data_parallel`. The 8
devices are conftest's host CPU devices. The collectives in the compiled programs (one
all-reduce per update) are guarded in test_structure.py.
"""

import math
import warnings

import _reference as ref
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
from optax_accum import microbatch, state_partition_specs

AX = ref.AXIS
D = 8  # devices
B = 3  # rows per micro-batch per device
F = 5  # features
P0 = ref.mlp_params(0, (F, 2))  # a linear model


def micro_batches(n, mask="ones", seed=1):
  """`n` global micro-batches of D·B rows ``{"x", "y", "mask"}``; device d holds rows d·B to
  d·B + B - 1 of each. `mask` (1 = a real row, the token weight): "ones"; "random" (each
  device's first row real); "uneven" (device d has 1 + d % B real rows)."""
  data = ref.regression_data(seed, n * D * B, F, 2)
  if mask == "random":
    m = np.random.default_rng(seed + 1).integers(0, 2, size=(n, D, B))
    m[..., 0] = 1
  elif mask == "uneven":
    m = np.broadcast_to(np.arange(B)[None, None, :] <= (np.arange(D) % B)[None, :, None], (n, D, B))
  else:
    m = np.ones((n, D, B))
  data["mask"] = m.reshape(-1).astype(np.float32)
  return ref.split(data, n)


def device_batches(mbs):
  """Each device's own rows of the micro-batches `mbs`, concatenated: a list of D batches."""
  per_device = [ref.split(mb, D) for mb in mbs]
  return [ref.concat([rows[d] for rows in per_device]) for d in range(D)]


def sum_of_device_means(params, batches):
  """Σ over devices of each device's own mean loss (`batches` from `device_batches`)."""
  return sum(ref.mlp_loss(params, b) for b in batches)


def token_sum(params, batch):
  """The sum (not the mean) of the per-row losses over the real rows."""
  return ref.mlp_loss(params, batch) * ref.token_count(batch)


# Momentum elsewhere in this file: Adam's update is nearly blind to a gradient's scale, so a
# wrong normalisation across devices (a window mean off by a factor) would pass unseen with it.
# Adam here for its two moments' partition specs.
@pytest.mark.parametrize(
  ("k", "weighted", "name"), [(1, True, "adam"), (3, False, "adam"), (3, True, "momentum")]
)
def test_accumulate_data_parallel_matches_large_batch(k, weighted, name):
  inner = ref.OPTIMIZERS[name]
  mbs = micro_batches(2 * k, "random" if weighted else "ones")
  tx = optax_accum.accumulate(inner, k, axis_name=AX)
  weight_fn = ref.token_count if weighted else None
  got, state = ref.train_data_parallel(tx, P0, mbs, ref.mesh(), weight_fn=weight_fn)
  want, _ = ref.run_steps(inner, P0, ref.mlp_loss, ref.windows(mbs, k))
  assert ref.max_abs_diff(want, P0) > 1e-2  # it trained
  chex.assert_trees_all_close(got, want, **ref.TOL)
  assert int(state.gradient_step) == 2
  assert int(state.mini_step) == 0
  if k > 1:  # per-device partial sums, stacked over the data axis
    assert state.grad_sum["w0"].shape == (D, F, 2)
    assert state.grad_sum["w0"].sharding.spec == P(AX, None, None)
    assert state.acc_weight.shape == (D,) and state.acc_weight.sharding.spec == P(AX)


def test_accumulate_uneven_tokens_is_global_token_mean():
  k = 2
  mbs = micro_batches(k, "uneven")
  tx = optax_accum.accumulate(ref.SGD, k, axis_name=AX)
  got, _ = ref.train_data_parallel(tx, P0, mbs, ref.mesh(), weight_fn=ref.token_count)
  want, _ = ref.run_steps(ref.SGD, P0, ref.mlp_loss, ref.windows(mbs, k))
  chex.assert_trees_all_close(got, want, **ref.TOL)
  # The mean of per-device means (Levanter's choice) is a different, wrong answer here. SGD: the
  # update is -lr * g, so the two means are directly comparable.
  grads = [jax.grad(ref.mlp_loss)(P0, b) for b in device_batches(mbs)]
  mean_of_means = jax.tree.map(lambda p, *g: p - 0.1 * sum(g) / D, P0, *grads)
  assert ref.max_abs_diff(got, mean_of_means) > 1e-3


@pytest.mark.parametrize("k", [1, 3])
def test_accumulate_nonfinite_on_one_device_drops_only_its_micro_batch(k):
  bad_device = 3
  mbs = micro_batches(k, "random")
  poisoned = [dict(mb) for mb in mbs]
  poisoned[0]["x"] = mbs[0]["x"].copy()
  poisoned[0]["x"][bad_device * B, 0] = math.nan
  tx = optax_accum.accumulate(ref.MOMENTUM, k, axis_name=AX)
  got, state = ref.train_data_parallel(tx, P0, poisoned, ref.mesh(), weight_fn=ref.token_count)
  # The large batch without that device's first micro-batch (its rows get no weight).
  dropped = [dict(mb) for mb in mbs]
  dropped[0]["mask"] = mbs[0]["mask"].copy()
  dropped[0]["mask"][bad_device * B : (bad_device + 1) * B] = 0.0
  want, _ = ref.run_steps(ref.MOMENTUM, P0, ref.mlp_loss, ref.windows(dropped, k))
  chex.assert_trees_all_close(got, want, **ref.TOL)
  np.testing.assert_array_equal(state.num_skipped, np.eye(D, dtype=np.int32)[bad_device])


def test_accumulate_over_two_mesh_axes():
  """axis_name=("x", "y"): data parallel over every device of a 2x4 mesh, sums stacked over both."""
  axes = ("x", "y")
  k = 2
  tx = optax_accum.accumulate(ref.MOMENTUM, k, axis_name=axes)
  sspecs = state_partition_specs(tx, jax.tree.map(lambda _: P(), P0), axes)
  assert sspecs.grad_sum["w0"] == P(axes)
  mbs = micro_batches(k, "random")
  mesh = ref.mesh((2, 4), axes)
  got, _ = ref.train_data_parallel(tx, P0, mbs, mesh, axes, weight_fn=ref.token_count)
  want, _ = ref.run_steps(ref.MOMENTUM, P0, ref.mlp_loss, ref.windows(mbs, k))
  chex.assert_trees_all_close(got, want, **ref.TOL)


def _replicated_steps(reduction, loss_of_device, mbs):
  """A whole window in one shard_map, gradients w.r.t. the replicated (not device-varying)
  parameters: already all-reduced by autodiff. Returns the parameters; asserts the warning."""
  tx = optax_accum.accumulate(ref.SGD, len(mbs), reduction=reduction, axis_name=AX)
  pspecs = jax.tree.map(lambda _: P(), P0)

  def steps(p, batches):
    state = tx.init(p)
    for i in range(len(mbs)):
      g = jax.grad(loss_of_device)(p, jax.tree.map(lambda a, i=i: a[i], batches))
      u, state = tx.update(g, state, p)
      p = optax.apply_updates(p, u)
    return p

  spec = P(None, AX)  # the micro-batches stacked on a leading axis; rows over the devices
  f = jax.jit(jax.shard_map(steps, mesh=ref.mesh(), in_specs=(pspecs, spec), out_specs=pspecs))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = f(P0, ref.shard(ref.stack(mbs), ref.mesh(), spec))
  assert any("already reduced over 'data'" in str(w.message) for w in caught)
  return out


def test_accumulate_already_reduced_gradients_are_not_reduced_twice():
  """Gradients w.r.t. replicated parameters come all-reduced: warn, and use them as they are."""
  mbs = micro_batches(2)

  # A global (pmean) loss: its gradient is the large-batch one; "mean" is not reduced again.
  got = _replicated_steps("mean", lambda p, b: lax.pmean(ref.mlp_loss(p, b), AX), mbs)
  want, _ = ref.run_steps(ref.SGD, P0, ref.mlp_loss, ref.windows(mbs, 2))
  chex.assert_trees_all_close(got, want, **ref.TOL)

  # "sum" of a psum loss: the large batch's sum over micro-batches, not D times it.
  got = _replicated_steps("sum", lambda p, b: lax.psum(token_sum(p, b), AX), mbs)
  want, _ = ref.run_steps(ref.SGD, P0, token_sum, ref.windows(mbs, 2))
  chex.assert_trees_all_close(got, want, **ref.TOL)

  # A device-local mean loss: autodiff returns the SUM over devices of the local gradients
  # (the transpose of the implicit broadcast is a psum), and accumulate keeps it as it is.
  got = _replicated_steps("mean", ref.mlp_loss, mbs)
  want, _ = ref.run_steps(ref.SGD, P0, sum_of_device_means, [device_batches(mbs)])
  chex.assert_trees_all_close(got, want, **ref.TOL)


def test_accumulate_already_reduced_gradients_with_device_weights_raise():
  tx = optax_accum.accumulate(ref.SGD, 2, axis_name=AX)
  dp = ref.data_parallel(tx, P0, ref.mesh(), local=False, weight_fn=ref.token_count)
  (mb,) = micro_batches(1, "random")
  with pytest.raises(ValueError, match="`weight` differs per device but the gradients were"):
    dp.step(P0, dp.init(P0), ref.shard(mb, ref.mesh(), P(AX)))


def test_accumulate_pmap_matches_large_batch():
  k = 2
  mbs = micro_batches(2 * k, "random")
  tx = optax_accum.accumulate(ref.MOMENTUM, k, axis_name=AX)
  # pmap maps every input and output: the state is stacked over the devices, inner state too.
  state = jax.pmap(lambda _: tx.init(P0), axis_name=AX)(jnp.arange(D))
  # pmap's gradients are local already (no pcast); every device returns the same parameters.
  fn = ref.accumulate_step(tx, ref.mlp_loss, AX, local=False, weight_fn=ref.token_count)
  step = jax.pmap(fn, axis_name=AX, in_axes=(None, 0, 0))
  params = P0
  for mb in mbs:
    per_device = jax.tree.map(lambda a: a.reshape(D, B, *a.shape[1:]), mb)
    params_all, state = step(params, state, per_device)
    params = jax.tree.map(lambda a: a[0], params_all)
  want, _ = ref.run_steps(ref.MOMENTUM, P0, ref.mlp_loss, ref.windows(mbs, k))
  chex.assert_trees_all_close(params, want, **ref.TOL)


# ----------------------------------------------------------------------------------------------
# microbatch(axis_name=...)


def microbatch_step(inner, k, weighted):
  """A data-parallel step: `microbatch`'s gradient over the device's rows, then `inner`."""
  weight_fn = (lambda p, batch: ref.token_count(batch)) if weighted else None
  grad_fn = microbatch(jax.grad(ref.mlp_loss), k, weight_fn=weight_fn, axis_name=AX)

  def step(params, opt_state, batch):
    updates, opt_state = inner.update(grad_fn(params, batch), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("k", [1, 4])
def test_microbatch_data_parallel_matches_large_batch(k, weighted):
  inner = ref.MOMENTUM
  # Each window is one batch of k·D·B rows, device d holding its k·B consecutive ones.
  big = ref.windows(micro_batches(2 * k, "random" if weighted else "ones"), k)
  pspecs = jax.tree.map(lambda _: P(), P0)
  ospecs = state_partition_specs(inner, pspecs, None)
  mesh = ref.mesh()
  step = ref.shard_step(microbatch_step(inner, k, weighted), mesh, pspecs, ospecs, P(AX))
  params, opt_state = P0, inner.init(P0)
  for batch in big:
    params, opt_state = step(params, opt_state, ref.shard(batch, mesh, P(AX)))
  want, _ = ref.run_steps(inner, P0, ref.mlp_loss, big)
  chex.assert_trees_all_close(params, want, **ref.TOL)


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
  assert acc.grad_sum == {"w": P(AX, None, "model"), "b": P(AX)}
  assert (acc.acc_weight, acc.num_skipped, acc.mini_step) == (P(AX), P(AX), P())
  assert acc.inner_state.inner_state[0].mu == {"w": P(None, "model"), "b": P()}
  assert acc.inner_state.hyperparams["learning_rate"] == P()


def test_state_partition_specs_rejects_bad_input():
  tx = optax_accum.accumulate(optax.sgd(0.1), 4, axis_name=AX)
  # FSDP is decided by accumulate's axis_name (issue 24): only an explicit gathered=False
  # contradicts it.
  with pytest.raises(ValueError, match=r"sharded over axis_name='data'.*gathered=False"):
    state_partition_specs(tx, {"w": P(AX)}, AX, gathered=False)
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
    for leaf in (state.grad_sum[name], state.inner_state[0].mu[name], params[name]):
      assert leaf.sharding.is_equivalent_to(s, leaf.ndim), (name, leaf.sharding)


# ----------------------------------------------------------------------------------------------
# force_emit across devices; bad input.


def device_2_decides(decision):
  """A per-device force_emit flag (device 2's), agreed on by every device (pmax)."""
  return lambda batch: lax.pmax(((lax.axis_index(AX) == 2) & decision).astype(jnp.int32), AX) > 0


def test_accumulate_force_emit_agreed_across_devices_closes_a_short_window():
  mbs = micro_batches(2, "random")
  tx = optax_accum.accumulate(ref.MOMENTUM, 5, axis_name=AX)
  mesh = ref.mesh()
  dp = {
    decision: ref.data_parallel(
      tx, P0, mesh, weight_fn=ref.token_count, force_emit_fn=device_2_decides(decision)
    )
    for decision in (False, True)
  }
  params, state = P0, dp[False].init(P0)
  params, state = dp[False].step(params, state, ref.shard(mbs[0], mesh, P(AX)))
  assert int(state.gradient_step) == 0
  params, state = dp[True].step(params, state, ref.shard(mbs[1], mesh, P(AX)))
  assert int(state.gradient_step) == 1 and int(state.mini_step) == 0  # a window of 2, not 5
  want, _ = ref.run_steps(ref.MOMENTUM, P0, ref.mlp_loss, ref.windows(mbs, 2))
  chex.assert_trees_all_close(params, want, **ref.TOL)


def test_accumulate_per_device_force_emit_raises():
  (mb,) = micro_batches(1, "random")
  tx = optax_accum.accumulate(ref.SGD, 3, axis_name=AX)
  mesh = ref.mesh()
  force_emit_fn = lambda batch: batch["mask"][-1] > 0  # noqa: E731  (differs per device)
  dp = ref.data_parallel(tx, P0, mesh, weight_fn=ref.token_count, force_emit_fn=force_emit_fn)
  with pytest.raises(ValueError, match="force_emit differs per device .* over 'data'"):
    dp.step(P0, dp.init(P0), ref.shard(mb, mesh, P(AX)))


def test_accumulate_unbound_axis_names_the_axis():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name=AX)
  params = {"w": jnp.ones(3)}
  state = ref.data_parallel(tx, params, ref.mesh()).init(params)
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
  mesh = ref.mesh()
  g = jax.shard_map(f, mesh=mesh, in_specs=(P(), P(AX)), out_specs=P())
  # Inside a map over another axis the mesh in effect is the map's: the name is not among its
  # axes (microbatch would bind a mesh axis of that name itself).
  with pytest.raises(ValueError, match=r"axis_name='batch' is not an axis of the mesh"):
    jax.jit(g)(1.0, jax.device_put(jnp.ones(16), NamedSharding(mesh, P(AX))))
