"""`optax_accum.audit` on training loops written as JAX users write them, exact and broken.

Each loop is the form found in real programs — a Flax `TrainState.apply_gradients` step, an
Equinox `eqx.filter_jit` step, a step jitted with ``donate_argnums``, a step returning
``((params, opt_state), metrics)``, a `shard_map` step on 8 devices, a loss computing in
bfloat16 over float32 master weights — and its correctness is known by construction (the exact
ones take the mean of the micro-batches' gradients, or weigh them by their tokens; each broken
one carries one named bug). An exact loop must get no FAIL, a broken one a FAIL in its row; an
audit called wrongly must say which argument is wrong and how to fix it, before any traceback
from deep inside the user's step; a loop the audit cannot see must not pass.
"""

import _reference as ref
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
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


def test_flax_train_state_step():
  """`TrainState.apply_gradients` after a `lax.fori_loop` over the micro-batches, passed as the
  audit's step through the one-line adapter the error message gives."""
  state = train_state.TrainState.create(apply_fn=ref.mlp_apply, params=PARAMS, tx=ADAM)

  @jax.jit
  def train_step(state, batch):
    stacked = jax.tree.map(lambda x: x.reshape(-1, K, *x.shape[1:]).swapaxes(0, 1), batch)

    def add(i, acc):
      mb = jax.tree.map(lambda x: x[i], stacked)
      return optax.tree.add(acc, jax.grad(ref.mlp_loss)(state.params, mb))

    grads = jax.lax.fori_loop(0, K, add, optax.tree.zeros_like(state.params))
    return state.apply_gradients(grads=optax.tree.scale(1 / K, grads))

  with pytest.raises(TypeError, match=r"step\(state, batch\); yours takes two arguments"):
    optax_accum.audit(ref.mlp_loss, PARAMS, BATCH, K, step=train_step, optimizer=ADAM)
  step = lambda p, s, b: (lambda t: (t.params, t.opt_state))(
    train_step(state.replace(params=p, opt_state=s), b)
  )
  report = optax_accum.audit(ref.mlp_loss, PARAMS, BATCH, K, step=step, optimizer=ADAM)
  assert report.ok, str(report)
  assert verdicts(report)["equivalence: gradient"] == "ok"


def test_equinox_filter_jit_step():
  """`eqx.filter_value_and_grad` per micro-batch in an `eqx.filter_jit` step (whose compiled
  object is Equinox's, not JAX's), returning the loss beside the model and state."""
  model = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))
  optimizer = optax.adamw(1e-3)

  def loss_fn(model, batch):
    return jnp.mean(jnp.sum((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2, -1))

  @eqx.filter_jit
  def train_step(model, opt_state, batch):
    total, grads = 0.0, None
    for mb in micro_batches(batch):
      loss, g = eqx.filter_value_and_grad(loss_fn)(model, mb)
      total, grads = total + loss, g if grads is None else jax.tree.map(jnp.add, grads, g)
    grads = jax.tree.map(lambda g: g / K, grads)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, total / K

  report = optax_accum.audit(loss_fn, model, BATCH, K, step=train_step, optimizer=optimizer)
  assert report.ok, str(report)
  assert verdicts(report)["equivalence: gradient"] == "ok"


def test_donated_step():
  """``jax.jit(step, donate_argnums=(0, 1))``, as memory-conscious training scripts jit it: the
  audit's own copies are donated, never the caller's arrays."""
  step = make_step(ADAM, mean_grads, donate_argnums=(0, 1))
  params = jax.tree.map(jnp.asarray, PARAMS)
  report = optax_accum.audit(ref.mlp_loss, params, BATCH, K, step=step, optimizer=ADAM)
  assert report.ok, str(report)
  assert not any(x.is_deleted() for x in jax.tree.leaves(params))


def test_step_returning_a_state_pair_and_metrics():
  @jax.jit
  def train_step(params, opt_state, batch):
    loss, _ = jax.value_and_grad(ref.mlp_loss)(params, batch)
    updates, opt_state = ADAM.update(mean_grads(ref.mlp_loss, params, batch), opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

  report = optax_accum.audit(ref.mlp_loss, PARAMS, BATCH, K, step=train_step, optimizer=ADAM)
  assert report.ok, str(report)
  assert verdicts(report)["equivalence: gradient"] == "ok"


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


def test_step_and_micro_step_swapped():
  """A whole step passed as `micro_step` updates on every call; a `MultiSteps` micro-step passed
  as `step` never updates on one call: each FAILs with the argument to use."""
  whole = make_step(ADAM, mean_grads)
  report = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, micro_step=whole, optimizer=ADAM, opt_state=ADAM.init(PARAMS)
  )
  assert report["every micro-batch counted"].verdict == "FAIL", str(report)
  assert "updated after 1 micro-batch," in report["every micro-batch counted"].figure
  assert "pass it as step=" in report["every micro-batch counted"].figure
  tx = optax.MultiSteps(ADAM, K)
  report = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, step=micro_step_of(tx), optimizer=ADAM,
    opt_state=tx.init(PARAMS),
  )  # fmt: skip
  assert report["equivalence: gradient"].verdict == "FAIL", str(report)
  assert "pass it as micro_step=" in report["equivalence: gradient"].figure


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


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    (dict(step=_keyed_step), r"yours takes a key: pass rng="),
    (dict(step=make_step(ADAM, mean_grads), rng=jax.random.key(0)), r"yours takes no key"),
    (dict(step=_only_params), r"step must return \(params, opt_state\)"),
    (dict(step=_state_first), r"step must return \(params, opt_state\).*got a tuple of \(tuple"),
    (dict(step=make_step(ADAM, mean_grads), optimizer=SGD),
     r"is `optimizer` the one your step applies\?"),
  ],
  ids=["key-without-rng", "rng-without-key", "only-params", "state-first", "wrong-optimizer"],
)  # fmt: skip
def test_step_called_wrongly(kwargs, match):
  kwargs = {"optimizer": ADAM, **kwargs}
  loss = ref.mlp_loss if "rng" not in kwargs else (lambda p, b, key: ref.mlp_loss(p, b))
  with pytest.raises(TypeError, match=match):
    optax_accum.audit(loss, PARAMS, BATCH, K, **kwargs)


@pytest.mark.parametrize(
  ("loss", "match"),
  [
    (lambda p, b, key: ref.mlp_loss(p, b), r"loss_fn raised TypeError .*pass rng="),
    (lambda p, b: jnp.sum((ref.mlp_apply(p, b["x"]) - b["y"]) ** 2, -1),
     r"loss_fn must return a scalar.*got shape \(8,\)"),
    (lambda p, b: (ref.mlp_loss(p, b), {"aux": 0.0}), r"got tuple .*f\(p, b\)\[0\]"),
  ],
  ids=["key-without-rng", "per-example-losses", "loss-and-aux"],
)  # fmt: skip
def test_loss_fn_called_wrongly(loss, match):
  """A loss taking a key without rng=, one returning per-example losses, one returning (loss,
  aux): JAX's raw TypeError came from inside the audit's reference gradient; now a message
  naming loss_fn and the fix, before anything is compiled."""
  with pytest.raises(TypeError, match=match):
    optax_accum.audit(loss, PARAMS, BATCH, K)


def test_nnx_step_says_how_to_audit_it():
  """An NNX step mutates its model and `nnx.Optimizer` in place: the audit's functional step
  cannot call it, and the message says how to write one."""

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.hidden, self.out = nnx.Linear(3, 8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
      return self.out(jnp.tanh(self.hidden(x)))

  def loss_fn(model, batch):
    return jnp.mean(jnp.sum((model(batch["x"]) - batch["y"]) ** 2, -1))

  @nnx.jit
  def train_step(model, optimizer, batch):
    grads = nnx.grad(loss_fn)(model, batch)
    optimizer.update(model, grads)

  model = MLP(nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"nnx\.split\(model, nnx\.Param\)"):
    optax_accum.audit(loss_fn, model, BATCH, K, step=train_step, optimizer=ADAM)


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


def test_integer_leaves_beside_the_weights():
  """A counter or an index buffer in the parameters (a dict's int32 leaf, an Equinox module's
  int32 field): `jax.grad` refuses such leaves, and the audit crashed with its raw TypeError
  from inside its reference gradient. They have no gradient: zeros of their dtype; the exact
  loop is judged ok, a loop that keeps only the last micro-batch FAILs."""
  counted = {**PARAMS, "count": jnp.zeros((), jnp.int32), "on": jnp.ones((2,), jnp.bool_)}
  weights = lambda p, b: ref.mlp_loss({name: p[name] for name in PARAMS}, b)  # noqa: E731
  good = optax_accum.audit(weights, counted, BATCH, K)
  assert good.ok, str(good)

  def only_last_weights(loss_fn, params, batch):  # as users write it: the weights' gradient
    rest = {n: v for n, v in params.items() if n not in PARAMS}
    grads = only_last(lambda w, b: loss_fn({**w, **rest}, b), {n: params[n] for n in PARAMS}, batch)
    return {**grads, **jax.tree.map(jnp.zeros_like, rest)}

  bad = optax_accum.audit(weights, counted, BATCH, K, front_end=only_last_weights)
  assert bad["every micro-batch counted"].verdict == "FAIL", str(bad)

  class Permuted(eqx.Module):
    mlp: eqx.nn.MLP
    perm: jax.Array  # int32

    def __call__(self, x):
      return self.mlp(x)[self.perm]

  model = Permuted(eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0)), jnp.array([1, 0], jnp.int32))
  loss = lambda m, b: jnp.mean(jnp.sum((jax.vmap(m)(b["x"]) - b["y"]) ** 2, -1))  # noqa: E731
  report = optax_accum.audit(loss, model, BATCH, K)
  assert report.ok, str(report)


def dropout_loss(params, batch, key):
  x = batch["x"] * jax.random.bernoulli(key, 0.8, batch["x"].shape) / 0.8
  return ref.mlp_loss(params, {**batch, "x": x})


def keyed_shard_map_step(mesh, *, per_micro_batch=True, per_device=True):
  """A `shard_map` step with dropout: each device's micro-batch i draws with the key folded
  with the device's index and with i (the exact loop), or with one key for all of a device's
  micro-batches, or with the same keys on every device."""

  def grads_of(params, batch, key):
    local = jax.lax.pcast(params, "data", to="varying")
    if per_device:
      key = jax.random.fold_in(key, jax.lax.axis_index("data"))
    grads = [
      jax.grad(dropout_loss)(local, mb, jax.random.fold_in(key, i) if per_micro_batch else key)
      for i, mb in enumerate(micro_batches(batch))
    ]
    return jax.lax.pmean(jax.tree.map(lambda *g: sum(g) / K, *grads), "data")

  grads_of = jax.shard_map(grads_of, mesh=mesh, in_specs=(P(), P("data"), P()), out_specs=P())

  @jax.jit
  def train_step(params, opt_state, batch, key):
    updates, opt_state = ADAM.update(grads_of(params, batch, key), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return train_step


@pytest.mark.slow
def test_shard_map_keys_per_device_and_micro_batch():
  """Inside `shard_map` each device draws for its own rows: a key per device and micro-batch.
  One key for all of a device's micro-batches (8 distinct keys) and the same keys on every
  device (4) were counted against k = 4 and passed; they FAIL against 32."""
  mesh = jax.make_mesh((8,), ("data",))
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  batch = jax.device_put(ref.regression_data(1, 64), NamedSharding(mesh, P("data")))
  kw = dict(optimizer=ADAM, mesh=mesh, axis_name="data", num_updates=1, rng=jax.random.key(0))
  row = "randomness: a key per micro-batch"
  for shape, verdict in (({}, "ok"), (dict(per_micro_batch=False), "FAIL"),
                         (dict(per_device=False), "FAIL")):  # fmt: skip
    step = keyed_shard_map_step(mesh, **shape)
    report = optax_accum.audit(dropout_loss, params, batch, K, step=step, **kw)
    assert report[row].verdict == verdict, (shape, str(report))
    assert "on each of 8 devices" in report[row].figure and ">= 32" in report[row].threshold


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["microbatch", "data_parallel"])
def test_library_front_ends_draw_a_key_per_device_and_micro_batch(front_end):
  """The library's front ends on 8 devices with a dropout key per micro-step come back clean
  against the count of a key per device and micro-batch: `microbatch` folds the device into
  each key, and the audit's `data_parallel` recipe does as the multi-device guide says."""
  mesh = jax.make_mesh((8,), ("data",))
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  batch = jax.device_put(ref.regression_data(1, 64), NamedSharding(mesh, P("data")))
  rng = lambda i: jax.random.fold_in(jax.random.key(0), i)  # noqa: E731
  with jax.set_mesh(mesh):
    report = optax_accum.audit(dropout_loss, params, batch, K, front_end=front_end, mesh=mesh,
                               axis_name="data", rng=rng, optimizer=SGD)  # fmt: skip
  assert report.ok, str(report)
  row = report["randomness: a key per micro-batch"]
  assert row.verdict == "ok" and "on each of 8 devices" in row.figure, str(row)


def _fsdp_step(mesh, accumulate_grads):
  """A whole FSDP step as GSPMD users write it: `jax.jit` with `in_shardings` that shard each
  parameter (and its Adam moments) over "data" along a dimension of 16, the batch's rows too."""

  def placed(x):
    dims = [i for i, n in enumerate(np.shape(x)) if n % 8 == 0]
    spec = P(*([None] * dims[0]), "data") if dims else P()
    return NamedSharding(mesh, spec)

  params = jax.tree.map(placed, PARAMS)
  state = jax.tree.map(placed, ADAM.init(PARAMS))
  batch = NamedSharding(mesh, P("data"))
  step = make_step(ADAM, accumulate_grads, in_shardings=(params, state, batch),
                   out_shardings=(params, state))  # fmt: skip
  return step, (params, state), batch


def test_fsdp_step_with_in_shardings_on_8_devices():
  """A whole FSDP step with `in_shardings` (GSPMD's Auto axes: XLA places the activations).
  Host arrays: `jax.jit` places them as its `in_shardings` say and the step returns its
  parameters sharded, which the audit's own programs must take (a raw ValueError from inside
  the audit before); under `jax.set_mesh` they become replicated arrays that the step
  refuses, and the refusal names the fix. Placed, the exact loop passes and a loop that keeps
  only the last micro-batch's gradient fails."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  batch = ref.regression_data(1, 64)
  kw = dict(optimizer=ADAM, mesh=mesh, axis_name="data", num_updates=2)
  step, (params, _), rows = _fsdp_step(mesh, mean_grads)
  host = optax_accum.audit(ref.mlp_loss, PARAMS, batch, K, step=step, **kw)
  assert host.ok, str(host)
  refused = r"(?s)in_shardings.*jax\.device_put\(params"
  with jax.set_mesh(mesh), pytest.raises(TypeError, match=refused):
    optax_accum.audit(ref.mlp_loss, PARAMS, batch, K, step=step, **kw)
  placed, batch = jax.device_put(PARAMS, params), jax.device_put(batch, rows)
  good = optax_accum.audit(ref.mlp_loss, placed, batch, K, step=step, **kw)
  assert good.ok, str(good)
  assert good["collectives"].verdict == "ok", str(good)
  bad, _, _ = _fsdp_step(mesh, only_last)
  bad = optax_accum.audit(ref.mlp_loss, placed, batch, K, step=bad, **kw)
  assert bad["every micro-batch counted"].verdict == "FAIL", str(bad)


@pytest.mark.parametrize("keep", ["nothing", "params_and_grads"])
def test_fsdp_microbatch_step_collectives_on_shards_of_a_few_bytes(keep):
  """`microbatch(keep_unsharded=...)` in a whole step jitted with `in_shardings`, on a model
  whose shards are 8 to 24 bytes per device: the reduce-scatters read whole gradients and are
  counted as such (they were taken for scalars by their result's size: "no gradient
  reduction over the data axis"). "nothing" reduce-scatters per micro-batch: info; the
  window's one reduction of "params_and_grads": ok."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  _, (params, state), rows = _fsdp_step(mesh, mean_grads)
  grads = optax_accum.microbatch(jax.grad(ref.mlp_loss), K, axis_name="data",
                                 keep_unsharded=keep, in_shardings=(params, rows))  # fmt: skip
  step = make_step(ADAM, lambda _, p, b: grads(p, b), in_shardings=(params, state, rows),
                   out_shardings=(params, state))  # fmt: skip
  placed = jax.device_put(PARAMS, params)
  batch = jax.device_put(ref.regression_data(1, 64), rows)
  kw = dict(optimizer=ADAM, mesh=mesh, axis_name="data", num_updates=2)
  with jax.set_mesh(mesh):
    report = optax_accum.audit(ref.mlp_loss, placed, batch, K, step=step, **kw)
  assert report.ok, str(report)
  row = report["collectives"]
  assert row.verdict == ("info" if keep == "nothing" else "ok"), str(row)


# ----------------------------------------------------------------------------------------------
# Optimizers the gradient cannot be read back through: the step is judged through them, end to
# end (its optimizer state and parameters against the optimizer on the large batch's gradient).

CLIP_ADAMW = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))  # the commonest
NONLINEAR = {
  "clip+adamw": CLIP_ADAMW,
  "adafactor": optax.adafactor(1e-3),
  "muon": optax.contrib.muon(1e-3),
  "schedule-free": optax.contrib.schedule_free_adamw(1e-3),
}
UPDATE_ROWS = ("equivalence: gradient", "first update", "every micro-batch counted", "weighting",
               "schedule: update 3")  # fmt: skip


def test_the_clipping_acts_on_this_model():
  """The clip+adamw tests below exercise a clipping that acts (the large batch's gradient norm
  is above the threshold): there the optimizer is not affine in the gradient."""
  assert optax.tree.norm(jax.grad(ref.mlp_loss)(PARAMS, BATCH)) > 2.0


@pytest.mark.parametrize("optimizer", NONLINEAR.values(), ids=NONLINEAR.keys())
def test_nonlinear_optimizer_exact_step_passes_and_only_last_fails(optimizer):
  exact = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, step=make_step(optimizer, mean_grads), optimizer=optimizer
  )
  assert exact.ok, str(exact)
  blind = optimizer is CLIP_ADAMW  # the clipping acts: k·g clipped is g clipped
  assert all(verdicts(exact)[name] == "ok" for name in UPDATE_ROWS if name != "weighting")
  assert verdicts(exact)["weighting"] == ("n/a" if blind else "ok"), str(exact)
  assert "cannot be read back through your optimizer" in exact["equivalence: gradient"].threshold
  last = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, step=make_step(optimizer, only_last), optimizer=optimizer
  )
  assert last["equivalence: gradient"].verdict == "FAIL", str(last)
  counted = last["every micro-batch counted"]
  assert counted.verdict == "FAIL" and "only micro-batch 3 counted" in counted.figure, str(last)


def test_clipped_step_is_judged_tightly():
  """Micro-batch weights 0.4 % off (1.004, 1, 1, 0.996)/4 — a gradient 1e-3 off the large
  batch's, in a direction the clipping does not remove — FAIL; so do a mean of means over
  unequal token counts (named in "weighting") and the token-weighted loop passes."""
  from test_audit_loops import token_weighted

  def skewed(loss_fn, params, batch):
    grads = [jax.grad(loss_fn)(params, mb) for mb in micro_batches(batch)]
    c = (1.004, 1.0, 1.0, 0.996)
    return jax.tree.map(lambda *g: sum(ci * gi for ci, gi in zip(c, g, strict=True)) / K, *grads)

  audit = lambda batch, fn: optax_accum.audit(
    ref.mlp_loss, PARAMS, batch, K, step=make_step(CLIP_ADAMW, fn), optimizer=CLIP_ADAMW
  )
  assert audit(BATCH, skewed)["equivalence: gradient"].verdict == "FAIL"
  mean_of_means = audit(TOKENS, mean_grads)
  assert mean_of_means["weighting"].verdict == "FAIL", str(mean_of_means)
  assert "a mean of the micro-batches' means" in mean_of_means["weighting"].figure
  exact = audit(TOKENS, token_weighted)
  assert exact.ok, str(exact)


def test_a_scale_the_clipping_hides_is_said_not_judged():
  """A step that sums the micro-batches' means (k times the large batch's gradient) behind
  `clip_by_global_norm(1)` + SGD, where the clipping acts: its updates are the large batch's,
  and every row said ok ("weighting" vouched for weights [1, 1, 1, 1]). The weighting is now
  n/a, saying why and how to judge it; with the loss scaled below the clip it FAILs."""

  def summed(loss_fn, params, batch):
    return jax.tree.map(lambda g: K * g, mean_grads(loss_fn, params, batch))

  clip_sgd = optax.chain(optax.clip_by_global_norm(1.0), SGD)
  for loss, verdict in ((ref.mlp_loss, "n/a"), (lambda p, b: ref.mlp_loss(p, b) / 8, "FAIL")):
    report = optax_accum.audit(loss, PARAMS, BATCH, K, step=make_step(clip_sgd, summed, loss),
                               optimizer=clip_sgd)  # fmt: skip
    assert verdicts(report)["weighting"] == verdict, str(report)
    if verdict == "n/a":
      assert "times 4 at these parameters" in report["weighting"].verdict, str(report)
      assert "the scale is not judged" in report["weighting"].verdict


def test_bfloat16_momentum_updates_read_back_and_judged_through_are_said_so():
  """bfloat16 parameters under SGD with momentum: update 1's gradient reads back from the
  trace, updates 2 and 3 are judged through the optimizer. The update rows said "the loop made
  no update" of a loop that made three; they now say why they are not judged, and a learning
  rate other than the optimizer's still FAILs equivalence."""
  given = optax.sgd(0.1, momentum=0.9)
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), PARAMS)
  exact = optax_accum.audit(ref.mlp_loss, params, BATCH, K, step=make_step(given, mean_grads),
                            optimizer=given)  # fmt: skip
  assert exact.ok, str(exact)
  for row in ("first update", "schedule: update 3"):
    assert "made no update" not in exact[row].verdict, str(exact)
  other = make_step(optax.sgd(0.05, momentum=0.9), mean_grads)
  wrong = optax_accum.audit(ref.mlp_loss, params, BATCH, K, step=other, optimizer=given)
  assert wrong["equivalence: gradient"].verdict == "FAIL", str(wrong)


def test_clipping_above_the_probes_is_seen():
  """`clip_by_global_norm(20)` on a loss 100 times larger (gradient norm 290): the audit's
  probes, entries of order one, have a norm below 20, so the optimizer looks affine there; the
  gradient read back is then the clipped one. The exact loop passes (it FAILed equivalence
  with "all counted" at 0.0172 each), only-last FAILs."""
  loss = lambda p, b: 100 * ref.mlp_loss(p, b)
  clipped = optax.chain(optax.clip_by_global_norm(20.0), optax.adamw(1e-3))
  assert optax.tree.norm(jax.grad(loss)(PARAMS, BATCH)) > 100.0
  audit = lambda fn: optax_accum.audit(
    loss, PARAMS, BATCH, K, step=make_step(clipped, fn, loss), optimizer=clipped
  )
  exact = audit(mean_grads)
  assert exact.ok, str(exact)
  assert verdicts(exact)["equivalence: gradient"] == "ok"
  assert audit(only_last)["every micro-batch counted"].verdict == "FAIL"


def test_clipped_micro_steps():
  """`optax.MultiSteps` around clip+adamw passes; an accumulator never zeroed after its update
  FAILs in "every micro-batch counted", naming the earlier window counted again."""
  from test_audit_loops import never_zeroed

  tx = optax.MultiSteps(CLIP_ADAMW, K)
  good = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, micro_step=micro_step_of(tx), optimizer=CLIP_ADAMW,
    opt_state=tx.init(PARAMS),
  )  # fmt: skip
  assert good.ok, str(good)
  assert all(verdicts(good)[name] == "ok" for name in UPDATE_ROWS if name != "weighting")
  assert "the scale is not judged" in good["weighting"].verdict, str(good)
  tx = never_zeroed(CLIP_ADAMW)
  bad = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, micro_step=micro_step_of(tx), optimizer=CLIP_ADAMW,
    opt_state=tx.init(PARAMS),
  )  # fmt: skip
  counted = bad["every micro-batch counted"]
  assert counted.verdict == "FAIL" and "an earlier window counted again" in counted.figure, str(bad)


# ----------------------------------------------------------------------------------------------
# The optimizer's state inside the step's: found by structure and shapes, or part by part.

SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 10)


@pytest.mark.parametrize(
  "inner", [optax.adam(1.0), optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1.0))],
  ids=["adam", "clip+adam"],
)  # fmt: skip
def test_schedule_outside_multisteps_fails(inner, request):
  """A schedule chained outside `MultiSteps` counts every micro-step: its state is beside the
  wrapper's, found part by part; the same schedule inside passes (with a clip that acts, its
  weighting n/a: the scale is invisible behind it)."""
  optimizer = optax.chain(inner, optax.scale_by_learning_rate(SCHEDULE))
  outside = optax.chain(
    optax.MultiSteps(inner, K).gradient_transformation(),
    optax.scale_by_learning_rate(SCHEDULE),  # counts every micro-step, not every update
  )
  inside = optax.MultiSteps(optimizer, K)
  audit = lambda tx: optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, micro_step=micro_step_of(tx), optimizer=optimizer,
    opt_state=tx.init(PARAMS),
  )  # fmt: skip
  bad = audit(outside)
  assert bad["schedule: update 3"].verdict == "FAIL", str(bad)
  assert bad["first update"].verdict == "FAIL", str(bad)
  assert bad["equivalence: gradient"].verdict == "ok", str(bad)  # the gradient is right
  good = audit(inside)
  assert good.ok, str(good)
  assert all(verdicts(good)[name] == "ok" for name in UPDATE_ROWS if name != "weighting")
  blind = "clip" in request.node.callspec.id
  assert verdicts(good)["weighting"] == ("n/a" if blind else "ok"), str(good)


def master_weights_step(accumulate_grads):
  """bfloat16 parameters, float32 master weights and Adam state in the step's state."""

  @jax.jit
  def train_step(params, opt_state, batch):
    master, inner = opt_state
    grads = accumulate_grads(ref.mlp_loss, params, batch)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, inner = ADAM.update(grads, inner, master)
    master = optax.apply_updates(master, updates)
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), master), (master, inner)

  return train_step


@pytest.mark.parametrize("accumulate_grads", [mean_grads, only_last], ids=["exact", "only-last"])
def test_bfloat16_params_with_float32_master_weights(accumulate_grads):
  params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
  report = optax_accum.audit(
    ref.mlp_loss, params16, BATCH, K, step=master_weights_step(accumulate_grads),
    optimizer=ADAM, opt_state=(PARAMS, ADAM.init(PARAMS)),
  )  # fmt: skip
  if accumulate_grads is mean_grads:
    assert report.ok, str(report)
    assert verdicts(report)["equivalence: gradient"] == "ok"
  else:
    assert report["every micro-batch counted"].verdict == "FAIL", str(report)
    assert "only micro-batch 3 counted" in report["every micro-batch counted"].figure


# ----------------------------------------------------------------------------------------------
# Nothing to judge: never a silent pass.


def test_step_the_audit_cannot_see_is_not_ok():
  """The optimizer's state is not in the step's (momentum SGD's, audited as Adam), or the
  optimizer cannot be replayed (it needs the loss as an extra argument): the equivalence row
  says "not judged" with why, and the report is not ok."""
  momentum = optax.sgd(0.1, momentum=0.9)
  unseen = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, step=make_step(momentum, mean_grads), optimizer=ADAM,
    opt_state=momentum.init(PARAMS),
  )  # fmt: skip
  row = unseen["equivalence: gradient"]
  assert row.verdict.startswith("not judged: the state of `optimizer` is not in"), str(unseen)
  assert not unseen.ok and row in unseen.failures
  with pytest.raises(AssertionError, match=r"failed or could not judge \(equivalence"):
    unseen.assert_ok()
  plateau = optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau())

  @jax.jit
  def step(params, opt_state, batch):
    loss = ref.mlp_loss(params, batch)
    grads = mean_grads(ref.mlp_loss, params, batch)
    updates, opt_state = plateau.update(grads, opt_state, params, value=loss)
    return optax.apply_updates(params, updates), opt_state

  report = optax_accum.audit(ref.mlp_loss, PARAMS, BATCH, K, step=step, optimizer=plateau)
  assert report["equivalence: gradient"].verdict.startswith("not judged: your optimizer raised")
  assert not report.ok


def test_too_few_parameters_is_not_a_pass():
  """Three parameters, k = 4: every gradient is a weighted sum of the micro-batches', so a mean
  of means over unequal real rows (`microbatch` without `weight_fn`) cannot be told from the
  large batch. The report said ok, every gradient row n/a; "decomposable" now says not judged."""
  batch = {**ref.regression_data(2, 16, d_out=1), "mask": np.ones(16, np.float32)}
  batch["mask"][[0, 4, 8]] = 0.0  # micro-batch 0 holds 1 real row, the others 4

  def loss(w, b):
    err = jnp.sum((b["x"] @ w - b["y"]) ** 2, -1)
    return jnp.sum(b["mask"] * err) / jnp.sum(b["mask"])

  report = optax_accum.audit(loss, jnp.ones((3, 1)), batch, K)
  assert report["decomposable"].verdict.startswith("not judged: too few parameters"), str(report)
  assert not report.ok
