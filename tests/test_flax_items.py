"""Issue 34's Flax items (12, 14, 15, 16 and the Flax parts of 19), each against an independent
reference: the same NNX model run micro-batch by micro-batch in a Python loop, the k·b large
batch, or the window without the dropped micro-batch.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils, nnx
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state

import optax_accum

K = 4
FEATURES = 6
TIGHT = dict(rtol=2e-6, atol=2e-7)  # float32 rounding of a mean of k means vs one mean


def _data(n=16, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(n, FEATURES)) * 2.0 + 1.0, jnp.float32)
  y = jnp.asarray(rng.normal(size=(n,)), jnp.float32)
  return x, y


def _strided(tree, i, k=K):  # micro-batch i of microbatch's default split: rows i, i+k, ...
  return jax.tree.map(lambda v: v[i::k], tree)


def _close(a, b, **tol):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **(tol or TIGHT)), a, b)


# ---------------------------------------------------------------------------------------------
# Item 12: NNX objects passed straight into microbatch keep every state update.


class BNDrop(nnx.Module):
  """BatchNorm (running statistics) and dropout (an Rngs stream) between two Linear layers."""

  def __init__(self, rngs, rate=0.5):
    self.fc1 = nnx.Linear(FEATURES, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(rate, rngs=rngs)
    self.fc2 = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.fc2(self.drop(nnx.relu(self.bn(self.fc1(x)))))[..., 0]


class Plain(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(FEATURES, 16, rngs=rngs)
    self.fc2 = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.fc2(nnx.tanh(self.fc1(x)))[..., 0]


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def _loop_reference(model, x, y, k=K):
  """The same model run micro-batch by micro-batch in a Python loop: its state updated in
  place, in order, and the mean of the micro-batch losses and gradients."""
  outs = [nnx.value_and_grad(_loss)(model, *_strided((x, y), i, k)) for i in range(k)]
  return jax.tree.map(lambda *v: sum(v) / k, *outs)


def _stats(model):
  return nnx.state(model, nnx.BatchStat), nnx.state(model, nnx.RngCount)


@pytest.mark.parametrize("jit", [True, False])
def test_item12_nnx_module_state_threaded_like_a_python_loop(jit):
  x, y = _data()
  model = BNDrop(nnx.Rngs(0, dropout=1))
  reference = nnx.clone(model)
  step = optax_accum.microbatch(nnx.value_and_grad(_loss), K, batch_argnums=(1, 2))
  step = nnx.jit(step) if jit else step
  for _ in range(2):  # two steps: the state carries over from the first to the second
    loss, grads = step(model, x, y)
    ref_loss, ref_grads = _loop_reference(reference, x, y)
    _close(loss, ref_loss)
    _close(grads, ref_grads, rtol=2e-5, atol=2e-6)  # through BatchNorm's 1/σ: see below
    _close(_stats(model), _stats(reference))
  # Not vacuous: the statistics moved, and the counter advanced once per micro-batch and step.
  assert float(jnp.abs(model.bn.mean[...]).max()) > 0.1
  assert int(model.drop.rngs.count[...]) == 2 * K


def test_item12_nnx_dropout_masks_differ_per_microbatch_and_step():
  drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
  reference = nnx.clone(drop)

  def masks(drop, x):
    return drop(jnp.ones_like(x))

  step = nnx.jit(optax_accum.microbatch(masks, K, reduction="concat"))
  x = jnp.zeros((8 * K, 16))
  first, second = step(drop, x), step(drop, x)
  # The Python loop: micro-batch i's rows are i, i+k, ... of the batch, in loop order.
  for out in (first, second):
    for i in range(K):
      np.testing.assert_array_equal(_strided(out, i), masks(reference, _strided(x, i)))
  per_micro = [np.asarray(_strided(first, i)) for i in range(K)]
  assert all(not np.array_equal(per_micro[0], m) for m in per_micro[1:])
  assert not np.array_equal(first, second)


def test_item12_nnx_rngs_argument_advances():
  rngs, reference = nnx.Rngs(dropout=5), nnx.Rngs(dropout=5)

  def noisy(x, rngs):
    return x + jax.random.normal(rngs.dropout(), x.shape)

  out = optax_accum.microbatch(noisy, K, batch_argnums=0, reduction="concat")(
    jnp.zeros((K * 2, 3)), rngs
  )
  want = [noisy(jnp.zeros((2, 3)), reference) for _ in range(K)]
  for i in range(K):
    np.testing.assert_array_equal(_strided(out, i), want[i])
  assert int(rngs.dropout.count[...]) == K == int(reference.dropout.count[...])


def test_item12_nnx_gradients_equal_the_large_batch():
  x, y = _data(32)
  model = Plain(nnx.Rngs(0))
  step = nnx.jit(optax_accum.microbatch(nnx.value_and_grad(_loss), K, batch_argnums=(1, 2)))
  loss, grads = step(model, x, y)
  big_loss, big_grads = nnx.value_and_grad(_loss)(model, x, y)
  _close(loss, big_loss)
  _close(grads, big_grads)


def test_item12_nnx_train_step_with_optimizer_and_keyword_model():
  x, y = _data(32)
  model, large = Plain(nnx.Rngs(0)), Plain(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  large_opt = nnx.Optimizer(large, optax.adam(1e-2), wrt=nnx.Param)

  def loss(x, y, *, model):
    return _loss(model, x, y)

  @nnx.jit
  def step(model, opt, x, y):
    mb_loss = optax_accum.microbatch(loss, K, batch_argnums=(0, 1))
    grad_fn = nnx.grad(lambda m: mb_loss(x, y, model=m))
    opt.update(model, grad_fn(model))

  @nnx.jit
  def large_step(model, opt, x, y):
    opt.update(model, nnx.grad(_loss)(model, x, y))

  for _ in range(2):
    step(model, opt, x, y)
    large_step(large, large_opt, x, y)
  _close(nnx.state(model, nnx.Param), nnx.state(large, nnx.Param), rtol=1e-5, atol=1e-6)


def test_item12_nnx_errors_name_the_fix():
  model, x = Plain(nnx.Rngs(0)), jnp.ones((8, FEATURES))
  fun = optax_accum.microbatch(lambda m, x: jnp.mean(m(x)), K, batch_argnums=(0, 1))
  in_batch = r"argument 0 is an NNX object \(Plain\).*batch_argnums=\(1,\)"
  with pytest.raises(ValueError, match=in_batch):
    fun(model, x)
  nested = optax_accum.microbatch(lambda ms, x: jnp.mean(ms[0](x)), K)
  with pytest.raises(ValueError, match=r"argument 0 holds an NNX object \(Plain\) inside a"):
    nested((model,), x)

  def sows(m, x):
    m.extra = nnx.BatchStat(jnp.zeros(()))  # a Variable added inside fun
    return jnp.mean(m(x))

  with pytest.raises(ValueError, match="changed the structure of the NNX objects"):
    optax_accum.microbatch(sows, K)(model, x)

  def assigns(m, x):
    m.fc2.bias[...] = m.fc2.bias[...] + 1.0  # a Param changed inside fun: it would be lost
    return jnp.mean(m(x))

  with pytest.raises(ValueError, match=r"assigned a new value to an nnx.Param.*nnx.BatchStat"):
    optax_accum.microbatch(assigns, K)(model, x)


# ---------------------------------------------------------------------------------------------
# Item 19 (Flax parts): the default "mean" of per-example rows says `reduction`; the batch hint
# does not take the model for batch data.


class Classifier(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(8, 16, rngs=rngs)  # a kernel of leading size 8: the micro-batch size
    self.fc2 = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    return self.fc2(nnx.relu(self.fc1(x)))


def _xent(model, x, labels):
  logits = model(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits


def test_item19_default_mean_of_logits_warns_naming_reduction():
  model = Classifier(nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 8)), jnp.float32)
  labels = jnp.arange(32) % 10
  grad_fn = nnx.value_and_grad(_xent, has_aux=True)
  default = optax_accum.microbatch(grad_fn, K, batch_argnums=(1, 2))
  with pytest.warns(UserWarning, match=r"out\[0\]\[1\] has shape \(8, 10\).*reduction="):
    (_, logits), _ = default(model, x, labels)
  assert logits.shape == (8, 10)  # what NNX metrics then fail on, against (32,) labels
  # Asked for by name: the rows in the batch's order, and no warning (the (8, 16) kernel's
  # gradient, of leading size b too, is never taken for rows: it has a parameter's shape).
  by_name = (("mean", "concat"), "mean")
  rows = optax_accum.microbatch(grad_fn, K, batch_argnums=(1, 2), reduction=by_name)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    (loss, logits), grads = rows(model, x, labels)
  (big_loss, big_logits), big_grads = grad_fn(model, x, labels)
  _close((loss, logits, grads), (big_loss, big_logits, big_grads))
  # An explicit "mean" is never second-guessed.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    optax_accum.microbatch(grad_fn, K, batch_argnums=(1, 2), reduction="mean")(model, x, labels)


@pytest.mark.parametrize("as_module", [True, False])
def test_item19_batch_hint_never_names_the_model(as_module):
  model = Classifier(nnx.Rngs(0))  # leading size 8 of its kernel == the batch size below
  x, labels = jnp.ones((8, 8)), jnp.arange(8) % 10
  if as_module:
    fn = optax_accum.microbatch(nnx.value_and_grad(_xent, has_aux=True), K)
    args = (model, x, labels)
  else:
    params = nnx.state(model, nnx.Param)
    graphdef = nnx.graphdef(model)
    pure = lambda p, x, y: _xent(nnx.merge(graphdef, p), x, y)  # noqa: E731
    fn = optax_accum.microbatch(jax.value_and_grad(pure, has_aux=True), K)
    args = (params, x, labels)
  with pytest.raises(ValueError, match=r"Argument 2 is passed whole.*batch_argnums=\(1, 2\)") as e:
    fn(*args)
  assert "Argument 0" not in str(e.value) and "argument 3" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# Item 16: accumulate(axis_name=...) under Flax's usual pmap + TrainState.


def _pmap_data(n_dev, k=2, b=3, seed=1):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(k, n_dev, b, FEATURES)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(k, n_dev, b)), jnp.float32)
  return x, y


def _linear_loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def test_item16_pmap_train_state_created_inside_the_map_matches_large_batch():
  n_dev, k = jax.device_count(), 2
  assert n_dev == 8
  params = {"w": jnp.linspace(-1.0, 1.0, FEATURES), "b": jnp.zeros(())}
  tx = optax_accum.accumulate(optax.adam(0.1), every_k=k, axis_name="batch")
  create = lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=tx)  # noqa: E731
  state = jax.pmap(create, axis_name="batch")(jax_utils.replicate(params))

  @functools.partial(jax.pmap, axis_name="batch")
  def step(state, x, y):
    return state.apply_gradients(grads=jax.grad(_linear_loss)(state.params, x, y))

  x, y = _pmap_data(n_dev, k)
  for i in range(k):  # one window: k calls, each device with its own rows
    state = step(state, x[i], y[i])
  large = optax.adam(0.1)
  all_x, all_y = x.reshape(-1, FEATURES), y.reshape(-1)
  updates, _ = large.update(jax.grad(_linear_loss)(params, all_x, all_y), large.init(params))
  want = optax.apply_updates(params, updates)
  for d in range(n_dev):  # every device holds the large batch's parameters
    _close(jax.tree.map(lambda a, d=d: a[d], state.params), want)
  assert int(state.opt_state.gradient_step[0]) == 1


def test_item16_pmap_errors_name_the_recipe():
  params = {"w": jnp.zeros(FEATURES), "b": jnp.zeros(())}
  tx = optax_accum.accumulate(optax.sgd(0.1), every_k=2, axis_name="batch")
  recipe = r"(?s)TrainState.create calls tx.init outside any map.*jax.pmap\(tx.init"
  with pytest.raises(
    ValueError, match=r"(?s)accumulate.init: axis_name='batch' is not bound.*" + recipe[4:]
  ):
    train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  # A state made without the axis (outside the map), updated with it inside pmap.
  plain = train_state.TrainState.create(
    apply_fn=None, params=params, tx=optax_accum.accumulate(optax.sgd(0.1), every_k=2)
  )
  state = jax_utils.replicate(plain.replace(tx=tx))
  step = jax.pmap(
    lambda s, x, y: s.apply_gradients(grads=jax.grad(_linear_loss)(s.params, x, y)),
    axis_name="batch",
  )
  x, y = _pmap_data(jax.device_count())
  with pytest.raises(ValueError, match=r"(?s)was not made by init inside a map.*" + recipe[4:]):
    step(state, x[0], y[0])


# ---------------------------------------------------------------------------------------------
# Item 14: counters, cadence and epoch ends. Item 19 (Linen): apply_gradients with weight=.


class AccumTrainState(train_state.TrainState):
  """The Linen recipe (docs/guides/flax.md): a `TrainState` whose `apply_gradients` passes
  `weight` and `force_emit` to the optimizer and whose `step` counts updates, not calls."""

  def apply_gradients(self, *, grads, weight=None, force_emit=False, **kwargs):
    updates, opt_state = self.tx.update(
      grads, self.opt_state, self.params, weight=weight, force_emit=force_emit
    )
    return self.replace(
      step=self.step + optax_accum.has_updated(opt_state),  # updates, as without accumulation
      params=optax.apply_updates(self.params, updates),
      opt_state=opt_state,
      **kwargs,
    )


def _adam_windows(params, windows, lr=0.1):
  """The reference: plain Adam, one step per window on the window's rows as one large batch."""
  tx = optax.adam(lr)
  opt = tx.init(params)
  for x, y in windows:
    updates, opt = tx.update(jax.grad(_linear_loss)(params, x, y), opt)
    params = optax.apply_updates(params, updates)
  return params


def test_item14_nnx_epoch_end_force_emit_and_update_counter():
  class Lin(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.linspace(-1.0, 1.0, FEATURES))
      self.b = nnx.Param(jnp.zeros(()))

  model = Lin()
  params0 = {"w": model.w[...], "b": model.b[...]}
  opt = nnx.Optimizer(model, optax_accum.accumulate(optax.adam(0.1), every_k=4), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, opt, x, y, last):
    grads = nnx.grad(lambda m: _linear_loss({"w": m.w[...], "b": m.b[...]}, x, y))(model)
    opt.update(model, grads, force_emit=last)  # nnx.Optimizer passes keywords to tx.update

  x, y = _data(2 * 6 * 3, seed=3)
  micro = [(x[i * 3 : (i + 1) * 3], y[i * 3 : (i + 1) * 3]) for i in range(12)]
  for epoch in range(2):  # 6 micro-batches an epoch: a window of 4, then one of 2 at the end
    for i in range(6):
      train_step(model, opt, *micro[epoch * 6 + i], jnp.asarray(i == 5))
  state = opt.opt_state
  assert int(opt.step[...]) == 12  # nnx counts update calls: micro-steps
  assert int(state.gradient_step[...]) == 4  # the updates: read this for schedules and cadence
  assert int(state.mini_step[...]) == 0  # nothing pending at the epoch's end
  cat = lambda ms: tuple(jnp.concatenate(v) for v in zip(*ms, strict=True))  # noqa: E731
  windows = [cat(micro[0:4]), cat(micro[4:6]), cat(micro[6:10]), cat(micro[10:12])]
  _close({"w": model.w[...], "b": model.b[...]}, _adam_windows(params0, windows))


def test_item14_linen_step_counts_updates_and_drives_the_schedule():
  State = AccumTrainState
  schedule = optax.linear_schedule(0.1, 0.0, 4)
  params = {"w": jnp.linspace(-1.0, 1.0, FEATURES), "b": jnp.zeros(())}
  state = State.create(
    apply_fn=None, params=params, tx=optax_accum.accumulate(optax.sgd(schedule), every_k=2)
  )
  step = jax.jit(lambda s, x, y: s.apply_gradients(grads=jax.grad(_linear_loss)(s.params, x, y)))
  x, y = _data(6 * 2, seed=4)
  lrs = []
  for i in range(6):
    state = step(state, x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2])
    lrs.append(float(schedule(state.step)))  # the ImageNet example's learning_rate_fn metric
  assert int(state.step) == 3  # 6 calls, 3 updates
  np.testing.assert_allclose(lrs, [0.1, 0.075, 0.075, 0.05, 0.05, 0.025], rtol=1e-6)
  want = optax.tree_utils.tree_get(state.opt_state, "gradient_step")
  assert int(want) == int(state.step)


def test_item19_linen_apply_gradients_with_token_weights_matches_large_batch():
  State = AccumTrainState
  params = {"w": jnp.linspace(-1.0, 1.0, FEATURES), "b": jnp.zeros(())}
  tx = optax_accum.accumulate(optax.adam(0.1), every_k=3)
  state = State.create(apply_fn=None, params=params, tx=tx)
  x, y = _data(4 * 3, seed=5)
  mask = jnp.asarray([1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0], jnp.float32)  # 4, 1, 3 real rows

  def masked(params, x, y, m):  # the mean over the micro-batch's real rows
    return jnp.sum(m * (x @ params["w"] + params["b"] - y) ** 2) / jnp.sum(m)

  @jax.jit
  def step(state, x, y, m):
    grads = jax.grad(masked)(state.params, x, y, m)
    return state.apply_gradients(grads=grads, weight=jnp.sum(m))

  for i in range(3):
    rows = slice(4 * i, 4 * i + 4)
    state = step(state, x[rows], y[rows], mask[rows])
  large = optax.adam(0.1)
  updates, _ = large.update(jax.grad(masked)(params, x, y, mask), large.init(params))
  _close(state.params, optax.apply_updates(params, updates))
  assert int(state.step) == 1


# ---------------------------------------------------------------------------------------------
# Item 15: Flax's DynamicScale (loss scaling) and accumulation compose.


class DSState(train_state.TrainState):
  dynamic_scale: dynamic_scale_lib.DynamicScale


def _ds_step(revert):
  """Flax's mixed-precision step (the ImageNet example's), with (`revert`) or without its
  ``jnp.where(is_fin, new, old)`` of the optimizer state and parameters."""

  @jax.jit
  def step(state, x, y):
    grad_fn = state.dynamic_scale.value_and_grad(_linear_loss)
    ds, is_fin, _, grads = grad_fn(state.params, x, y)
    new = state.apply_gradients(grads=grads)
    if revert:  # Flax's revert: right without accumulation, wrong with it
      keep = lambda a, b: jnp.where(is_fin, a, b)  # noqa: E731
      new = new.replace(
        opt_state=jax.tree.map(keep, new.opt_state, state.opt_state),
        params=jax.tree.map(keep, new.params, state.params),
      )
    return new.replace(dynamic_scale=ds)

  return step


def test_item15_dynamic_scale_nan_microbatch_dropped_and_counted_once():
  params = {"w": jnp.linspace(-1.0, 1.0, FEATURES), "b": jnp.zeros(())}
  tx = optax_accum.accumulate(optax.adam(0.1), every_k=K)  # skip_nonfinite=True: the default
  x, y = _data(K * 3, seed=6)
  x = x.at[6].set(jnp.inf)  # micro-batch 2 (rows 6..8) overflows: its gradient is NaN
  micro = [(x[3 * i : 3 * i + 3], y[3 * i : 3 * i + 3]) for i in range(K)]
  results = {}
  for revert in (False, True):
    state = DSState.create(
      apply_fn=None, params=params, tx=tx, dynamic_scale=dynamic_scale_lib.DynamicScale()
    )
    for xi, yi in micro:
      state = _ds_step(revert)(state, xi, yi)
    results[revert] = state
  state = results[False]  # the recipe: no revert; accumulate drops and counts the micro-batch
  counts = (state.opt_state.mini_step, state.opt_state.gradient_step, state.opt_state.num_skipped)
  assert tuple(int(c) for c in counts) == (0, 1, 1)  # the window closed on time, one skipped
  assert float(state.dynamic_scale.scale) == 65536.0 * 0.5  # the scale backed off once
  finite = [m for i, m in enumerate(micro) if i != 2]
  rows = tuple(jnp.concatenate(v) for v in zip(*finite, strict=True))
  _close(state.params, _adam_windows(params, [rows]))  # the large batch without micro-batch 2
  # Flax's revert undoes the micro-step itself: the window closes a call late, nothing counted.
  bad = results[True].opt_state
  assert (int(bad.mini_step), int(bad.gradient_step), int(bad.num_skipped)) == (3, 0, 0)


def test_item12_nnx_batchnorm_dropout_through_every_front_end():
  """microbatch (the model passed in), accumulate in nnx.Optimizer and TrainStep (split by
  hand) end one window with the same parameters, statistics and counters."""
  x, y = _data(4 * K, seed=7)
  numbers = lambda m: nnx.state(m, nnx.Not(nnx.RngKey))  # noqa: E731
  make = lambda: BNDrop(nnx.Rngs(0, dropout=1), rate=0.3)  # noqa: E731

  mb_model = make()
  mb_opt = nnx.Optimizer(mb_model, optax.sgd(0.1), wrt=nnx.Param)
  grad_fn = optax_accum.microbatch(nnx.value_and_grad(_loss), K, batch_argnums=(1, 2))
  mb_opt.update(mb_model, grad_fn(mb_model, x, y)[1])

  acc_model = make()
  acc_opt = nnx.Optimizer(
    acc_model, optax_accum.accumulate(optax.sgd(0.1), every_k=K), wrt=nnx.Param
  )
  for i in range(K):
    acc_opt.update(acc_model, nnx.grad(_loss)(acc_model, *_strided((x, y), i)))

  ts_model = make()
  graphdef, params, rest = nnx.split(ts_model, nnx.Param, ...)

  def ts_loss(params, rest, x, y):
    model = nnx.merge(graphdef, params, rest, copy=True)
    return _loss(model, x, y), nnx.split(model, nnx.Param, ...)[2]

  ts = optax_accum.TrainStep(ts_loss, optax.sgd(0.1), every_k=K, has_aux=True)
  state = ts.init(params)
  for i in range(K):
    params, state, (_, rest) = ts(params, state, rest, *_strided((x, y), i))
  nnx.update(ts_model, params, rest)

  _close(numbers(acc_model), numbers(mb_model), rtol=1e-5, atol=1e-6)
  _close(numbers(ts_model), numbers(mb_model), rtol=1e-5, atol=1e-6)
  assert int(mb_model.drop.rngs.count[...]) == K


def test_item12_nnx_batchnorm_in_a_private_function_is_refused():
  def private_loss(model, x, y):
    return _loss(model, x, y)

  private_loss.__dp_private__ = True  # held to the privacy contract, as clipped_grad is
  x, y = _data()
  fun = optax_accum.microbatch(private_loss, K, batch_argnums=(1, 2), reduction="sum")
  with pytest.raises(ValueError, match=r"BatchStat, threaded\): state_argnums .*GroupNorm"):
    fun(BNDrop(nnx.Rngs(0, dropout=1)), x, y)
  fun(Plain(nnx.Rngs(0)), x, y)  # no statistics: nothing threaded from the examples
