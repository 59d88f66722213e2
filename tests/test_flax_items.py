"""Issue 34's Flax items (12, 14, 15, 16 and the Flax parts of 19), each against an independent
reference: the same NNX model run micro-batch by micro-batch in a Python loop, the k·b large
batch, or the window without the dropped micro-batch.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

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
