"""`optax_accum.audit` on training loops written as JAX users write them, exact and broken.

Each loop is the form found in real programs — a Flax `TrainState.apply_gradients` step, an
Equinox `eqx.filter_jit` step, a step jitted with ``donate_argnums``, a step returning
``((params, opt_state), metrics)``, a `shard_map` step on 8 devices, a loss computing in
bfloat16 over float32 master weights — and its correctness is known by construction (the exact
ones take the mean of the micro-batches' gradients, or weigh them by their tokens; each broken
one carries one named bug). An exact loop must get no FAIL, a broken one a FAIL in its row; an
audit called wrongly must say which argument is wrong and how to fix it, before any traceback
from deep inside the user's step.

The `xfail(strict=True)` tests are broken loops the audit still passes (every row ok or n/a):
each names the limit, and turns into a failure the day the audit catches the bug.
"""

import _reference as ref
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

K = 4
PARAMS = ref.mlp_params(0, (3, 16, 2))
BATCH = ref.regression_data(1, 32)
TOKENS = ref.token_data(3, lengths=[1, 8, 2, 7, 3, 6, 8, 1, 2, 8, 5, 4, 1, 1, 8, 8], tokens=8)
ADAM = optax.adam(1e-3)
SGD = optax.sgd(0.1)


def micro_batches(batch, k=K):
  return [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]


def verdicts(report):
  return {c.name: c.verdict.split(":")[0] for c in report.checks}


def mean_grads(loss_fn, params, batch):
  grads = [jax.grad(loss_fn)(params, mb) for mb in micro_batches(batch)]
  return jax.tree.map(lambda *g: sum(g) / K, *grads)


def only_last(loss_fn, params, batch):
  for mb in micro_batches(batch):
    grads = jax.grad(loss_fn)(params, mb)  # `=` where `+=` was meant
  return grads


def make_step(optimizer, accumulate_grads, loss_fn=ref.mlp_loss, **jit_kw):
  def train_step(params, opt_state, batch):
    grads = accumulate_grads(loss_fn, params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(train_step, **jit_kw)


# ----------------------------------------------------------------------------------------------
# Exact loops in the forms other libraries teach: no FAIL, and no crash.


def bf16_loss(params, batch):
  """The mixed-precision habit: float32 master weights, the forward pass in bfloat16."""
  cast = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)
  return ref.mlp_loss(cast(params), cast(batch)).astype(jnp.float32)


def test_bfloat16_compute_over_float32_master_weights():
  """The gradients are float32, but every product was rounded to bfloat16: the large batch and
  the micro-batches differ by bfloat16's rounding. The exact loop passes with the loss called a
  sum over examples (it was called "not a sum over examples", and every row said n/a), and a
  mean of means over unequal token counts fails (it passed)."""
  exact = optax_accum.audit(
    bf16_loss, PARAMS, BATCH, K, step=make_step(ADAM, mean_grads, bf16_loss), optimizer=ADAM
  )
  assert exact.ok, str(exact)
  assert verdicts(exact)["decomposable"] == "ok", str(exact)
  assert "the loss computing in bfloat16" in exact["equivalence: gradient"].threshold
  mean_of_means = optax_accum.audit(
    bf16_loss, PARAMS, TOKENS, K, step=make_step(ADAM, mean_grads, bf16_loss), optimizer=ADAM
  )
  assert mean_of_means["weighting"].verdict == "FAIL", str(mean_of_means)


# ----------------------------------------------------------------------------------------------
# Broken loops: FAIL in the row that names the bug.


def zeroed_late(inner):
  """An across-steps accumulator that zeroes itself after adding the first micro-batch of the
  next window instead of before it (`if emitted_last_step: acc = 0` placed after `acc += g`)."""

  def init(params):
    return inner.init(params), optax.tree.zeros_like(params), jnp.zeros((), jnp.int32)

  def update(grads, state, params=None):
    inner_state, acc, n = state
    acc = optax.tree.add(acc, grads)
    late = (n % K == 0) & (n > 0)
    acc = jax.tree.map(lambda a: jnp.where(late, jnp.zeros_like(a), a), acc)
    n = n + 1
    emit = lambda s: inner.update(optax.tree.scale(1 / K, acc), s, params)
    wait = lambda s: (optax.tree.zeros_like(grads), s)
    updates, inner_state = jax.lax.cond(n % K == 0, emit, wait, inner_state)
    return updates, (inner_state, acc, n)

  return optax.GradientTransformation(init, update)


def micro_step_of(tx, loss_fn=ref.mlp_loss):
  @jax.jit
  def train_step(params, opt_state, batch):
    updates, opt_state = tx.update(jax.grad(loss_fn)(params, batch), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return train_step


def test_accumulator_zeroed_a_micro_step_late():
  """The first window is exact, the second leaves out its micro-batch 0: the row names it (it
  said ok while equivalence failed)."""
  tx = zeroed_late(SGD)
  report = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, micro_step=micro_step_of(tx), optimizer=SGD,
    opt_state=tx.init(PARAMS),
  )  # fmt: skip
  counted = report["every micro-batch counted"]
  assert counted.verdict == "FAIL", str(report)
  assert "update 2's gradient" in counted.figure and "micro-batch 0 not counted" in counted.figure


def test_division_by_k_twice_is_named():
  def twice(loss_fn, params, batch):
    return jax.tree.map(lambda g: g / K, mean_grads(loss_fn, params, batch))

  report = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, step=make_step(ADAM, twice), optimizer=ADAM
  )
  assert report["weighting"].verdict == "FAIL", str(report)
  assert "a division by k done twice" in report["weighting"].figure


# ----------------------------------------------------------------------------------------------
# The audit called wrongly: the argument and the fix, not a traceback from inside the step.


def _keyed_step(params, opt_state, batch, key):
  del key
  return make_step(ADAM, mean_grads)(params, opt_state, batch)


@jax.jit
def _only_params(params, opt_state, batch):
  updates, _ = ADAM.update(mean_grads(ref.mlp_loss, params, batch), opt_state, params)
  return optax.apply_updates(params, updates)


@jax.jit
def _state_first(params, opt_state, batch):
  updates, opt_state = ADAM.update(mean_grads(ref.mlp_loss, params, batch), opt_state, params)
  return opt_state, optax.apply_updates(params, updates)


# ----------------------------------------------------------------------------------------------
# A whole step on 8 devices: `shard_map`, with `jax.make_mesh`'s default (Explicit) axes.


def shard_map_step(mesh, *, per_micro_batch=False, pcast=True):
  """The data-parallel step as written with `shard_map`: each device's micro-batches of its
  rows, reduced over "data" once per update (or per micro-batch: the bug)."""

  def grads_of(params, batch):
    local = jax.lax.pcast(params, "data", to="varying") if pcast else params
    acc = optax.tree.zeros_like(params)
    for mb in micro_batches(batch):
      g = jax.grad(ref.mlp_loss)(local, mb)
      acc = optax.tree.add(acc, jax.lax.pmean(g, "data") if per_micro_batch else g)
    return optax.tree.scale(1 / K, acc if per_micro_batch else jax.lax.pmean(acc, "data"))

  grads_of = jax.shard_map(grads_of, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())

  @jax.jit
  def train_step(params, opt_state, batch):
    updates, opt_state = ADAM.update(grads_of(params, batch), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return train_step


@pytest.mark.slow
def test_shard_map_step_on_8_devices():
  mesh = jax.make_mesh((8,), ("data",))
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  batch = jax.device_put(ref.regression_data(1, 64), NamedSharding(mesh, P("data")))
  kw = dict(optimizer=ADAM, mesh=mesh, axis_name="data", num_updates=2)
  good = optax_accum.audit(ref.mlp_loss, params, batch, K, step=shard_map_step(mesh), **kw)
  assert good.ok, str(good)
  assert verdicts(good)["collectives"] == "ok"
  per_micro = shard_map_step(mesh, per_micro_batch=True)
  bad = optax_accum.audit(ref.mlp_loss, params, batch, K, step=per_micro, **kw)
  assert bad["collectives"].verdict == "FAIL", str(bad)
  assert bad["equivalence: gradient"].verdict == "ok"
  # without pcast, jax.grad of the replicated parameters sums over "data" already; pmean then
  # gives 8 times the mean
  summed = shard_map_step(mesh, pcast=False)
  bad = optax_accum.audit(ref.mlp_loss, params, batch, K, step=summed, **kw)
  assert bad["weighting"].verdict == "FAIL", str(bad)
  assert "the 8 devices of the data axis summed" in bad["weighting"].figure


# ----------------------------------------------------------------------------------------------
# Broken loops the audit still passes.
