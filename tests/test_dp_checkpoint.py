"""A checkpoint saved at a window boundary of a private run holds no un-noised clipped sum.

`accumulate` resets its accumulator lazily (a window's first micro-step ignores what the state
holds), so before this the state saved right after an update kept the closed window's clipped
sums, un-noised (`TrainStep`, with or without an axis, and `accumulate` with ``axis_name``;
`accumulate` on one device wrote the released update over them): with the released update they
give the noise, and the next release's sum (recovered to 3.8e-7 by the review). On a private
path the emitting step now zeroes the spent sums and weight, on every front end that keeps them
across calls: `accumulate` (the device conditional, ``update(emit=True)``, ``axis_name`` inside
`jax.shard_map`) and `TrainStep` (without an axis, with one under plain `jax.jit`, FSDP). A
state saved mid-window still holds the open window's sums: it is secret, as the privacy guide
says. Resuming from a boundary checkpoint is bit-exact. The problem is
`tests/test_dp_contract.py`'s (a clipped loss with the mask, σ > 0, one key for a run and its
resumption).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from test_dp_contract import AX, CLIPPED_LOSS, P0, STEPS, X, Y, inner, mask, mesh8, micro_rows

import optax_accum as oa

M = mask(True)


def _accumulate_windows(windows, *, emit=False, state=None, params=P0):
  """`windows` windows of `accumulate(chain(dp_noise, sgd), STEPS)` in a hand loop, jitted per
  micro-step (`emit`: ``update(emit=...)``, the host's decision): ``(params, state)``."""
  tx = oa.accumulate(inner(), STEPS, reduction="sum")
  grad = jax.grad(CLIPPED_LOSS)

  @functools.partial(jax.jit, static_argnums=5)
  def micro(p, s, x, y, m, last):
    kw = {"emit": last} if emit else {}
    u, s = tx.update(grad(p, x, y, m), s, p, **kw)
    return optax.apply_updates(p, u), s

  s = tx.init(params) if state is None else state
  p = params
  for _ in range(windows):
    for i, rows in enumerate(micro_rows()):
      p, s = micro(p, s, X[rows], Y[rows], M[rows], i == STEPS - 1)
  return p, s


def _train_step_windows(windows, *, state=None, params=P0, **kw):
  step = oa.TrainStep(CLIPPED_LOSS, inner(), STEPS, reduction="sum", donate=False, **kw)
  s = step.init(params) if state is None else state
  p = jax.tree.map(jnp.array, params)
  for _ in range(windows):
    for rows in micro_rows():
      p, s, _ = step(p, s, X[rows], Y[rows], M[rows])
  return p, s


def _assert_spent(state, zero=True):
  """The saved state's sums and weight: all zeros at a boundary (`zero`), else not."""
  state = jax.device_get(state)
  leaves = jax.tree.leaves((state.grad_sum, state.acc_weight))
  held = sum(float(np.abs(np.float64(x)).sum()) for x in leaves)
  assert (held == 0) == zero, f"the saved state's sums and weight hold {held}"


@pytest.mark.parametrize("emit", [False, True], ids=["device conditional", "update(emit=)"])
def test_accumulate_state_saved_after_an_update_holds_no_sums_and_resumes_bit_exactly(emit):
  whole, _ = _accumulate_windows(2, emit=emit)
  p, saved = _accumulate_windows(1, emit=emit)
  saved = jax.device_get(saved)  # the checkpoint, on the host
  _assert_spent(saved)
  assert int(oa.privacy.dp_updates(saved)) == 1
  resumed, _ = _accumulate_windows(1, emit=emit, state=saved, params=p)
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_mid_window_state_holds_the_open_windows_sums():
  """Saved between updates, the state holds the open window's clipped sums: a secret file."""
  tx = oa.accumulate(inner(), STEPS, reduction="sum")
  rows = micro_rows()[0]
  _, state = tx.update(jax.grad(CLIPPED_LOSS)(P0, X[rows], Y[rows], M[rows]), tx.init(P0), P0)
  _assert_spent(state, zero=False)


def test_train_step_state_saved_after_an_update_holds_no_sums_and_resumes_bit_exactly():
  whole, _ = _train_step_windows(2)
  p, saved = _train_step_windows(1)
  saved = jax.device_get(saved)
  _assert_spent(saved)
  resumed, _ = _train_step_windows(1, state=saved, params=p)
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_non_private_state_keeps_its_spent_sums():
  """Only a private path pays the write: a plain accumulate still resets lazily (the closed
  window's sums stay in the state; its compiled programs are unchanged)."""
  tx = oa.accumulate(optax.sgd(1.0), STEPS, reduction="sum")
  state = tx.init(P0)
  for rows in micro_rows():
    _, state = tx.update(jax.grad(lambda p, x, y: jnp.sum(x @ p["w"] - y))(P0, X[rows], Y[rows]),
                         state, P0)  # fmt: skip
  assert bool(oa.has_updated(state))
  _assert_spent(state, zero=False)


@pytest.mark.slow  # 8 devices, a shard_map and a mesh: a few compilations
def test_per_device_states_saved_after_an_update_hold_no_sums():
  """accumulate(axis_name) inside jax.shard_map, TrainStep(axis_name) under plain jit, and FSDP
  (keep_unsharded "nothing" and "params_and_grads"): every device's sums are zeros after the
  update."""
  mesh = mesh8(auto=True)
  tx = oa.accumulate(inner(), STEPS, reduction="sum", axis_name=AX)
  grad = jax.grad(CLIPPED_LOSS)
  pspec = jax.tree.map(lambda _: P(), P0)
  sspec = oa.state_partition_specs(tx, pspec, AX)

  def micro(p, state, x, y, m):
    u, state = tx.update(grad(lax.pcast(p, AX, to="varying"), x, y, m), state, p)
    return optax.apply_updates(p, u), state

  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspec,), out_specs=sspec))
  specs = (pspec, sspec, P(AX), P(AX), P(AX))
  step = jax.jit(jax.shard_map(micro, mesh=mesh, in_specs=specs, out_specs=(pspec, sspec)))
  p, state = P0, init(P0)
  for rows in micro_rows():
    p, state = step(p, state, X[rows], Y[rows], M[rows])
  assert int(oa.privacy.dp_updates(state)) == 1
  _assert_spent(state)

  _, state = _train_step_windows(1, axis_name=AX, mesh=mesh8())
  _assert_spent(state)

  explicit = jax.make_mesh((8,), (AX,), axis_types=(jax.sharding.AxisType.Explicit,))
  rows8 = lambda a: jax.device_put(a, jax.sharding.NamedSharding(explicit, P(AX)))  # noqa: E731
  with jax.set_mesh(explicit):
    params = {"w": rows8(np.pad(P0["w"], (0, 5))), "b": jax.device_put(P0["b"])}
    x8 = np.pad(X, ((0, 0), (0, 5)))
    for keep in ("nothing", "params_and_grads"):
      s = oa.TrainStep(CLIPPED_LOSS, inner(), STEPS, reduction="sum", donate=False,
                       axis_name=AX, keep_unsharded=keep)  # fmt: skip
      state, p = s.init(params), params
      for r in micro_rows():
        p, state, _ = s(p, state, rows8(x8[r]), rows8(Y[r]), rows8(M[r]))
      _assert_spent(state)
