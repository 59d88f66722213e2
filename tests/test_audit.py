"""`optax_accum.audit`: each failure class injected in miniature is flagged, with the right
verdict, and the correct configuration of the same model passes.

The injected failures are the accumulation bugs other frameworks shipped (see the guide
"Check accumulation on your model"): hand-written accumulations (`front_end=` a function, or
`wrap=` a transformation) reproduce them, since the library's own paths pass. The audit's
reference side is its own direct computation (`jax.grad` of the large batch and of each
micro-batch); these tests check what it concludes about paths whose bug is known by
construction.
"""

import functools

import _reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.auditing import _audit

K = 4
PARAMS = ref.mlp_params(0, (3, 16, 2))
BATCH = ref.regression_data(1, 32)
SCHEDULE = optax.linear_schedule(0.1, 0.01, transition_steps=10)
SGD = optax.sgd(SCHEDULE)


def _micro(batch, k):
  return [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]


def only_first(loss_fn, params, batch):
  """The AMD Primus bug: only micro-batch 0's gradient reaches the optimizer."""
  grads = [jax.grad(loss_fn)(params, b) for b in _micro(batch, K)]
  return grads[0]


def only_last(loss_fn, params, batch):
  """The Megatron-LM HSDP bug: only the last micro-batch's gradient reaches the optimizer."""
  acc = None
  for b in _micro(batch, K):
    acc = jax.grad(loss_fn)(params, b)  # `=` where `+=` was meant
  return acc


def bf16_sum(loss_fn, params, batch, k=16):
  """A hand-written mean over `k` micro-batches (one `lax.scan`), summed in bfloat16."""
  stacked = jax.tree.map(lambda x: x.reshape(-1, k, *x.shape[1:]).swapaxes(0, 1), batch)

  def add(acc, b):
    grads = jax.grad(loss_fn)(params, b)
    return jax.tree.map(lambda a, g: a + g.astype(jnp.bfloat16), acc, grads), None

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.bfloat16), params)
  acc, _ = jax.lax.scan(add, zeros, stacked)
  return jax.tree.map(lambda a: a.astype(jnp.float32) / k, acc)


def shared_key(loss_fn, params, batch, key):
  """T5X: the same dropout key for every micro-batch."""
  grads = [jax.grad(loss_fn)(params, b, key) for b in _micro(batch, K)]
  return jax.tree.map(lambda *g: sum(g) / K, *grads)


def counting_micro_steps(inner):
  """Keras 3: the inner optimizer steps (with zero gradients) on every micro-step, so its
  schedule counts micro-steps."""

  def init(params):
    return inner.init(params), optax.tree.zeros_like(params), jnp.zeros((), jnp.int32)

  def update(grads, state, params=None):
    inner_state, acc, n = state
    acc, n = optax.tree.add(acc, grads), n + 1
    emit = n % K == 0
    mean = jax.tree.map(lambda a: jnp.where(emit, a / K, 0.0), acc)
    updates, inner_state = inner.update(mean, inner_state, params)
    acc = jax.tree.map(lambda a: jnp.where(emit, 0.0, a), acc)
    return updates, (inner_state, acc, n)

  return optax.GradientTransformation(init, update)


def dropout_loss(params, batch, key):
  """`ref.mlp_loss` with dropout on the inputs; deterministic when `key` is None."""
  x = batch["x"]
  if key is not None:
    x = x * jax.random.bernoulli(key, 0.8, x.shape) / 0.8
  return ref.mlp_loss(params, {**batch, "x": x})


def batch_norm_loss(params, batch):
  """BatchNorm in training mode: the hidden layer normalised by the batch's own statistics."""
  h = batch["x"] @ params["w0"] + params["b0"]
  h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
  out = jnp.tanh(h) @ params["w1"] + params["b1"]
  return jnp.mean(jnp.sum((out - batch["y"]) ** 2, -1))


def _verdicts(report):
  return {c.name: c.verdict.split(":")[0] for c in report.checks}


def test_audit_correct_microbatch_passes():
  report = optax_accum.audit(ref.mlp_loss, PARAMS, BATCH, K, optimizer=SGD)
  assert report.ok, str(report)
  verdicts = _verdicts(report)
  for name in ("equivalence: gradient", "every micro-batch counted", "weighting", "decomposable"):
    assert verdicts[name] == "ok"
  assert verdicts["schedule: update 3"] == "n/a"  # the step applies the optimizer
  assert verdicts["collectives"] == "n/a"  # no mesh
  assert "float32" in report["accumulator"].figure
  report.assert_ok()


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["accumulate", "TrainStep"])
def test_audit_correct_across_steps_passes(front_end):
  report = optax_accum.audit(ref.mlp_loss, PARAMS, BATCH, K, front_end=front_end, optimizer=SGD)
  assert report.ok, str(report)
  for name in ("first update", "schedule: update 3", "accumulator"):
    assert _verdicts(report)[name] == "ok"


@pytest.mark.parametrize(("fn", "index"), [(only_first, 0), (only_last, K - 1)])
def test_audit_flags_one_micro_batch_counted(fn, index):
  report = optax_accum.audit(ref.mlp_loss, PARAMS, BATCH, K, front_end=fn)
  counted = report["every micro-batch counted"]
  assert counted.verdict == "FAIL"
  assert f"only micro-batch {index} counted" in counted.figure
  assert report["equivalence: gradient"].verdict == "FAIL"
  with pytest.raises(AssertionError, match="every micro-batch counted"):
    report.assert_ok()


def test_audit_flags_bf16_accumulator_over_large_k():
  batch = ref.regression_data(2, 64)
  bad = optax_accum.audit(ref.mlp_loss, PARAMS, batch, 16, front_end=bf16_sum)
  assert bad["equivalence: gradient"].verdict == "FAIL", str(bad)
  # The library's front end promotes a bfloat16 accum_dtype to the gradients' float32.
  good = optax_accum.audit(ref.mlp_loss, PARAMS, batch, 16, accum_dtype=jnp.bfloat16)
  assert good.ok, str(good)


TOKENS = ref.token_data(3, lengths=[1, 8, 2, 7, 3, 6, 8, 1, 2, 8, 5, 4, 1, 1, 8, 8], tokens=8)


@pytest.mark.parametrize(
  "front_end",
  ["microbatch", pytest.param("accumulate", marks=pytest.mark.slow),
   pytest.param("TrainStep", marks=pytest.mark.slow)],
)  # fmt: skip
def test_audit_flags_mean_of_means(front_end):
  bad = optax_accum.audit(ref.mlp_loss, PARAMS, TOKENS, K, front_end=front_end)
  verdicts = _verdicts(bad)
  assert verdicts["weighting"] == "FAIL", str(bad)
  assert verdicts["equivalence: gradient"] == "FAIL"
  assert verdicts["every micro-batch counted"] == "ok"  # all counted, with the wrong weights
  good = optax_accum.audit(
    ref.mlp_loss, PARAMS, TOKENS, K, front_end=front_end, weight_fn=ref.token_count
  )
  assert good.ok, str(good)


def test_audit_flags_shared_dropout_key():
  key = jax.random.key(0)
  bad = optax_accum.audit(dropout_loss, PARAMS, BATCH, K, front_end=shared_key, rng=key)
  randomness = bad["randomness: a key per micro-batch"]
  assert randomness.verdict == "FAIL"
  assert randomness.figure.startswith("4 draws from 1 distinct keys")
  good = optax_accum.audit(dropout_loss, PARAMS, BATCH, K, rng=key)
  assert good["randomness: a key per micro-batch"].verdict == "ok", str(good)
  assert good.ok


def test_audit_flags_schedule_counting_micro_steps():
  bad = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, front_end="accumulate", optimizer=SGD,
    wrap=counting_micro_steps,
  )  # fmt: skip
  assert bad["schedule: update 3"].verdict == "FAIL", str(bad)
  assert bad["first update"].verdict == "FAIL"  # its schedule is at micro-step k-1 already
  assert bad["equivalence: gradient"].verdict == "ok"  # the gradients are right
  assert bad["accumulator"].verdict.startswith("n/a")  # a hand-written accumulator


def test_audit_batch_norm_is_not_applicable():
  report = optax_accum.audit(batch_norm_loss, PARAMS, BATCH, K, optimizer=SGD)
  assert report["decomposable"].verdict.startswith("n/a: the loss is not a sum over examples")
  for name in ("equivalence: gradient", "weighting", "schedule: update 3"):
    assert report[name].verdict.startswith("n/a"), name
  assert report["every micro-batch counted"].verdict == "ok"  # Σ of the micro-batch gradients
  assert report.ok  # nothing the library could fix


def test_audit_flags_an_error_that_rtol_0_01_would_hide():
  def off_by_a_thousandth(loss_fn, params, batch):  # the mean, 0.1% too large
    grads = [jax.grad(loss_fn)(params, b) for b in _micro(batch, K)]
    return jax.tree.map(lambda *g: 1.001 * sum(g) / K, *grads)

  report = optax_accum.audit(ref.mlp_loss, PARAMS, BATCH, K, front_end=off_by_a_thousandth)
  assert report["equivalence: gradient"].verdict == "FAIL", str(report)
  assert report["every micro-batch counted"].verdict == "ok"  # every one, in the right proportions
  weighting = report["weighting"]
  assert weighting.verdict == "FAIL"
  assert "the proportions are the large batch's, the scale 1.001× its gradient" in weighting.figure


def test_audit_flags_a_bfloat16_accumulator():
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
  batch = jax.tree.map(lambda x: x.astype(jnp.bfloat16), BATCH)
  report = optax_accum.audit(ref.mlp_loss, params, batch, K, accum_dtype=None)
  assert report["accumulator"].verdict == "FAIL", str(report)
  assert "bfloat16" in report["accumulator"].figure


def test_audit_float64_threshold_is_tight():
  with jax.enable_x64(True):
    params = ref.mlp_params(0, (3, 16, 2), dtype=np.float64)
    batch = ref.regression_data(1, 32, dtype=np.float64)
    report = optax_accum.audit(ref.mlp_loss, params, batch, K, accum_dtype=jnp.float64)
  assert report.ok, str(report)
  assert "eps(float64)" in report["equivalence: gradient"].threshold
  assert _audit.tolerance(jnp.float64, K) < 1e-12


def _mesh_args(mesh):
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  batch = jax.device_put(BATCH, NamedSharding(mesh, P("data")))
  return params, batch


@pytest.mark.slow
def test_audit_flags_reduction_per_micro_batch_on_8_devices():
  mesh = jax.make_mesh((8,), ("data",))
  params, batch = _mesh_args(mesh)
  # No axis_name: GSPMD all-reduces every micro-batch's gradient (MaxText #5056's class).
  bad = optax_accum.audit(ref.mlp_loss, params, batch, K, mesh=mesh)
  assert bad["collectives"].verdict == "FAIL", str(bad)
  assert bad["equivalence: gradient"].verdict == "ok"  # numerically identical
  good = optax_accum.audit(ref.mlp_loss, params, batch, K, mesh=mesh, axis_name="data")
  assert good.ok, str(good)
  assert good["collectives"].figure.startswith("1 reduction per update (0 per micro-batch)")


def pmean_in_step(mesh, each_micro_batch):
  """A hand-written in-step accumulation in `shard_map` over "data", reducing the gradient
  once after the loop, or (MaxText #5056) once per micro-batch inside it."""

  def fn(loss_fn, params, batch):
    def local(params, batch):
      params = jax.lax.pcast(params, "data", to="varying")  # local gradients
      stacked = jax.tree.map(lambda x: x.reshape(-1, K, *x.shape[1:]).swapaxes(0, 1), batch)
      zeros = jax.tree.map(jnp.zeros_like, params)
      reduce = functools.partial(jax.lax.pmean, axis_name="data")
      if each_micro_batch:
        zeros = reduce(zeros)

      def add(acc, b):
        grads = jax.grad(loss_fn)(params, b)
        return optax.tree.add(acc, reduce(grads) if each_micro_batch else grads), None

      acc, _ = jax.lax.scan(add, zeros, stacked)
      acc = optax.tree.scale(1 / K, acc)
      return acc if each_micro_batch else reduce(acc)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(params, batch)

  return fn


@pytest.mark.slow
def test_audit_flags_hand_written_reduction_per_micro_batch_on_8_devices():
  mesh = jax.make_mesh((8,), ("data",))
  params, batch = _mesh_args(mesh)
  bad = optax_accum.audit(
    ref.mlp_loss, params, batch, K, front_end=pmean_in_step(mesh, True), mesh=mesh
  )
  assert bad["collectives"].verdict == "FAIL", str(bad)
  assert bad["collectives"].figure.startswith("4 reductions per update (4 per micro-batch), 4.0")
  assert bad["equivalence: gradient"].verdict == "ok"  # "the only symptom is wasted traffic"
  good = optax_accum.audit(
    ref.mlp_loss, params, batch, K, front_end=pmean_in_step(mesh, False), mesh=mesh
  )
  assert good.ok, str(good)


@pytest.mark.slow
def test_audit_train_step_on_8_devices():
  mesh = jax.make_mesh((8,), ("data",))
  params, batch = _mesh_args(mesh)
  good = optax_accum.audit(
    ref.mlp_loss, params, batch, K, front_end="TrainStep", optimizer=SGD, mesh=mesh,
    axis_name="data",
  )  # fmt: skip
  assert good.ok, str(good)
  assert good["collectives"].verdict == "ok"
  # the emitting program's reduction (XLA:CPU combines its per-leaf all-reduces), and its exact
  # re-reduction in a conditional, taken only when a device dropped the last micro-batch
  said = "1 reduction per update (0 per micro-batch), 1.0"
  assert good["collectives"].figure.startswith(said), good["collectives"].figure
  assert "1 more in a conditional taken only when a device drops" in good["collectives"].figure


@pytest.mark.slow
@pytest.mark.parametrize(
  ("front_end", "axis_name"),
  [("microbatch", "data"), ("TrainStep", "data"), ("data_parallel", "data"), ("accumulate", None)],
)
def test_audit_flags_mean_of_means_on_8_devices(front_end, axis_name):
  mesh = jax.make_mesh((8,), ("data",))
  lengths = np.tile([1, 8, 2, 7, 3, 6, 8, 1, 2, 8, 5, 4, 1, 1, 8, 8], 2)
  tokens = jax.device_put(ref.token_data(4, lengths, tokens=8), NamedSharding(mesh, P("data")))
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  kw = dict(front_end=front_end, mesh=mesh, axis_name=axis_name, optimizer=optax.sgd(0.1))
  bad = optax_accum.audit(ref.mlp_loss, params, tokens, K, **kw)
  assert bad["weighting"].verdict == "FAIL", str(bad)
  assert bad["equivalence: gradient"].verdict == "FAIL"
  good = optax_accum.audit(ref.mlp_loss, params, tokens, K, weight_fn=ref.token_count, **kw)
  for name in ("equivalence: gradient", "every micro-batch counted", "weighting"):
    assert good[name].verdict == "ok", str(good)
  if front_end == "accumulate":  # in a plain jitted step GSPMD reduces every micro-step: exact,
    # and k times the traffic
    assert good["collectives"].verdict == "FAIL", str(good)
    assert good["collectives"].figure.startswith("4 reductions per update (4 per micro-batch)")
  else:
    assert good.ok, str(good)


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    (dict(k=1), "k must be an int >= 2"),
    (dict(k=5), "multiple of k=5"),
    (dict(front_end="scan"), "front_end must be one of"),
    (dict(wrap=counting_micro_steps), "wrap is for front_end='accumulate'"),
    (dict(optimizer="adam"), "optimizer must be an optax GradientTransformation"),
    (dict(num_updates=0), "num_updates must be a positive int"),
  ],
)
def test_audit_bad_input(kwargs, match):
  kwargs = {"k": K, **kwargs}
  with pytest.raises((TypeError, ValueError), match=match):
    optax_accum.audit(ref.mlp_loss, PARAMS, BATCH, **kwargs)


def test_report_table_and_lookup():
  report = optax_accum.audit(ref.mlp_loss, PARAMS, BATCH, K, front_end=only_first)
  text = str(report)
  assert text.splitlines()[0] == "audit of only_first, k=4"
  assert "FAIL" in text and "threshold" in text
  with pytest.raises(KeyError, match="no check named"):
    report["nope"]
  assert {c.name for c in report.failures} >= {"every micro-batch counted"}
