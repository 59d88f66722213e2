"""What a reader of `AccumulateState` sees (issue 34, items 13 and 22).

* Item 13: `optax.MultiSteps`' ``acc_grads`` (a running mean, zeros after an update) is not a
  field here: the weighted sum is ``grad_sum`` (stale when ``mini_step == 0``), a MultiSteps
  name raises an error naming the replacement, and `window_mean_grad` reads the window's mean
  gradient correctly, checked against the k·b large batch's gradient in float64. every_k = 1
  keeps the same state tree (a boolean scalar per leaf, no buffer). A checkpoint written with
  the earlier field name is refused by Orbax, and the migration restores it bit for bit.
* Item 22: the messages name `TrainStep`, `force_emit` takes NumPy and JAX booleans, the
  example's zero flags are argparse errors, and `state_partition_specs` of a factored
  optimizer fits every leaf's rank.
"""

from __future__ import annotations

import importlib.util
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

K, ROWS, D = 4, 6, 5
RNG = np.random.default_rng(34)
X = RNG.normal(size=(K, ROWS, D)).astype(np.float32)
Y = RNG.normal(size=(K, ROWS)).astype(np.float32)
# Real rows per micro-batch (token counts): the large batch averages over real rows only.
MASK = (np.arange(ROWS)[None, :] < np.array([6, 2, 5, 3])[:, None]).astype(np.float32)
W0 = RNG.normal(size=(D,)).astype(np.float32)
B0 = np.float32(0.3)


def loss(params, x, y, mask):
  """Masked mean squared error over the real rows of one micro-batch."""
  r = x @ params["w"] + params["b"] - y
  return jnp.sum(mask * r**2) / jnp.sum(mask)


def large_batch_grad64(rows: slice) -> dict:
  """The gradient of the masked mean over the micro-batches `rows`, all in one batch, in
  float64 NumPy (an independent formula: d/dw, d/db of Σ m r² / Σ m)."""
  x, y, m = (np.asarray(a[rows], np.float64).reshape(-1, *a.shape[2:]) for a in (X, Y, MASK))
  r = x @ W0.astype(np.float64) + np.float64(B0) - y
  return {"w": 2 * x.T @ (m * r) / m.sum(), "b": np.float64(2 * (m * r).sum() / m.sum())}


def norm64(tree: dict) -> float:
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(v, np.float64))) for v in tree.values())))


PARAMS = {"w": jnp.asarray(W0), "b": jnp.asarray(B0)}


SGD1 = optax_accum.accumulate(optax.sgd(1.0), every_k=K)


def _run_window(tx):
  state, out = tx.init(PARAMS), []
  for i in range(K):
    grads = jax.grad(loss)(PARAMS, X[i], Y[i], MASK[i])
    w = jnp.sum(MASK[i])
    mean = jax.jit(optax_accum.window_mean_grad)(state, grads, weight=w)
    updates, state = jax.jit(tx.update)(grads, state, PARAMS, weight=w)
    out.append((mean, updates, state))
  return out


def test_item13_window_mean_grad_is_the_large_batch_gradient_in_float64():
  steps = _run_window(SGD1)
  for i, (mean, _, state) in enumerate(steps):
    # After i + 1 micro-steps: the large batch of those micro-batches' real rows. float32
    # against float64: the sums of 6-30 products of O(1) values round at ~1e-7 relative.
    want = large_batch_grad64(slice(0, i + 1))
    for name in ("w", "b"):
      np.testing.assert_allclose(mean[name], want[name], rtol=2e-6, atol=1e-7)
    assert bool(optax_accum.has_updated(state)) == (i == K - 1)
  # The emitting call: its norm is the large batch's gradient norm, and the very gradient sgd(1)
  # received (the same core functions: equal to the last bit).
  mean, updates, _ = steps[-1]
  np.testing.assert_allclose(norm64(mean), norm64(large_batch_grad64(slice(0, K))), rtol=2e-6)
  jax.tree.map(np.testing.assert_array_equal, mean, jax.tree.map(jnp.negative, updates))


def test_item13_grad_sum_is_a_weighted_sum_and_stale_after_an_update():
  """What the state itself holds, named for what it is: Σ wᵢ gᵢ over the open window (a sum, not
  optax's mean), and after an update neither zeros nor a mean (the reason to read it through
  `window_mean_grad`)."""
  steps = _run_window(SGD1)
  _, _, state = steps[1]  # two micro-batches into the window
  weights = MASK[:2].sum(axis=1).astype(np.float64)
  want_sum = {n: sum(w * large_batch_grad64(slice(j, j + 1))[n] for j, w in enumerate(weights))
              for n in ("w", "b")}  # fmt: skip
  for name in ("w", "b"):
    np.testing.assert_allclose(state.grad_sum[name], want_sum[name], rtol=2e-6, atol=1e-6)
  np.testing.assert_allclose(state.acc_weight, weights.sum())
  _, updates, closed = steps[-1]
  assert int(closed.mini_step) == 0
  # Stale: it holds what the closed window returned, not MultiSteps' zeros.
  assert norm64(closed.grad_sum) > 0
  # ... and the next window starts from nothing: the mean before any micro-step of it is the
  # micro-batch alone, as if the state were fresh.
  g = jax.grad(loss)(PARAMS, X[0], Y[0], MASK[0])
  jax.tree.map(
    np.testing.assert_array_equal,
    optax_accum.window_mean_grad(closed, g, weight=3.0),
    optax_accum.window_mean_grad(SGD1.init(PARAMS), g, weight=3.0),
  )


def test_item13_window_mean_grad_leaves_out_a_nonfinite_micro_batch_as_the_update_does():
  state = SGD1.init(PARAMS)
  good = jax.grad(loss)(PARAMS, X[0], Y[0], MASK[0])
  _, state = SGD1.update(good, state, PARAMS, weight=2.0)
  bad = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), good)
  mean = optax_accum.window_mean_grad(state, bad, weight=5.0)
  jax.tree.map(lambda m, g: np.testing.assert_allclose(m, g, rtol=1e-7), mean, good)


def test_item13_window_mean_grad_at_every_k_1_is_the_gradient_and_finds_a_chained_state():
  tx = optax.chain(optax.clip(10.0), optax_accum.accumulate(optax.sgd(1.0), every_k=1))
  state = tx.init(PARAMS)
  g = jax.grad(loss)(PARAMS, X[1], Y[1], MASK[1])
  mean = optax_accum.window_mean_grad(state, g, weight=2.0)
  jax.tree.map(lambda m, x: np.testing.assert_allclose(m, x, rtol=1e-7), mean, g)
  want = large_batch_grad64(slice(1, 2))
  np.testing.assert_allclose(norm64(mean), norm64(want), rtol=2e-6)


def test_item13_window_mean_grad_refuses_per_device_sums_and_other_trees():
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, axis_name="data")
  per_device = jax.vmap(tx.init, in_axes=None, axis_size=2, axis_name="data")(PARAMS)
  per_device = jax.tree.map(lambda a: a[0], per_device)  # one device's, as inside a map
  with pytest.raises(ValueError, match="window_mean_grad: this state holds per-device sums"):
    optax_accum.window_mean_grad(per_device, PARAMS)
  with pytest.raises(ValueError, match="grads do not match"):
    optax_accum.window_mean_grad(SGD1.init(PARAMS), {"w": PARAMS["w"]})
  with pytest.raises(ValueError, match="weight"):
    optax_accum.window_mean_grad(SGD1.init(PARAMS), PARAMS, weight=-1.0)


@pytest.mark.parametrize("name, replacement", [
  ("acc_grads", r"grad_sum holds the weighted sum .* optax_accum.window_mean_grad\(state, grads\)"),
  ("inner_opt_state", "inner_state"),
  ("skip_state", "num_skipped"),
])  # fmt: skip
def test_item13_multisteps_field_names_raise_naming_the_replacement(name, replacement):
  state = SGD1.init(PARAMS)
  with pytest.raises(AttributeError, match=f"no field '{name}' \\(optax.MultiStepsState's\\)"):
    getattr(state, name)
  with pytest.raises(AttributeError, match=replacement):
    getattr(state, name)
  assert not hasattr(state, name)
  with pytest.raises(AttributeError, match="object has no attribute 'other'"):
    state.other  # noqa: B018  (any other name: Python's own message)


def test_item13_every_k_1_keeps_the_state_tree_of_every_k_4_without_a_buffer():
  one = optax_accum.accumulate(optax.adam(0.1), every_k=1)
  four = optax_accum.accumulate(optax.adam(0.1), every_k=4)
  s1, s4 = one.init(PARAMS), four.init(PARAMS)
  assert jax.tree.structure(s1) == jax.tree.structure(s4)
  # grad_sum: one boolean scalar per leaf (it cannot be read as sums), 1 byte instead of 24.
  assert {(a.shape, a.dtype) for a in jax.tree.leaves(s1.grad_sum)} == {((), np.dtype(bool))}
  assert sum(a.nbytes for a in jax.tree.leaves(s1.grad_sum)) == 2
  # The tree holds across updates (a lax.scan carry), and code written against the tree runs:
  # nanodo's metric mapped over the accumulator and the gradients crashed on None here.
  g = jax.grad(loss)(PARAMS, X[0], Y[0], MASK[0])
  carry, _ = jax.lax.scan(lambda s, _: (one.update(g, s, PARAMS)[1], None), s1, length=3)
  assert jax.tree.structure(carry) == jax.tree.structure(s1)
  assert int(carry.gradient_step) == 3
  jax.tree.map(lambda a, x: a + x, carry.grad_sum, g)
  # Another every_k on a state is still refused (a state knows its window), with the recipe.
  with pytest.raises(ValueError, match=r"made with every_k=1 .*\._replace\(inner_state="):
    four.update(g, s1, PARAMS)
  moved = four.init(PARAMS)._replace(inner_state=carry.inner_state,
                                     gradient_step=carry.gradient_step)  # fmt: skip
  _, moved = four.update(g, moved, PARAMS)
  assert int(moved.mini_step) == 1 and int(moved.gradient_step) == 3


def test_item13_k1_state_partition_specs_fit_every_leaf():
  one = optax_accum.accumulate(optax.adam(0.1), every_k=1)
  specs = optax_accum.state_partition_specs(one, {"w": P("model"), "b": P()}, None)
  assert specs.grad_sum == {"w": P(), "b": P()}  # scalars, replicated
  assert specs.inner_state[0].mu == {"w": P("model"), "b": P()}
  per_device = optax_accum.accumulate(optax.adam(0.1), every_k=1, axis_name="data")
  specs = optax_accum.state_partition_specs(per_device, {"w": P("model"), "b": P()}, "data")
  assert specs.grad_sum == {"w": P("data"), "b": P("data")}  # one scalar per device


@pytest.mark.slow  # Orbax writes to disk
def test_item13_checkpoint_with_the_earlier_field_name_is_refused_then_migrates_bit_for_bit():
  ocp = pytest.importorskip("orbax.checkpoint")
  params, (mean, _, state) = PARAMS, _run_window(SGD1)[1]
  del mean
  path = pathlib.Path(tempfile.mkdtemp()) / "old"
  # The earlier layout, as Orbax stores a NamedTuple: a dict by field name, acc_grads for sums.
  earlier = {("acc_grads" if f == "grad_sum" else f): getattr(state, f) for f in state._fields}
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, {"opt_state": earlier})
  checkpointer.wait_until_finished()
  target = {"opt_state": jax.eval_shape(SGD1.init, params)}
  with pytest.raises(ValueError, match=r"\('opt_state', 'grad_sum', 'b'\) not found"):
    ocp.StandardCheckpointer().restore(path, target)  # a refusal, never a wrong restore
  # The migration (docs/guides/checkpointing.md): restore under the old name, then rename.
  fresh = SGD1.init(params)
  old_target = {("acc_grads" if f == "grad_sum" else f): getattr(fresh, f) for f in fresh._fields}
  restored = ocp.StandardCheckpointer().restore(
    path, {"opt_state": jax.eval_shape(lambda: old_target)}
  )
  fields = dict(restored["opt_state"])
  migrated = fresh._replace(grad_sum=fields.pop("acc_grads"), **fields)
  jax.tree.map(np.testing.assert_array_equal, migrated, state)
  g = jax.grad(loss)(PARAMS, X[2], Y[2], MASK[2])
  jax.tree.map(np.testing.assert_array_equal, SGD1.update(g, migrated, params)[0],
               SGD1.update(g, state, params)[0])  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Item 22.


def test_item22_missing_noise_scale_error_names_train_step():
  inner = optax.chain(optax.scale_by_adam(), optax_accum.scale_by_gain(1e-2, base_weight=1))
  step = optax_accum.TrainStep(loss, inner, every_k=2, donate=False)
  with pytest.raises(ValueError, match=r"^TrainStep\.init: the inner optimizer holds .*"
                                       r"noise_scale=False keeps none"):  # fmt: skip
    step.init(PARAMS)
  with pytest.raises(ValueError, match=r"^accumulate\.init: the inner optimizer holds"):
    optax_accum.accumulate(inner, every_k=2).init(PARAMS)


@pytest.mark.parametrize("flag", [True, np.bool_(True), jnp.asarray(True), np.asarray(True)])
def test_item22_train_step_force_emit_takes_numpy_and_jax_booleans(flag):
  step = optax_accum.TrainStep(loss, optax.sgd(1.0), every_k=K, donate=False)
  state = step.init(PARAMS)
  w = MASK.sum(axis=1)  # token weights: the short window is the large batch of its real rows
  params, state, _ = step(PARAMS, state, X[0], Y[0], MASK[0], weight=w[0])
  params, state, _ = step(params, state, X[1], Y[1], MASK[1], weight=w[1], force_emit=flag)
  assert bool(optax_accum.has_updated(state)) and int(state.mini_step) == 0
  # A short window of two: its mean against the float64 large batch of those two.
  step_taken = {n: PARAMS[n] - params[n] for n in ("w", "b")}
  want = large_batch_grad64(slice(0, 2))
  for name in ("w", "b"):
    np.testing.assert_allclose(step_taken[name], want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flag, got", [
  (1, "int 1"), ("yes", "str 'yes'"), (np.asarray([True]), r"bool\[1\] array"),
  (jnp.asarray(1), r"int32\[\] array"),
])  # fmt: skip
def test_item22_train_step_force_emit_refuses_others_clearly(flag, got):
  step = optax_accum.TrainStep(loss, optax.sgd(1.0), every_k=K, donate=False)
  with pytest.raises(TypeError, match=f"TrainStep: force_emit must be a bool .*, got {got}"):
    step(PARAMS, step.init(PARAMS), X[0], Y[0], MASK[0], force_emit=flag)


@pytest.mark.parametrize("flag", ["--k", "--every", "--rows"])
def test_item22_lm_resume_zero_flags_are_one_line_argparse_errors(flag, tmp_path, capsys):
  path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "lm_resume.py"
  spec = importlib.util.spec_from_file_location("lm_resume_item22", path)
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  with pytest.raises(SystemExit) as exit:
    example.main(["--dir", str(tmp_path / "run"), flag, "0"])
  assert exit.value.code == 2
  err = capsys.readouterr().err
  assert f"error: argument {flag}: must be a positive int, got '0'" in err
  assert "Traceback" not in err


def test_item22_factored_state_specs_fit_each_leaf_rank_without_params():
  params = {"w": jnp.ones((256, 192)), "b": jnp.ones(192)}  # w factored (both dims >= 128)
  tx = optax_accum.accumulate(optax.adafactor(1e-3), every_k=2)
  mesh = jax.make_mesh((1,), ("data",))
  specs = optax_accum.state_partition_specs(tx, {"w": P(None, None), "b": P(None)}, None)
  state = tx.init(params)
  assert state.inner_state[0].v["w"].shape == (1,)  # the factored leaf: a vector
  for spec, leaf in zip(jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)),
                        jax.tree.leaves(state), strict=True):  # fmt: skip
    assert len(spec) <= leaf.ndim, (spec, leaf.shape)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda s: isinstance(s, P))  # fmt: skip
  placed = jax.device_put(state, shardings)  # raised for P(None, None) on a vector
  jax.tree.map(np.testing.assert_array_equal, placed, state)
  # A sharded parameter still keeps its spec on the leaves shaped like it.
  sharded = optax_accum.state_partition_specs(
    tx, {"w": P(None, "data"), "b": P(None)}, None, params=params
  )
  assert sharded.grad_sum == {"w": P(None, "data"), "b": P(None)}
