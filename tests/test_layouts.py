"""Every parallel layout (issue 24): {Auto, Explicit, shard_map} × {1-D, data × model, data × fsdp}
× {accumulate, TrainStep, microbatch} × {adam, adafactor, masked, lookahead}.

Each cell trains one update of a tiny tensor-parallel (or FSDP-sharded) MLP from ``K``
micro-batches and compares the parameters with the large batch computed independently on one
device (a direct `jax.grad` of the loss over all ``K·b`` rows, then one plain optax step), and
counts the gradient-sized all-reduces over the data axis in the compiled programs: one per
update, none in the accumulating program or inside `microbatch`'s loop. A cell that cannot give
that result raises a clear error naming what to do instead (`EXPECTED_ERRORS`); no cell may
raise anything else.

How each front end is driven per mode:

* Auto / Explicit (plain `jax.jit`, `jax.set_mesh`): `accumulate(axis_name="data")` in a step
  bound by `data_parallel` (dynamic emission), `TrainStep(axis_name="data")` (its two static
  programs), `microbatch(axis_name="data")` then the optimizer, all under one jit. The model axis
  ("model", or "fsdp") is automatic: GSPMD partitions the model.
* shard_map (every mesh axis manual): the loss is written with its own collectives (a psum over
  "model", an all_gather over "fsdp"); `accumulate(axis_name="data")` inside the map;
  `microbatch(axis_name="data")` inside the map for the gradient, the optimizer under plain jit
  outside it (see `EXPECTED_ERRORS` for why an optimizer with per-shard statistics cannot run
  inside); `TrainStep` is a host-side driver and says so.
"""

from __future__ import annotations

import functools
import re

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
from optax_accum import accumulate, data_parallel, microbatch, state_partition_specs
from optax_accum.core._hlo import computations, placements, reachable

AX = "data"
K = 2  # micro-batches per update
ROWS = 16  # rows per micro-batch (global): divides over 8 devices
D_IN, HIDDEN, D_OUT = 4, 8, 2
# Adam's first step is ~lr·g/|g|: where a gradient entry is tiny, summing device pieces in another
# order than the large batch moves its update by ~1e-5 relative (as in tests/test_gspmd.py).
TOL = dict(rtol=2e-5, atol=2e-6)

LAYOUTS = {  # mesh shape, axis names, the batch's spec entry, parameter specs
  "1d": ((8,), (AX,), AX, dict(w0=P(), b0=P(), w1=P(), b1=P())),
  "model": (
    (4, 2),
    (AX, "model"),
    AX,
    dict(w0=P(None, "model"), b0=P("model"), w1=P("model", None), b1=P()),
  ),
  "fsdp": (
    (4, 2),
    (AX, "fsdp"),
    (AX, "fsdp"),
    dict(w0=P("fsdp", None), b0=P(), w1=P("fsdp"), b1=P()),
  ),
}
MODES = ("auto", "explicit", "shard_map")
FRONTS = ("accumulate", "TrainStep", "microbatch")
MASK = dict(w0=True, b0=False, w1=True, b1=False)
INNERS = {
  "adam": lambda: optax.adam(1e-2),
  "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
  "masked": lambda: optax.masked(optax.adam(1e-2), MASK),
  "lookahead": lambda: optax.lookahead(optax.adam(1e-2), sync_period=1, slow_step_size=0.5),
}

# The cells that raise, and what their error must say (the instead).
EXPECTED_ERRORS = {
  # TrainStep compiles and dispatches its own programs from the host.
  **{
    ("shard_map", lay, "TrainStep", opt): (TypeError, "TrainStep is a host-side driver")
    for lay in LAYOUTS
    for opt in INNERS
  },
  # Inside shard_map an optimizer sees one shard of a sharded parameter: adafactor's factored
  # moments would be per-shard statistics (plain optax.adafactor in the same map is not the
  # one-device result either). accumulate detects the new per-shard variance and says where to
  # run the update instead.
  ("shard_map", "model", "accumulate", "adafactor"): (ValueError, "Run the update where the model"),
  ("shard_map", "fsdp", "accumulate", "adafactor"): (ValueError, "Run the update where the model"),
}


# ----------------------------------------------------------------------------------------------
# The model, its losses and the large batch.


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return dict(
    w0=rng.standard_normal((D_IN, HIDDEN)).astype(np.float32) * 0.5,
    b0=rng.standard_normal(HIDDEN).astype(np.float32) * 0.1,
    w1=rng.standard_normal((HIDDEN, D_OUT)).astype(np.float32) * 0.5,
    b1=rng.standard_normal(D_OUT).astype(np.float32) * 0.1,
  )


def _data(seed=1):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((K * ROWS, D_IN)).astype(np.float32)
  y = rng.standard_normal((K * ROWS, D_OUT)).astype(np.float32)
  return x, y


def _fast(p):
  return p.fast if isinstance(p, optax.LookaheadParams) else p


def _with_lookahead(p, opt):
  return optax.LookaheadParams(p, p) if opt == "lookahead" else p


def _loss(p, x, y):
  """The one-device loss (and the plain-jit loss under Auto axes)."""
  h = jnp.tanh(x @ p["w0"] + p["b0"])
  return jnp.mean(jnp.sum((h @ p["w1"] + p["b1"] - y) ** 2, axis=-1))


def _explicit_loss(p, x, y, layout):
  """The same loss on an Explicit mesh: each contraction over a sharded dimension says where its
  result goes, with the batch entry taken from the value's own type (right under plain jit,
  where it names the data axis, and inside the binding, where the data axis is Manual)."""

  def mm(a, b, last=None):
    return jnp.matmul(a, b, out_sharding=P(jax.typeof(a).sharding.spec[0], last))

  h = jnp.tanh(mm(x, p["w0"], "model" if layout == "model" else None) + p["b0"])
  return jnp.mean(jnp.sum((mm(h, p["w1"]) + p["b1"] - y) ** 2, axis=-1))


def _manual_loss(p, x, y, layout):
  """The same loss inside a shard_map that is manual over every mesh axis, written with its own
  collectives: the hidden layer's partial products summed over "model"; FSDP weights gathered
  over "fsdp" (the gradient's transpose is a reduce-scatter: the loss is pre-divided so that it
  gives the mean over the fsdp devices' rows)."""
  w0, w1 = p["w0"], p["w1"]
  if layout == "fsdp":
    w0 = lax.all_gather(w0, "fsdp", tiled=True)
    w1 = lax.all_gather(w1, "fsdp", tiled=True)
  out = jnp.tanh(x @ w0 + p["b0"]) @ w1
  if layout == "model":
    out = lax.psum(out, "model")
  loss = jnp.mean(jnp.sum((out + p["b1"] - y) ** 2, axis=-1))
  return loss / lax.axis_size("fsdp") if layout == "fsdp" else loss


@functools.cache
def _large_batch(opt):
  """One plain optax step on the whole batch, on one device."""
  inner = INNERS[opt]()
  params = _with_lookahead(_params(), opt)
  x, y = _data()
  grads = jax.grad(_loss)(_fast(params), x, y)
  updates, _ = inner.update(grads, inner.init(params), params)
  return jax.device_get(optax.apply_updates(params, updates))


# ----------------------------------------------------------------------------------------------
# Reading the compiled programs: gradient-sized all-reduces over the data axis.


def _data_reductions(text: str, mesh, branches: bool = True) -> dict[str, int]:
  """{"all": n, "loop": n}: array-shaped all-reduces whose groups span the data axis (devices
  that differ in their data coordinate), in the whole program and inside while bodies. Scalar
  ones (weights, counts, the drop decision) are bookkeeping and not counted. `branches=False`:
  those inside a conditional's branches (run only when taken) neither."""
  comps, entry = computations(text)
  where = placements(comps, entry)[0]
  loops = reachable(
    comps, [c for ins in comps.values() for i in ins if i.op == "while" for c in _callees(i)]
  )
  coord = {
    int(d): idx[0] for idx, d in np.ndenumerate(np.arange(mesh.size).reshape(mesh.devices.shape))
  }
  out = {"all": 0, "loop": 0}
  for name in reachable(comps, [entry]):
    if not branches and where.get(name) == "cond":
      continue
    for i in comps[name]:
      if i.op not in ("all-reduce", "all-reduce-start") or not re.search(r"\[\d", i.shape):
        continue
      if any(len({coord[d] for d in g}) > 1 for g in ref.replica_groups(i.rest)):
        out["all"] += 1
        out["loop"] += name in loops
  return out


def _callees(ins):
  from optax_accum.core._hlo import callees

  return callees(ins)


# ----------------------------------------------------------------------------------------------
# One cell.


class Cell:
  def __init__(self, mode, layout, opt):
    shape, names, self.batch_entry, specs = LAYOUTS[layout]
    types = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    self.mode, self.layout, self.opt = mode, layout, opt
    self.mesh = jax.make_mesh(shape, names, axis_types=(types,) * len(shape))
    self.pspecs = _with_lookahead(specs, opt)
    self.shardings = jax.tree.map(
      lambda s: NamedSharding(self.mesh, s), self.pspecs, is_leaf=lambda s: isinstance(s, P)
    )
    self.bspec = P(self.batch_entry)
    self.inner = INNERS[opt]()
    self.host_params = _with_lookahead(_params(), opt)

  def loss(self, p, x, y):
    if self.mode == "shard_map":
      return _manual_loss(p, x, y, self.layout)
    if self.mode == "explicit":
      return _explicit_loss(p, x, y, self.layout)
    return _loss(p, x, y)

  def put(self, tree, spec_tree):
    return jax.device_put(tree, spec_tree)

  def params(self):
    return jax.device_put(self.host_params, self.shardings)

  def batches(self):
    x, y = _data()
    put = lambda a: jax.device_put(a, NamedSharding(self.mesh, self.bspec))  # noqa: E731
    return [
      (put(x[i * ROWS : (i + 1) * ROWS]), put(y[i * ROWS : (i + 1) * ROWS])) for i in range(K)
    ]

  def whole_batch(self):
    x, y = _data()
    put = lambda a: jax.device_put(a, NamedSharding(self.mesh, self.bspec))  # noqa: E731
    return put(x), put(y)

  def sm(self, f, in_specs, out_specs):
    return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)


def _run_accumulate(c: Cell):
  tx = accumulate(c.inner, K, axis_name=AX)
  sspecs = state_partition_specs(tx, c.pspecs, AX, params=c.host_params)

  def train_step(p, s, x, y):
    g = jax.grad(c.loss)(_fast(lax.pcast(p, AX, to="varying")), x, y)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  if c.mode == "shard_map":
    init = jax.jit(c.sm(tx.init, (c.pspecs,), sspecs))
    step = jax.jit(c.sm(train_step, (c.pspecs, sspecs, c.bspec, c.bspec), (c.pspecs, sspecs)))
  else:
    sshard = jax.tree.map(
      lambda s: NamedSharding(c.mesh, s), sspecs, is_leaf=lambda s: isinstance(s, P)
    )
    init = jax.jit(data_parallel(tx.init, AX), out_shardings=sshard)
    step = jax.jit(
      data_parallel(train_step, AX, batch_argnums=(2, 3)), out_shardings=(c.shardings, sshard)
    )
  p = c.params()
  state = init(p)
  batches = c.batches()
  compiled = step.lower(p, state, *batches[0]).compile()
  for x, y in batches:
    p, state = compiled(p, state, x, y)
  text = compiled.as_text()
  assert int(state.gradient_step) == 1
  counts = _data_reductions(text, c.mesh)
  assert counts["all"] == 1, counts  # one program (the device conditional): one reduction
  return p


def _run_train_step(c: Cell):
  step = optax_accum.TrainStep(c.loss, c.inner, K, axis_name=AX)
  p = c.params()
  batches = c.batches()
  if c.mode == "shard_map":
    # The user's attempt: the driver inside the map (it refuses before it reads the state).
    c.sm(lambda p, x, y: step(p, None, x, y)[2], (c.pspecs, c.bspec, c.bspec), P())(p, *batches[0])
    raise AssertionError("unreachable")
  state = step.init(p)
  texts = [step.lower(p, state, *batches[0], emit=e).compile().as_text() for e in (False, True)]
  for x, y in batches:
    p, state, _ = step(p, state, x, y)
  accumulating, emitting = (_data_reductions(t, c.mesh, branches=False) for t in texts)
  # the emitting program's one (XLA:CPU combines its per-leaf all-reduces); its conditional's
  # exact one, taken only if a device dropped the last micro-batch, is not counted
  assert accumulating["all"] == 0 and emitting["all"] == 1, (accumulating, emitting)
  return p


def _run_microbatch(c: Cell):
  vg = microbatch(jax.value_and_grad(c.loss), K, batch_argnums=(1, 2), axis_name=AX)
  inner = c.inner

  def apply(p, s, g):
    u, s = inner.update(g, s, p)
    return optax.apply_updates(p, u), s

  if c.mode == "shard_map":
    # The gradient inside the map (reduced over the data axis once, after the loop); the
    # optimizer under plain jit, where GSPMD sees whole parameters.
    fast_specs = _fast(c.pspecs)
    grad = c.sm(lambda p, x, y: vg(_fast(p), x, y)[1], (c.pspecs, c.bspec, c.bspec), fast_specs)

    def step(p, s, x, y):
      return apply(p, s, grad(p, x, y))
  else:

    def step(p, s, x, y):
      _, g = vg(_fast(p), x, y)
      return apply(p, s, g)

  with jax.set_mesh(c.mesh):
    p = c.params()
    s = jax.jit(inner.init)(p)
    x, y = c.whole_batch()
    compiled = jax.jit(step).lower(p, s, x, y).compile()
    p, _ = compiled(p, s, x, y)
  text = compiled.as_text()
  counts = _data_reductions(text, c.mesh)
  assert counts == {"all": 1, "loop": 0}, counts
  return p


RUN = {"accumulate": _run_accumulate, "TrainStep": _run_train_step, "microbatch": _run_microbatch}


def _cell(mode, layout, front, opt):
  c = Cell(mode, layout, opt)
  if front == "microbatch" or mode == "shard_map":
    return RUN[front](c)
  with jax.set_mesh(c.mesh):
    return RUN[front](c)


def _cells():
  """Every cell. The fast suite runs one optimizer per (mode, layout, front end), rotating so
  that each optimizer meets every mode, layout and front end there; the rest are marked slow, and
  `matrix` (the minimum-versions run leaves them out: the fast cells cover every mode, layout,
  front end and optimizer there)."""
  cells = []
  for m, mode in enumerate(MODES):
    for lay, layout in enumerate(LAYOUTS):
      for f, front in enumerate(FRONTS):
        for o, opt in enumerate(INNERS):
          marks = () if o == (m + lay + f) % len(INNERS) else (pytest.mark.slow, pytest.mark.matrix)
          name = f"{mode}-{layout}-{front}-{opt}"
          cells.append(pytest.param(mode, layout, front, opt, marks=marks, id=name))
  return cells


@pytest.mark.parametrize(("mode", "layout", "front", "opt"), _cells())
def test_layouts_matrix_cell_matches_large_batch_or_raises_clearly(mode, layout, front, opt):
  expected = EXPECTED_ERRORS.get((mode, layout, front, opt))
  if expected is not None:
    with pytest.raises(expected[0], match=expected[1]):
      _cell(mode, layout, front, opt)
    return
  got = _cell(mode, layout, front, opt)
  chex.assert_trees_all_close(jax.device_get(got), _large_batch(opt), **TOL)
