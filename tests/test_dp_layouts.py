"""DP-SGD on every layout (issue 31): the per-example norm is global, the noise independent.

The model is a tiny tensor-parallel MLP (w0 and b0 split by columns over "model", w1 by rows,
b1 replicated), or the same MLP FSDP-sharded. Each layout computes one private update,
``(Σᵢ clip_C(∇ℓᵢ) + σ·C·ξ) / B``, through the in-step front end
(``microbatch(clipped_grad, K, reduction="sum")`` then `dp_noise`) and the across-steps one
(`accumulate(dp_noise, K, reduction="sum")` inside `shard_map`, `TrainStep(..., reduction="sum")`
under plain `jax.jit`), on 8 host CPU devices:

* one device; ``shard_map`` over ("data",) 8; over ("data", "model") (4, 2) and (2, 4), the loss
  written with its own psum over "model"; plain ``jax.jit`` with a (4, 2) ("data", "model") mesh,
  Auto and Explicit axes; plain ``jax.jit`` with a (4, 2) ("data", "fsdp") mesh (FSDP).

σ = 0: the update equals the one-device float64 reference Σᵢ clip_C(gᵢ) / B
(`test_dp_clipping.reference_sum`: one `jax.grad` per example, clipped and summed in float64) to
2e-6 of its scale, with C the median per-example norm (half the examples clipped). The per-shard
clipping the library did before (each model shard clipped to C on its own) is 100× that
tolerance away from it, so the comparison can fail.

σ > 0 (σ = 1.3): inside ``shard_map`` each device's piece of the update is returned. Over
``SEEDS = 200`` keys, the noise (update minus the σ = 0 update) has per-coordinate std σC/B:
pooled over the 58 coordinates, 11,600 draws, whose std has a standard error of
1/√(2·11600) = 0.66%: the tolerance is 3 SE (2%), with a control 4% low and high. Two model
shards of a sharded leaf draw uncorrelated noise: |corr| < 0.07 over the sharded leaves'
coordinates pooled, ≥ 2,800 pairs per two shards (3 SE = 3/√2800 = 0.057; identical noise on
the shards, the bug, gives 1). Every data device holds the same noise, bit for bit, and every
model device the same noise for the replicated leaf. Under plain ``jax.jit`` a leaf is one global
array drawn whole: its noise equals the one-device draw of the same key (to float32 rounding of
the sums it is added to), so it has the one-device statistics, measured here over the same
seeds.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, NamedTuple

import _reference as ref
import _stats as stats
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_dp_clipping import assert_close, per_example_grads, reference_sum

import optax_accum as oa
from optax_accum import privacy

AX = "data"
N = 32  # the logical batch, B
K = 2  # micro-batches (in one step) or micro-steps (across steps) per update
D_IN, HIDDEN, D_OUT = 4, 8, 2
SIGMA = 1.3
SEEDS = 200
CORR_TOL = 0.07  # |corr| between two model shards' noise: 3 SE ≤ 3/√2800 = 0.057

MODEL_SPECS = dict(w0=P(None, "model"), b0=P("model"), w1=P("model", None), b1=P())
FSDP_SPECS = dict(w0=P("fsdp", None), b0=P(), w1=P("fsdp"), b1=P())


def _params():
  rng = np.random.default_rng(0)
  return dict(
    w0=(rng.standard_normal((D_IN, HIDDEN)) * 0.5).astype(np.float32),
    b0=(rng.standard_normal(HIDDEN) * 0.1).astype(np.float32),
    w1=(rng.standard_normal((HIDDEN, D_OUT)) * 0.5).astype(np.float32),
    b1=(rng.standard_normal(D_OUT) * 0.1).astype(np.float32),
  )


def _batch():
  rng = np.random.default_rng(1)
  return dict(
    x=rng.standard_normal((N, D_IN)).astype(np.float32),
    y=rng.standard_normal((N, D_OUT)).astype(np.float32),
  )


def loss(p, b):
  """The one-device loss (and plain jit's under Auto axes): squared error, batch mean."""
  h = jnp.tanh(b["x"] @ p["w0"] + p["b0"])
  return jnp.mean(jnp.sum((h @ p["w1"] + p["b1"] - b["y"]) ** 2, axis=-1))


def manual_loss(p, b):
  """The same loss inside a shard_map manual over "model": the column shard's partial
  products summed over "model"."""
  h = jnp.tanh(b["x"] @ p["w0"] + p["b0"])
  out = lax.psum(h @ p["w1"], "model")
  return jnp.mean(jnp.sum((out + p["b1"] - b["y"]) ** 2, axis=-1))


def explicit_loss(p, b):
  """The same loss on an Explicit (data, model) mesh: the hidden layer's sharding is said."""

  def mm(a, w, last=None):
    return jnp.matmul(a, w, out_sharding=P(jax.typeof(a).sharding.spec[0], last))

  h = jnp.tanh(mm(b["x"], p["w0"], "model") + p["b0"])
  return jnp.mean(jnp.sum((mm(h, p["w1"]) + p["b1"] - b["y"]) ** 2, axis=-1))


def fsdp_manual_loss(p, b):
  """FSDP written by hand inside shard_map: weights gathered over "fsdp" (refused)."""
  w0 = lax.all_gather(p["w0"], "fsdp", tiled=True)
  w1 = lax.all_gather(p["w1"], "fsdp", tiled=True)
  h = jnp.tanh(b["x"] @ w0 + p["b0"])
  return jnp.mean(jnp.sum((h @ w1 + p["b1"] - b["y"]) ** 2, axis=-1))


@functools.cache
def problem():
  """Parameters, batch, the clip norm (the median per-example norm) and the expected update."""
  params, batch = _params(), _batch()
  grads = per_example_grads(params, batch, loss)
  norms = [np.sqrt(sum(np.sum(v**2) for v in g.values())) for g in grads]
  clip = float(np.median(norms))
  expected = {k: v / N for k, v in reference_sum(params, batch, clip, loss=loss).items()}
  return params, batch, clip, expected


def per_shard_reference(shards: int) -> dict:
  """What clipping each model shard on its own gives (the bug): Σᵢ per-shard clip_C / B."""
  params, batch, clip, _ = problem()
  split = dict(w0=1, b0=0, w1=0)  # the axis each sharded leaf is split along
  total = {k: np.zeros(v.shape) for k, v in params.items()}
  for g in per_example_grads(params, batch, loss):
    pieces = {k: np.split(g[k], shards, axis=a) for k, a in split.items()}
    for s in range(shards):
      norm = np.sqrt(sum(np.sum(p[s] ** 2) for p in pieces.values()) + np.sum(g["b1"] ** 2))
      scale = min(1.0, clip / norm)
      for k, a in split.items():
        idx = [slice(None)] * g[k].ndim
        step = g[k].shape[a] // shards
        idx[a] = slice(s * step, (s + 1) * step)
        total[k][tuple(idx)] += scale * pieces[k][s]
    total["b1"] += min(1.0, clip / np.sqrt(sum(np.sum(v**2) for v in g.values()))) * g["b1"]
  return {k: v / N for k, v in total.items()}


def _key(seed):
  return jax.random.key(10_000 + seed)


def _noise(sigma, seed=0):
  _, _, clip, _ = problem()
  return privacy.dp_noise(sigma, clip, float(N), _key(seed), allow_key_reuse=True)


def _state_with_key(tx, params, seed):
  """`tx`'s initial state with the noise stream of `seed` (one compiled program for all
  seeds): the key is not in the state, so each seed starts at its own update count,
  ``fold_in(key, 1000·seed)`` (as independent a stream as another key's)."""
  return optax.tree_utils.tree_set(tx.init(params), count=jnp.int32(1000 * seed))


class Recorded(NamedTuple):
  """`Record`'s state: the last update it was given."""

  update: Any


def Record() -> optax.GradientTransformation:  # noqa: N802 (reads as the transformation)
  """An inner step that keeps the update it is given in its state and applies nothing: what
  `TrainStep` computed, read back exactly (not through ``p − (p − u)``)."""
  return optax.GradientTransformation(
    lambda p: Recorded(jax.tree.map(jnp.zeros_like, p)),
    lambda u, s, p=None: (jax.tree.map(jnp.zeros_like, u), Recorded(u)),
  )


def recorded(state: Any) -> Any:
  """The update `Record` kept, found anywhere in an optimizer state."""
  (found,) = [
    x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, Recorded))
    if isinstance(x, Recorded)
  ]  # fmt: skip
  return found.update


# ----------------------------------------------------------------------------------------------
# The layouts: each returns the update of one logical batch (a global tree) and, inside
# shard_map, each device's piece of it (stacked over the devices, mesh order).


def _sm_mesh(shape):
  return jax.make_mesh(shape, (AX, "model")[: len(shape)])


def _device_pieces(tree, axes):
  return jax.tree.map(lambda u: u[None], _all_varying(tree, axes))


def _missing(x, axes):
  have = oa.parallel._collectives.vma(x)
  return tuple(a for a in axes if a not in have)


def _all_varying(tree, axes):
  return jax.tree.map(
    lambda u: lax.pcast(u, _missing(u, axes), to="varying") if _missing(u, axes) else u, tree
  )


def run_shard_map(shape, front, sigma, seeds=(0,), batches=None):
  """The update inside shard_map over `shape` ((8,) data, or (d, m) data × model), for each of
  `batches` (default: the problem's batch) and each seed, in that order: one compilation."""
  params, batch, clip, _ = problem()
  mesh = _sm_mesh(shape)
  axes = tuple(mesh.axis_names)
  specs = MODEL_SPECS if len(shape) == 2 else jax.tree.map(lambda _: P(), params)
  fn = manual_loss if len(shape) == 2 else loss
  tx = _noise(sigma)
  if front == "microbatch":
    summed = oa.microbatch(
      privacy.clipped_grad(fn, clip, mask_argnum=None), K, reduction="sum", axis_name=AX
    )

    def step(p, s, b):
      u, _ = tx.update(summed(p, b), s, p)
      return u, _device_pieces(u, axes)

    sspecs = jax.tree.map(lambda _: P(), tx.init(params))
    micro = lambda b: [b]  # noqa: E731
  else:
    tx = oa.accumulate(tx, K, reduction="sum", axis_name=AX)
    grad = jax.grad(privacy.clipped_loss(fn, clip, mask_argnum=None))

    def step(p, s, b):
      u, s = tx.update(grad(lax.pcast(p, AX, to="varying"), b), s, p)
      return (u, _device_pieces(u, axes)), s

    sspecs = oa.state_partition_specs(tx, specs, AX, params=params)
    micro = lambda b: ref.split(b, K)  # noqa: E731
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=sspecs))
  out = (specs, P(axes))
  prog = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(specs, sspecs, P(AX)),
      out_specs=out if front == "microbatch" else (out, sspecs),
    )
  )
  p = ref.shard(params, mesh, P()) if len(shape) == 1 else _put(params, mesh, specs)
  results = []
  for b, seed in itertools.product(batches or [batch], seeds):
    state = init(p)
    state = optax.tree_utils.tree_set(state, count=jnp.int32(1000 * seed))  # the seed's stream
    for mb in micro(b):
      r = prog(p, state, ref.shard(mb, mesh, P(AX)))
      if front != "microbatch":
        r, state = r
    results.append(jax.device_get(r))
  return results


def _put(tree, mesh, specs):
  return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def run_jit(kind, front, sigma, seeds=(0,), batches=None):
  """The update under plain jax.jit with a (4, 2) mesh: "auto", "explicit" (data × model) or
  "fsdp" (data × fsdp, Auto), for each of `batches` (default: the problem's batch) and each
  seed, in that order: one compilation."""
  params, batch, clip, _ = problem()
  second = "fsdp" if kind == "fsdp" else "model"
  types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,) * 2
  mesh = jax.make_mesh((4, 2), (AX, second), axis_types=types)
  specs = FSDP_SPECS if kind == "fsdp" else MODEL_SPECS
  bspec = P((AX, "fsdp")) if kind == "fsdp" else P(AX)
  fn = explicit_loss if kind == "explicit" else loss
  out = []
  with jax.set_mesh(mesh):
    p = _put(params, mesh, specs)
    if front == "microbatch":
      tx = _noise(sigma)
      summed = oa.microbatch(
        privacy.clipped_grad(fn, clip, mask_argnum=None), K, reduction="sum", axis_name=AX
      )

      @jax.jit
      def step(p, s, b):
        return tx.update(summed(p, b), s, p)[0]

      for b, seed in itertools.product(batches or [batch], seeds):
        b = jax.device_put(b, NamedSharding(mesh, bspec))
        out.append(jax.device_get(step(p, _state_with_key(tx, params, seed), b)))
    else:
      inner = optax.chain(_noise(sigma), Record())
      train = oa.TrainStep(
        privacy.clipped_loss(fn, clip, mask_argnum=None), inner, every_k=K, reduction="sum",
        axis_name=AX, donate=False,
      )  # fmt: skip
      for b, seed in itertools.product(batches or [batch], seeds):
        state = optax.tree_utils.tree_set(train.init(p), count=jnp.int32(1000 * seed))
        for mb in ref.split(b, K):
          _, state, _ = train(p, state, jax.device_put(mb, NamedSharding(mesh, bspec)))
        out.append(jax.device_get(recorded(state)))
  return out


def run_one_device(front, sigma, seeds=(0,)):
  params, batch, clip, _ = problem()
  out = []
  if front == "microbatch":
    tx = _noise(sigma)
    summed = oa.microbatch(privacy.clipped_grad(loss, clip, mask_argnum=None), K, reduction="sum")
    step = jax.jit(lambda p, s, b: tx.update(summed(p, b), s, p)[0])
    for seed in seeds:
      out.append(jax.device_get(step(params, _state_with_key(tx, params, seed), batch)))
  else:
    tx = oa.accumulate(_noise(sigma), K, reduction="sum")
    grad = jax.grad(privacy.clipped_loss(loss, clip, mask_argnum=None))
    step = jax.jit(lambda p, s, b: tx.update(grad(p, b), s, p))
    for seed in seeds:
      state = _state_with_key(tx, params, seed)
      for mb in ref.split(batch, K):
        u, state = step(params, state, mb)
      out.append(jax.device_get(u))
  return out


LAYOUTS = {
  "one-device": lambda front, sigma, seeds=(0,): run_one_device(front, sigma, seeds),
  "shard_map-data": functools.partial(run_shard_map, (8,)),
  "shard_map-data4-model2": functools.partial(run_shard_map, (4, 2)),
  "shard_map-data2-model4": functools.partial(run_shard_map, (2, 4)),
  "jit-auto-data-model": functools.partial(run_jit, "auto"),
  "jit-explicit-data-model": functools.partial(run_jit, "explicit"),
  "jit-fsdp": functools.partial(run_jit, "fsdp"),
}


@functools.cache
def run(layout, front, sigma, seeds=(0,)):
  """`LAYOUTS[layout]`, once per process for each arguments (the σ = 0 runs serve twice)."""
  return LAYOUTS[layout](front, sigma, seeds)


def _update(result):
  return result[0] if isinstance(result, tuple) else result


# ----------------------------------------------------------------------------------------------
# σ = 0: the global clip.


@pytest.mark.parametrize("front", ["microbatch", "accumulate"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dp_layout_clipped_sum_matches_one_device_float64_reference(layout, front):
  _, _, _, expected = problem()
  (result,) = run(layout, front, 0.0)
  assert_close(_update(result), expected)


def test_dp_layout_reference_tells_global_from_per_shard_clipping():
  _, _, _, expected = problem()
  for shards in (2, 4):
    scale = max(np.max(np.abs(v)) for v in expected.values())
    assert ref.max_abs_diff(per_shard_reference(shards), expected) > 100 * 2e-6 * scale


def test_dp_layout_fsdp_inside_shard_map_is_refused():
  params, batch, clip, _ = problem()
  mesh = jax.make_mesh((4, 2), (AX, "fsdp"))
  f = privacy.clipped_grad(fsdp_manual_loss, clip, mask_argnum=None)
  prog = jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=(FSDP_SPECS, P((AX, "fsdp"))), out_specs=FSDP_SPECS)
  )
  with pytest.raises(
    ValueError, match=r"clipped_grad: the loss has a `all_gather` over \('fsdp',\)"
  ):
    prog(_put(params, mesh, FSDP_SPECS), ref.shard(batch, mesh, P((AX, "fsdp"))))


def sync_batch_norm_loss(p, b):
  """The inputs normalised with the statistics of the whole batch across the data axis, as
  BatchNorm with ``axis_name=`` does: each example's value depends on other devices' examples."""
  mu = lax.pmean(jnp.mean(b["x"], axis=0), AX)
  h = jnp.tanh((b["x"] - mu) @ p["w0"] + p["b0"])
  return jnp.mean(jnp.sum((h @ p["w1"] + p["b1"] - b["y"]) ** 2, axis=-1))


def test_dp_a_batch_statistic_across_the_data_axis_is_refused():
  """A `pmean` over the data axis inside the loss (sync BatchNorm) let one example reach every
  device's per-example gradients: 5.9 (shard_map) and 6.7 (`Mechanism.train_step` with an
  axis) against the replace-one bound 2. Refused in both, naming the batch statistic; the
  same loss with the local mean trains."""
  params, batch, clip, _ = problem()
  mesh = jax.make_mesh((8,), (AX,))
  f = privacy.clipped_grad(sync_batch_norm_loss, clip, mask_argnum=None)
  prog = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P(AX)), out_specs=P()))
  refused = r"clipped_grad: the loss has a `psum \(or pmean\)` over \('data',\).*BatchNorm"
  with pytest.raises(ValueError, match=refused):
    prog(_put(params, mesh, P()), ref.shard(batch, mesh, P(AX)))
  sampler = privacy.PoissonSampler(1024, N / 1024, N // K, seed=0)
  mech = privacy.Mechanism(sync_batch_norm_loss, clip, sampler=sampler, key=jax.random.key(91),
                           noise_multiplier=1.0)  # fmt: skip
  step = mech.train_step(optax.sgd(0.1), axis_name=AX, mesh=mesh, donate=False)
  state = step.init(params)
  mask = np.ones(N // K, np.float32)
  rows = jax.tree.map(lambda v: v[: N // K], batch)
  with pytest.raises(ValueError, match=refused):
    step(params, state, rows, mask, force_emit=True)


def local_batch_norm_loss(p, b):
  """`sync_batch_norm_loss` normalised per example (over its features, as LayerNorm does)."""
  h = jnp.tanh((b["x"] - jnp.mean(b["x"], axis=-1, keepdims=True)) @ p["w0"] + p["b0"])
  return jnp.mean(jnp.sum((h @ p["w1"] + p["b1"] - b["y"]) ** 2, axis=-1))


def test_dp_the_same_loss_with_local_statistics_trains():
  params, batch, clip, _ = problem()
  mesh = jax.make_mesh((8,), (AX,))
  sampler = privacy.PoissonSampler(1024, N / 1024, N // K, seed=0)
  mech = privacy.Mechanism(local_batch_norm_loss, clip, sampler=sampler,
                           key=jax.random.key(92), noise_multiplier=1.0)  # fmt: skip
  step = mech.train_step(optax.sgd(0.1), axis_name=AX, mesh=mesh, donate=False)
  rows = jax.tree.map(lambda v: v[: N // K], batch)
  new, state, _ = step(params, step.init(params), rows, np.ones(N // K, np.float32),
                       force_emit=True)  # fmt: skip
  assert int(privacy.dp_updates(state)) == 1
  assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(new))


# ----------------------------------------------------------------------------------------------
# σ > 0: the noise.


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(tree[k], np.float64)) for k in sorted(tree)])


@functools.cache
def noise_samples(layout, front):
  """(SEEDS, 58) global noise draws, and the raw per-seed results."""
  clean = _update(run(layout, front, 0.0)[0])
  runs = run(layout, front, SIGMA, tuple(range(SEEDS)))
  z = np.stack([_flat(_update(r)) - _flat(clean) for r in runs])
  return z, runs


def _check_std(z):
  # 11,600 draws: the std estimate's standard error is 1/√(2·11600) = 0.66 %, the tolerance
  # 3 SE = 2.0 %, and the control is the same draw 4 % low and 4 % high (6 SE: what this sample
  # can see for certain). A layout's own fault is larger (a shard's noise off by √2 or more);
  # the whole noise 2 % low or high is test_dp_noise's control, on 200,000 draws.
  _, _, clip, _ = problem()
  std = SIGMA * clip / N
  stats.check_std(z, std, "dp_noise std in this layout", mutations=(0.96, 1.04))
  assert abs(z.mean()) < 3 * std / np.sqrt(z.size)


@pytest.mark.parametrize("front", ["microbatch", "accumulate"])
@pytest.mark.parametrize("shape", [(4, 2), (2, 4)])
def test_dp_layout_shard_map_noise_independent_across_model_shards(shape, front):
  layout = f"shard_map-data{shape[0]}-model{shape[1]}"
  z, runs = noise_samples(layout, front)
  _check_std(z)
  d, m = shape
  clean = run(layout, front, 0.0)[0][1]
  per = {  # leaf -> (seed, data, model, coordinate) noise of each device's piece
    leaf: np.stack([np.asarray(r[1][leaf], np.float64) - clean[leaf] for r in runs]).reshape(
      SEEDS, d, m, -1
    )
    for leaf in ("w0", "b0", "w1", "b1")
  }
  for leaf, z in per.items():
    # The same on every data device, bit for bit.
    assert np.all(z == z[:, :1]), f"{leaf}: data devices drew different noise"
  # b1 is replicated over "model": the same noise on every model device.
  assert np.all(per["b1"] == per["b1"][:, :, :1]), "b1: model devices drew different noise"
  # Two shards of a sharded leaf: uncorrelated (the sharded leaves' coordinates pooled).
  for a in range(m):
    for b in range(a + 1, m):
      x = np.concatenate([per[k][:, 0, a].ravel() for k in ("w0", "b0", "w1")])
      y = np.concatenate([per[k][:, 0, b].ravel() for k in ("w0", "b0", "w1")])
      assert x.size >= 2800 and 3 / np.sqrt(x.size) < CORR_TOL
      corr = np.corrcoef(x, y)[0, 1]
      assert abs(corr) < CORR_TOL, (a, b, corr)


@pytest.mark.parametrize("front", ["microbatch", "accumulate"])
def test_dp_layout_shard_map_data_noise_same_on_every_device(front):
  z, runs = noise_samples("shard_map-data", front)
  _check_std(z)
  for r in runs[:20]:
    for leaf in r[1].values():
      assert np.all(leaf == leaf[:1])


@pytest.mark.slow  # six TrainStep/microbatch compilations under 2-D meshes (CI runs it)
@pytest.mark.parametrize("front", ["microbatch", "accumulate"])
@pytest.mark.parametrize("layout", ["jit-auto-data-model", "jit-explicit-data-model", "jit-fsdp"])
def test_dp_layout_plain_jit_noise_is_the_one_device_draw(layout, front):
  seeds = tuple(range(2))
  clean = _flat(run(layout, front, 0.0)[0])
  one_clean = _flat(run("one-device", front, 0.0)[0])
  got = [_flat(r) - clean for r in run(layout, front, SIGMA, seeds)]
  want = [_flat(r) - one_clean for r in run("one-device", front, SIGMA, seeds)]
  _, _, clip, _ = problem()
  for g, w in zip(got, want, strict=True):
    # The same numbers: a global array drawn whole, whatever its sharding (partitionable
    # threefry); float32 rounding of the clipped sum they are added to is ~1e-7 of it.
    np.testing.assert_allclose(g, w, atol=1e-5 * SIGMA * clip / N)
  assert np.std(got) > 0.5 * SIGMA * clip / N  # it is noise


@pytest.mark.parametrize("front", ["microbatch", "accumulate"])
def test_dp_layout_one_device_noise_std(front):
  z, _ = noise_samples("one-device", front)
  _check_std(z)


@pytest.mark.parametrize("fn", ["clipped_grad", "clipped_loss"])
def test_dp_layout_shard_map_replicated_params_give_the_global_clipped_sum(fn):
  """Parameters replicated over "data" (not made varying by the caller): `jax.grad` would
  all-reduce inside the per-example vmap, summing the devices' i-th examples before clipping.
  The library keeps each example's gradient its own and reduces the clipped sums once: the
  result is the clipped sum over every device's examples, replicated, as `jax.grad`'s is."""
  params, batch, clip, expected = problem()
  mesh = _sm_mesh((4, 2))
  if fn == "clipped_grad":
    f = privacy.clipped_grad(manual_loss, clip, mask_argnum=None)
  else:
    f = jax.grad(privacy.clipped_loss(manual_loss, clip, mask_argnum=None))
  prog = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(MODEL_SPECS, P(AX)), out_specs=MODEL_SPECS))
  got = prog(_put(params, mesh, MODEL_SPECS), ref.shard(batch, mesh, P(AX)))
  assert_close(jax.tree.map(lambda v: np.asarray(v) / N, got), expected)
