"""`optax_accum.audit` on loops as people write them: never a FAIL on an exact one, never a pass
on a broken one (issue 41).

Each loop here is written the way it is found in training scripts — hand-written in-step loops
(`front_end=` a function), whole jitted training steps (`step=`, `micro_step=`), accumulating
transformations (`wrap=`) — and its correctness is known by construction: the exact ones give
the large batch's gradient (checked here directly where it is not obvious), the broken ones
carry one named bug. The audit must judge the loop, not what it was told about it.
"""

import _reference as ref
import jax
import jax.numpy as jnp
import numpy as np
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


def dropout_loss(params, batch, key):
  x = batch["x"] * jax.random.bernoulli(key, 0.8, batch["x"].shape) / 0.8
  return ref.mlp_loss(params, {**batch, "x": x})


# ----------------------------------------------------------------------------------------------
# 1. The loop is judged, not the declaration.


def token_weighted(loss_fn, params, batch):
  """Each micro-batch's gradient times its real tokens, divided by the window's tokens: exact."""
  total, tokens = None, 0.0
  for mb in micro_batches(batch):
    n = jnp.sum(mb["mask"])
    g = jax.tree.map(lambda x, n=n: x * n, jax.grad(loss_fn)(params, mb))
    total = g if total is None else jax.tree.map(jnp.add, total, g)
    tokens = tokens + n
  return jax.tree.map(lambda x: x / tokens, total)


def mean_of_means(loss_fn, params, batch):
  grads = [jax.grad(loss_fn)(params, mb) for mb in micro_batches(batch)]
  return jax.tree.map(lambda *g: sum(g) / K, *grads)


def test_exact_token_weighted_loop_passes_without_weight_fn():
  report = optax_accum.audit(ref.mlp_loss, PARAMS, TOKENS, K, front_end=token_weighted)
  assert report.ok, str(report)
  for name in ("equivalence: gradient", "every micro-batch counted", "weighting"):
    assert verdicts(report)[name] == "ok", name


def test_mean_of_means_fails_in_weighting_whatever_was_declared():
  report = optax_accum.audit(
    ref.mlp_loss, PARAMS, TOKENS, K, front_end=mean_of_means, weight_fn=ref.token_count
  )
  assert verdicts(report)["every micro-batch counted"] == "ok", str(report)
  weighting = report["weighting"]
  assert weighting.verdict == "FAIL"
  assert "your loop weighs the micro-batches [0.25, 0.25, 0.25, 0.25]" in weighting.figure
  assert "a mean of the micro-batches' means" in weighting.figure
  assert "your weight_fn's weights" in weighting.figure


# ----------------------------------------------------------------------------------------------
# 2. A loop that splits its key gets a real one.


def split_keys(loss_fn, params, batch, key):
  keys = jax.random.split(key, K)
  grads = [
    jax.grad(loss_fn)(params, mb, k) for mb, k in zip(micro_batches(batch), keys, strict=True)
  ]
  return jax.tree.map(lambda *g: sum(g) / K, *grads)


def test_loop_that_splits_its_key_is_audited():
  report = optax_accum.audit(
    dropout_loss, PARAMS, BATCH, K, front_end=split_keys, rng=jax.random.key(0)
  )
  assert report.ok, str(report)
  randomness = report["randomness: a key per micro-batch"]
  assert randomness.verdict == "ok"
  assert randomness.figure.startswith("4 draws from 4 distinct keys")


# ----------------------------------------------------------------------------------------------
# 3. An accumulator never zeroed after its update.


def never_zeroed(inner):
  def init(params):
    return inner.init(params), optax.tree.zeros_like(params), jnp.zeros((), jnp.int32)

  def update(grads, state, params=None):
    inner_state, acc, n = state
    acc, n = optax.tree.add(acc, grads), n + 1

    def emit(inner_state):
      return inner.update(optax.tree.scale(1 / K, acc), inner_state, params)

    def wait(inner_state):
      return optax.tree.zeros_like(grads), inner_state

    updates, inner_state = jax.lax.cond(n % K == 0, emit, wait, inner_state)
    return updates, (inner_state, acc, n)  # `acc` is never reset

  return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("optimizer", [SGD, None], ids=["sgd", "no-optimizer"])
def test_accumulator_never_zeroed_fails(optimizer):
  report = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, front_end="accumulate", wrap=never_zeroed, optimizer=optimizer
  )
  equivalence = report["equivalence: gradient"]
  assert equivalence.verdict == "FAIL", str(report)
  assert "update 2 of 3" in equivalence.figure
  counted = report["every micro-batch counted"]
  assert counted.verdict == "FAIL"
  assert "micro-batches of an earlier window counted again" in counted.figure


# ----------------------------------------------------------------------------------------------
# 5. A max over the batch has no weights.


def max_loss(params, batch):
  err = jnp.sum((ref.mlp_apply(params, batch["x"]) - batch["y"]) ** 2, axis=-1)
  return jnp.max(err)


def test_max_over_the_batch_is_not_decomposable():
  report = optax_accum.audit(max_loss, PARAMS, BATCH, K, front_end=mean_of_means)
  assert report["decomposable"].verdict == "n/a: the weights depend on the data", str(report)
  assert "no weight_fn can match" in report["decomposable"].figure
  for name in ("equivalence: gradient", "weighting"):
    assert report[name].verdict.startswith("n/a"), name
  assert report.ok


# ----------------------------------------------------------------------------------------------
# 6. Messages that say what happened.


def sum_loss(params, batch):
  return jnp.sum((ref.mlp_apply(params, batch["x"]) - batch["y"]) ** 2)


def test_sum_loss_averaged_over_micro_batches_says_the_scale():
  report = optax_accum.audit(sum_loss, PARAMS, BATCH, K, front_end=mean_of_means)
  weighting = report["weighting"]
  assert weighting.verdict == "FAIL", str(report)
  assert "the proportions are the large batch's, the scale 0.25× its gradient" in weighting.figure
  assert "use reduction='sum'" in weighting.figure
  assert report["every micro-batch counted"].verdict == "ok"
  good = optax_accum.audit(sum_loss, PARAMS, BATCH, K, reduction="sum")
  assert good.ok, str(good)


def test_mean_loss_with_reduction_sum_fails():
  report = optax_accum.audit(ref.mlp_loss, PARAMS, BATCH, K, reduction="sum")
  assert "the scale 4× its gradient: the sum of micro-batch means" in report["weighting"].figure


@pytest.mark.parametrize("wrap", [
  lambda inner: optax_accum.accumulate(inner, 3),
  lambda inner: optax.MultiSteps(inner, 3).gradient_transformation(),
], ids=["accumulate", "MultiSteps"])  # fmt: skip
def test_every_k_other_than_k_is_measured(wrap):
  report = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, front_end="accumulate", wrap=wrap, optimizer=SGD
  )
  counted = report["every micro-batch counted"]
  assert counted.verdict == "FAIL", str(report)
  assert counted.figure.startswith("your loop updated after 3 micro-batches, not k=4")
  assert report["weighting"].verdict == "n/a: see 'every micro-batch counted'"


def clipped_mean(loss_fn, params, batch, clip=1e-3):
  """Per-micro-batch gradient clipping before the mean (a DP-style loop): the coefficients are
  the clip factors, far below 0.01."""
  grads = []
  for mb in micro_batches(batch):
    g = jax.grad(loss_fn)(params, mb)
    norm = optax.tree.norm(g)
    grads.append(jax.tree.map(lambda x, n=norm: x * jnp.minimum(1.0, clip / n), g))
  return jax.tree.map(lambda *g: sum(g) / K, *grads)


def test_clip_coefficients_print_significant_digits():
  report = optax_accum.audit(ref.mlp_loss, PARAMS, BATCH, K, front_end=clipped_mean)
  figure = report["weighting"].figure
  assert report["weighting"].verdict == "FAIL", str(report)
  assert "0.00," not in figure and "[0.00" not in figure
  coefficients = figure.split("your loop weighs the micro-batches [")[1].split("]")[0]
  assert all(0 < float(c) < 1e-3 for c in coefficients.split(", ")), coefficients


def test_bfloat16_gradients_are_not_the_same_gradient():
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
  batch = jax.tree.map(lambda x: x.astype(jnp.bfloat16), BATCH)
  report = optax_accum.audit(ref.mlp_loss, params, batch, K)
  assert "same gradient" not in report["every micro-batch counted"].verdict, str(report)
  assert report.ok, str(report)
  bad = optax_accum.audit(ref.mlp_loss, params, batch, K, front_end=mean_of_means)
  assert "same gradient" not in bad["every micro-batch counted"].verdict


# ----------------------------------------------------------------------------------------------
# The whole training step as written for `jax.jit`.


def make_step(optimizer, accumulate_grads):
  @jax.jit
  def train_step(params, opt_state, batch):
    grads = accumulate_grads(ref.mlp_loss, params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jnp.zeros(())

  return train_step


def scan_mean(loss_fn, params, batch):
  """The in-step loop as usually written: reshape to (k, b, ...) strided, `lax.scan`, mean."""
  stacked = jax.tree.map(lambda x: x.reshape(-1, K, *x.shape[1:]).swapaxes(0, 1), batch)

  def body(acc, mb):
    return optax.tree.add(acc, jax.grad(loss_fn)(params, mb)), None

  acc, _ = jax.lax.scan(body, optax.tree.zeros_like(params), stacked)
  return optax.tree.scale(1 / K, acc)


def only_last(loss_fn, params, batch):
  for mb in micro_batches(batch):
    grads = jax.grad(loss_fn)(params, mb)  # `=` where `+=` was meant
  return grads


@pytest.mark.parametrize("optimizer", [ADAM, SGD, optax.sgd(1e-4, momentum=0.9)],
                         ids=["adam", "sgd", "momentum"])  # fmt: skip
def test_whole_step_exact_passes(optimizer):
  step = make_step(optimizer, scan_mean)
  report = optax_accum.audit(ref.mlp_loss, PARAMS, BATCH, K, step=step, optimizer=optimizer)
  assert report.ok, str(report)
  for name in ("equivalence: gradient", "first update", "every micro-batch counted", "weighting",
               "schedule: update 3"):  # fmt: skip
    assert verdicts(report)[name] == "ok", name
  assert report.front_end == "train_step"


def test_whole_step_bugs_fail():
  last = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, step=make_step(ADAM, only_last), optimizer=ADAM
  )
  assert "only micro-batch 3 counted" in last["every micro-batch counted"].figure, str(last)
  assert last["every micro-batch counted"].verdict == "FAIL"
  tokens = optax_accum.audit(
    ref.mlp_loss, PARAMS, TOKENS, K, step=make_step(ADAM, scan_mean), optimizer=ADAM
  )
  assert tokens["weighting"].verdict == "FAIL", str(tokens)
  exact = optax_accum.audit(
    ref.mlp_loss, PARAMS, TOKENS, K, step=make_step(ADAM, token_weighted), optimizer=ADAM
  )
  assert exact.ok, str(exact)


def test_whole_step_with_key():
  def make(shared):
    @jax.jit
    def train_step(params, opt_state, batch, key):
      keys = [key] * K if shared else jax.random.split(key, K)
      grads = [
        jax.grad(dropout_loss)(params, mb, k)
        for mb, k in zip(micro_batches(batch), keys, strict=True)
      ]
      grads = jax.tree.map(lambda *g: sum(g) / K, *grads)
      updates, opt_state = ADAM.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return train_step

  key = jax.random.key(1)
  good = optax_accum.audit(
    dropout_loss, PARAMS, BATCH, K, step=make(False), optimizer=ADAM, rng=key
  )
  assert good.ok, str(good)
  bad = optax_accum.audit(dropout_loss, PARAMS, BATCH, K, step=make(True), optimizer=ADAM, rng=key)
  assert bad["randomness: a key per micro-batch"].verdict == "FAIL", str(bad)
  assert bad["equivalence: gradient"].verdict == "ok"  # every draw the same: only keys differ


def multisteps_step(tx):
  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(ref.mlp_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step


def test_micro_step_multisteps():
  tx = optax.MultiSteps(ADAM, K)
  good = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, micro_step=multisteps_step(tx), optimizer=ADAM,
    opt_state=tx.init(PARAMS),
  )  # fmt: skip
  assert good.ok, str(good)
  short = optax.MultiSteps(ADAM, 3)
  bad = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, micro_step=multisteps_step(short), optimizer=ADAM,
    opt_state=short.init(PARAMS),
  )  # fmt: skip
  assert bad["every micro-batch counted"].figure.startswith("your loop updated after 3"), str(bad)


def test_micro_step_train_step_and_never_zeroed():
  step = optax_accum.TrainStep(ref.mlp_loss, SGD, K, donate=False)
  good = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, micro_step=step, optimizer=SGD, opt_state=step.init(PARAMS)
  )
  assert good.ok, str(good)
  tx = never_zeroed(SGD)
  bad = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, micro_step=multisteps_step(tx), optimizer=SGD,
    opt_state=tx.init(PARAMS),
  )  # fmt: skip
  assert bad["every micro-batch counted"].verdict == "FAIL", str(bad)
  assert "update 2 of 3" in bad["equivalence: gradient"].figure


# ----------------------------------------------------------------------------------------------
# The randomness row across steps: the keys the loop passes.


@pytest.mark.parametrize("front_end", ["accumulate", "TrainStep"])
def test_keys_passed_across_steps(front_end):
  key = jax.random.key(0)
  kw = dict(front_end=front_end, optimizer=SGD, num_updates=2)
  good = optax_accum.audit(
    dropout_loss, PARAMS, BATCH, K, rng=lambda i: jax.random.fold_in(key, i), **kw
  )
  assert good["randomness: a key per micro-batch"].verdict == "ok", str(good)
  assert good.ok
  # folding in the update count: every micro-batch of a window draws with the same key
  bad = optax_accum.audit(
    dropout_loss, PARAMS, BATCH, K, rng=lambda i: jax.random.fold_in(key, i // K), **kw
  )
  assert bad["randomness: a key per micro-batch"].verdict == "FAIL", str(bad)
  one = optax_accum.audit(dropout_loss, PARAMS, BATCH, K, rng=key, **kw)
  assert one["randomness: a key per micro-batch"].verdict.startswith("n/a: one key given")


# ----------------------------------------------------------------------------------------------
# Micro-batches of unequal real rows (padding).


def padded_batch():
  batch = ref.regression_data(5, 32)
  mask = (np.arange(32) < 27).astype(np.float32)  # 5 padding rows at the end: 7, 7, 7, 6 real
  return {**batch, "mask": mask}


def row_count(batch):
  return jnp.sum(batch["mask"])


@pytest.mark.parametrize("front_end", ["microbatch", "accumulate", "TrainStep"])
def test_padded_rows(front_end):
  batch = padded_batch()
  bad = optax_accum.audit(ref.mlp_loss, PARAMS, batch, K, front_end=front_end, optimizer=SGD)
  assert bad["weighting"].verdict == "FAIL", str(bad)
  good = optax_accum.audit(
    ref.mlp_loss, PARAMS, batch, K, front_end=front_end, optimizer=SGD, weight_fn=row_count
  )
  assert good.ok, str(good)


# ----------------------------------------------------------------------------------------------
# 4. Bytes reduced per update, on 8 devices.


def pmean_loop(mesh, per_micro_batch):
  """An in-step loop in `shard_map` written as a Python loop: `pmean` on every micro-batch (XLA
  combines the k all-reduces into one of k gradients), or once after the loop."""

  def fn(loss_fn, params, batch):
    def local(params, batch):
      params = jax.lax.pcast(params, "data", to="varying")
      grads = [jax.grad(loss_fn)(params, mb) for mb in micro_batches(batch)]
      if per_micro_batch:
        grads = [jax.lax.pmean(g, "data") for g in grads]
      mean = jax.tree.map(lambda *g: sum(g) / K, *grads)
      return mean if per_micro_batch else jax.lax.pmean(mean, "data")

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(params, batch)

  return fn


@pytest.mark.slow
def test_pmean_per_micro_batch_in_a_python_loop_on_8_devices():
  mesh = jax.make_mesh((8,), ("data",))
  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  batch = jax.device_put(BATCH, NamedSharding(mesh, P("data")))
  bad = optax_accum.audit(
    ref.mlp_loss, params, batch, K, front_end=pmean_loop(mesh, True), mesh=mesh
  )
  assert bad["collectives"].verdict == "FAIL", str(bad)
  assert bad["equivalence: gradient"].verdict == "ok"
  assert "4.00 gradients" in bad["collectives"].figure
  good = optax_accum.audit(
    ref.mlp_loss, params, batch, K, front_end=pmean_loop(mesh, False), mesh=mesh
  )
  assert good.ok, str(good)
  assert "1.00 gradients" in good["collectives"].figure
  # the batch on every device whole: nothing to reduce, and the row says so
  whole = jax.device_put(BATCH, NamedSharding(mesh, P()))
  none = optax_accum.audit(ref.mlp_loss, params, whole, K, mesh=mesh)
  assert none["collectives"].verdict.startswith("n/a: no gradient reduction"), str(none)


# ----------------------------------------------------------------------------------------------
# A warm-up from a learning rate of 0: the first update moves nothing, and is still an update.

WARMUP = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=10))


def test_warmup_from_zero_is_an_update():
  report = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, front_end="TrainStep", optimizer=WARMUP
  )
  assert report.ok, str(report)
  tx = optax.MultiSteps(WARMUP, K)
  step = optax_accum.audit(
    ref.mlp_loss, PARAMS, BATCH, K, micro_step=multisteps_step(tx), optimizer=WARMUP,
    opt_state=tx.init(PARAMS),
  )  # fmt: skip
  assert step.ok, str(step)
