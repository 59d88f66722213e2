"""The one-run privacy audit (Steinke, Nasr, Jagielski 2023) of the private path and of faults.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/dp_audit.py

One training run per configuration, with white-box gradient (Dirac) canaries on a linear model:

* the model: one weight of shape ``(L, M) = (16, 4000)``, its ``L`` rows standing for ``L``
  model shards. Canary ``i`` is an example whose gradient is ``-4C·uᵢ`` with
  ``uᵢ = Σ_l s_l e_{l,i} / √L`` (column ``i`` of every row; ``s_l = +1`` on the first half of
  the rows, ``-1`` on the second): norm 4C, clipped to C, orthogonal to every other canary.
  Spread over the rows, a clipping that computes the norm per shard lets it reach ``√L·C``;
  with the signs, a noise that is the same on every shard (or on both halves) cancels in its
  score;
* the data set: each canary in with probability ½ (seeded), nothing else;
* training, the library's private path: `privacy.PoissonSampler` logical batches
  (``q = 0.9``), ``K = 16`` micro-batches each (padded with masked rows), the gradient of
  `privacy.clipped_loss`, ``accumulate(chain(privacy.dp_noise(σ, C, B), sgd(1)), K,
  reduction="sum", axis_name="data")`` inside ``shard_map`` over 8 devices (each micro-batch's
  rows split over them), and once more in ``shard_map`` over a (data 4, model 2) mesh with the
  weight's rows split over the model axis (each half a model shard); ``T = 2`` updates;
  σ = 2.951, for which the PLD accountant (`privacy.dp_epsilon`) gives ε = 2.0 at δ = 1e-6
  (RDP: 2.16); ``B = q·M/2``, public (the expected data set size times q);
* the score of canary ``i``: ``⟨final params − initial params, uᵢ⟩``. The audit guesses "in"
  for the 150 highest scores and "out" for the 150 lowest (fixed before the run) and turns the
  correct guesses into an ε lower bound at 95 % confidence, δ = 1e-6 (`privacy.audit_epsilon`).

Why these sizes. The one-run bound of a Gaussian mechanism is loose (about 0.4 of the claimed ε
here, as the paper finds), so a fault shows only if it multiplies the privacy loss well beyond
that: σ → σ/4 or a sensitivity of 4·C does (16 micro-batches, 16 shards), σ = 0 and identical
noise on the shards (noise-free scores) do; √2·C (two shards clipped apart) does not at any
size that runs in CI (listed below the claim, measured). More canaries tighten the bound only
logarithmically, while each per-example gradient costs ``L·M`` floats; 4000 canaries keep one
run at ~10 s of CPU. δ = 1e-6 keeps the theorem's ``2·m·δ`` term small beside β = 0.05. With
q = 0.9 and 2 updates, 99 % of the included canaries are sampled at least once (one never
sampled looks excluded, which the accountant's amplification by sampling counts on).

"mean" (the window's clipped sum divided by its realised number of micro-batches, the old
``reduction="mean"``) is measured but not detected, and a one-run audit cannot be expected to
see it: it divides every example's contribution (a canary's own included) by a count ≥ 1, so
each canary's own signal shrinks; what it leaks is the size of the data set, which tells the
auditor how many canaries are in, not which (given that number, each is equally likely in).
The neighbouring-data-sets sensitivity test catches it (‖Δupdate‖·B up to 3.5·C).

The faults are small faulty update functions built here from the library's pieces
(`clipped_loss` per shard, `dp_noise` with σ = 0, one `dp_noise` draw reused on every shard),
not library options (a private front end refuses those).

The white-box audit (`privacy.audit_updates`, the second table): one device, the same claim
(σ, q, T, δ), every update observed. ``m = 20,000`` Dirac canaries (parameter ``i`` of a weight
of ``m + p``; canary ``i``'s gradient is ``-4C·e_i``, clipped to ``-C·e_i``) and ``p = 2000``
probe parameters that no example reaches (their updates are the noise alone); the library's path
(`PoissonSampler`, ``K = 16`` micro-batches, ``accumulate(chain(dp_noise, sgd(1)), K,
reduction="sum")`` under ``jit``) and four faults built from the library's pieces: σ/2, clipping
at 2C with the noise for C, noise skipped on the second update, and the optimizer state
re-initialised before each update (the same noise key and count: the same noise). 300
one-sided "in" guesses: on simulated DP-SGD updates of this size, 300 of 20,000 gave the
correct run the highest bound (mean 1.27 over 8 seeds; 500 guesses 1.19, 800 1.14) while σ/2
stayed above 2.5. The same runs' final parameters are audited with `audit_epsilon` (150 + 150
guesses) for comparison. About 10 s per run on a loaded 2-core machine.

Writes ``benchmarks/results/cpu/dp_audit.md`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

if __name__ == "__main__":  # before JAX initialises: 8 host CPU devices
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum import privacy

AXIS = "data"
DEVICES = 8
CANARIES = 4000  # M
LEAVES = 16  # L
CLIP = 1.0  # C
RAW = 4.0  # a canary's gradient norm, in units of C (clipped to C)
RATE = 0.9  # q
MICROBATCHES = 16  # K
UPDATES = 2  # T
SIGMA = 2.9510  # σ: ε = 2.0 at δ = 1e-6 after T updates at rate q (PLD accountant)
DELTA = 1e-6
CONFIDENCE = 0.95
GUESSES = 150  # k+ = k-
SEED = 0
SIGNS = np.where(np.arange(LEAVES) < LEAVES // 2, 1.0, -1.0)  # s_l: +1 on the first half


MODEL = 2  # the model axis of the (data, model) layout


class Config(NamedTuple):
  """One audited training run: the library's path or one injected fault."""

  name: str
  fault: str | None  # None: the library's path as documented
  what: str  # one line for the table
  layout: str = "data"  # "data": shard_map over 8 devices; "data_model": over (4, 2)


CONFIGS = (
  Config("library", None, "the private path as documented"),
  Config(
    "library_data_model",
    None,
    "the same, in shard_map over (data 4, model 2), the weight's rows split over model",
    "data_model",
  ),
  Config("sigma_zero", "sigma_zero", "σ silently 0 (dp_noise(0.0, ...)), ε claimed for σ"),
  Config(
    "noise_per_microbatch",
    "noise_per_microbatch",
    "noise added per micro-batch with std σC/K: σC/√K per update (K = 16)",
  ),
  Config(
    "per_shard_clipping",
    "per_shard_clipping",
    "each of the 16 shards (rows) clipped to C apart: one example reaches 4·C",
  ),
  Config(
    "identical_noise",
    "identical_noise",
    "the same noise draw on every model shard (row)",
  ),
  Config(
    "per_half_clipping",
    "per_half_clipping",
    "two halves (8 rows each) clipped to C apart: √2·C (too small for a one-run audit)",
  ),
  Config(
    "mean",
    "mean",
    "'mean': the clipped sum divided by the realised number of micro-batches (undetectable)",
  ),
)


def sigma() -> float:
  """The noise multiplier of the claim: ``dp_noise_multiplier(2.0, T, q, δ, accountant="pld")``
  rounded up to 4 digits (the calibration takes ~10 s; `claimed_epsilon` gives its ε)."""
  return SIGMA


def claimed_epsilon(noise_multiplier: float, accountant: str = "pld") -> float:
  return privacy.dp_epsilon(UPDATES, RATE, noise_multiplier, DELTA, accountant=accountant)


def loss(params: dict, idx: jax.Array) -> jax.Array:
  """A canary's loss: ``-RAW·C·⟨w, u_idx⟩`` (its gradient, ``-RAW·C·u_idx``, does not depend
  on the parameters, so the final parameters are the sum of the noisy updates)."""
  scale = RAW * CLIP / math.sqrt(LEAVES)
  return -scale * jnp.sum(jnp.asarray(SIGNS, jnp.float32) @ params["w"][:, idx])


def model_sharded_loss(params: dict, idx: jax.Array) -> jax.Array:
  """`loss` inside ``shard_map`` over (data, model), this device holding its model shard's rows:
  its part of the score, summed over the model axis as a model-parallel forward pass would."""
  signs = jnp.asarray(SIGNS.reshape(MODEL, -1), jnp.float32)[lax.axis_index("model")]
  part = -RAW * CLIP / math.sqrt(LEAVES) * jnp.sum(signs @ params["w"][:, idx])
  return lax.psum(part, "model")


def clipped_grad_fn(shards: int):
  """The gradient of `clipped_loss` with each of `shards` row blocks of the ``(L, M)`` weight
  clipped on its own, as a clipping that computes the norm per model shard would (1: the
  library's global clipping)."""
  if shards == 1:
    return jax.grad(privacy.clipped_loss(loss, CLIP, mask_argnum=2))
  size = LEAVES // shards

  def grad(params, idx, mask):
    blocks = []
    for b in range(shards):

      def part(block, idx, b=b):
        return loss({"w": lax.dynamic_update_slice_in_dim(params["w"], block, b * size, 0)}, idx)

      f = privacy.clipped_loss(part, CLIP, mask_argnum=2)
      blocks.append(jax.grad(f)(params["w"][b * size : (b + 1) * size], idx, mask))
    return {"w": jnp.concatenate(blocks)}

  return grad


def identical_noise(noise_multiplier: float, batch: float, key: jax.Array):
  """A faulty `dp_noise`: one draw (the library's, for one shard) added to every shard."""
  base = privacy.dp_noise(noise_multiplier, CLIP, batch, key, allow_key_reuse=True)

  def init_fn(params):
    return base.init(params)  # its state holds no parameter-shaped leaf

  def update_fn(updates, state, params=None, **extra):
    del params, extra
    noise, state = base.update(jnp.zeros_like(updates["w"][0]), state)  # σCξ / B, one row
    return {"w": updates["w"] / batch + noise}, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def included(seed: int = SEED) -> np.ndarray:
  """Which canaries are in the data set: each with probability ½."""
  return np.random.default_rng((seed, 1)).random(CANARIES) < 0.5


def scores(final: dict) -> np.ndarray:
  """``⟨final − initial, uᵢ⟩`` for every canary (the initial parameters are 0)."""
  return SIGNS @ np.asarray(final["w"], np.float64) / math.sqrt(LEAVES)


def train(fault: str | None, seed: int = SEED, layout: str = "data") -> tuple[dict, int]:
  """One private training run with `fault` injected, on `layout`; returns the final parameters
  and the noisy updates counted."""
  inc = included(seed)
  data = np.flatnonzero(inc).astype(np.int32)  # the data set: the included canaries
  expected = RATE * CANARIES / 2  # B, public
  rows = DEVICES * math.ceil((expected + 7 * math.sqrt(expected)) / (MICROBATCHES * DEVICES))
  sampler = privacy.PoissonSampler(
    len(data), RATE, rows, seed=seed, max_microbatches=MICROBATCHES
  )  # fmt: skip
  noise_multiplier = 0.0 if fault == "sigma_zero" else sigma()
  # Each configuration is its own audited run on the same seed (comparable runs): the key is
  # reused across them on purpose, which dp_noise otherwise refuses within a process.
  key = jax.random.key(seed)
  if fault == "identical_noise":
    noise = identical_noise(noise_multiplier, expected, key)
  elif fault == "noise_per_microbatch":
    noise = privacy.dp_noise(0.0, CLIP, expected, key)  # only the division by B
  else:
    noise = privacy.dp_noise(noise_multiplier, CLIP, expected, key, allow_key_reuse=True)
  tx = oa.accumulate(
    optax.chain(noise, optax.sgd(1.0)), MICROBATCHES, reduction="sum", axis_name=AXIS
  )
  shards = {"per_shard_clipping": LEAVES, "per_half_clipping": 2}.get(fault, 1)
  grad = clipped_grad_fn(shards)
  if layout == "data_model":
    grad = jax.grad(privacy.clipped_loss(model_sharded_loss, CLIP, mask_argnum=2))
  # The faulty per-micro-batch noise: σC/K per micro-batch (the whole update's std divided by
  # K, not √K), drawn on each device with std σC/(K·√D) so that the all-reduce's sum has σC/K.
  micro_std = sigma() * CLIP / MICROBATCHES / math.sqrt(DEVICES)
  micro_key = jax.random.key(seed + 10_000)

  def micro_step(params, state, idx, mask, scale, step):
    grads = grad(lax.pcast(params, AXIS, to="varying"), idx, mask)
    if fault == "noise_per_microbatch":
      k = jax.random.fold_in(jax.random.fold_in(micro_key, step), lax.axis_index(AXIS))
      grads = {"w": grads["w"] + micro_std * jax.random.normal(k, grads["w"].shape)}
    grads = jax.tree.map(lambda g: g * scale, grads)  # "mean": 1 / realised micro-batches
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  if layout == "data_model":
    mesh = jax.make_mesh((DEVICES // MODEL, MODEL), (AXIS, "model"), devices=jax.devices()[:8])
    pspec = {"w": P("model")}
  else:
    mesh = jax.make_mesh((DEVICES,), (AXIS,), devices=jax.devices()[:DEVICES])
    pspec = {"w": P()}
  zeros = np.zeros((LEAVES, CANARIES), np.float32)
  params = {"w": jax.device_put(zeros, NamedSharding(mesh, pspec["w"]))}
  sspec = oa.state_partition_specs(tx, pspec, AXIS)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspec,), out_specs=sspec))
  step = jax.jit(
    jax.shard_map(
      micro_step,
      mesh=mesh,
      in_specs=(pspec, sspec, P(AXIS), P(AXIS), P(), P()),
      out_specs=(pspec, sspec),
    )
  )
  rows_spec = NamedSharding(mesh, P(AXIS))
  state = init(params)
  for t in range(UPDATES):
    batch = sampler.batch(t)
    scale = 1.0 / batch.num_microbatches if fault == "mean" else 1.0
    idx = data[batch.indices].reshape(MICROBATCHES, rows)
    mask = batch.mask.reshape(MICROBATCHES, rows)
    for j in range(MICROBATCHES):
      params, state = step(
        params,
        state,
        jax.device_put(idx[j], rows_spec),
        jax.device_put(mask[j].astype(np.float32), rows_spec),
        np.float32(scale),
        np.int32(t * MICROBATCHES + j),
      )
  return jax.tree.map(np.asarray, params), int(privacy.dp_updates(state))


def audit(fault: str | None, seed: int = SEED, layout: str = "data") -> privacy.AuditResult:
  """Trains once with `fault` on `layout` and audits the final parameters."""
  final, updates = train(fault, seed, layout)
  if updates != UPDATES:
    raise AssertionError(f"dp_updates counted {updates} noisy updates, expected {UPDATES}.")
  return privacy.audit_epsilon(
    scores(final),
    included(seed),
    num_positive=GUESSES,
    num_negative=GUESSES,
    delta=DELTA,
    confidence=CONFIDENCE,
  )


# ----------------------------------------------------------------------------------------------
# The white-box audit (`privacy.audit_updates`): one device, every update observed.

WB_CANARIES = 20_000  # m: Dirac canaries, one parameter each
WB_PROBES = 2000  # p: parameters no example reaches (the noise alone)
WB_GUESSES = 300  # k: "in" guesses (one-sided), fixed before the run
WB_MICROBATCHES = 16  # K


class WhiteBox(NamedTuple):
  """One white-box audited run: the library's path on one device, or one injected fault."""

  name: str
  fault: str | None
  what: str
  true_epsilon: str  # the run's real ε at δ, as text ("∞": a noise-free release)


WHITE_BOX = (
  WhiteBox("library", None, "the private path as documented (σ, clip C)", "2.00"),
  WhiteBox(
    "sigma_half", "sigma_half", "dp_noise(σ/2, C, B): half the noise the claim is for", "4.43"
  ),
  WhiteBox(
    "clip_double",
    "clip_double",
    "clipped_loss(loss, 2C) with dp_noise(σ, C, B): twice the sensitivity",
    "4.43",
  ),
  WhiteBox("noise_skipped", "noise_skipped", "noise on the first of the two updates only", "∞"),
  WhiteBox(
    "same_key",
    "same_key",
    "the optimizer state re-initialised before each update (tx.init in the loop): the same "
    "noise key and count, the same noise on both updates",
    "∞",
  ),
)


def skip_noise_after_first(noise_multiplier: float, batch: float, key: jax.Array):
  """A faulty `dp_noise`: the library's noisy update first, then a noise-free one (σ = 0)."""
  noisy = privacy.dp_noise(noise_multiplier, CLIP, batch, key)
  plain = privacy.dp_noise(0.0, CLIP, batch, jax.random.fold_in(key, 1))  # draws nothing

  def init_fn(params):
    return noisy.init(params), plain.init(params)

  def update_fn(updates, state, params=None, **extra):
    del params, extra
    first = privacy.dp_updates(state[0]) == 0
    with_noise, noisy_state = noisy.update(updates, state[0])
    without, plain_state = plain.update(updates, state[1])
    out = jax.tree.map(lambda a, b: jnp.where(first, a, b), with_noise, without)
    return out, (noisy_state, plain_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def wb_loss(params: dict, idx: jax.Array) -> jax.Array:
  """Canary ``idx``'s loss, ``-RAW·C·w[idx]``: its gradient is ``-RAW·C·e_idx`` (clipped to
  ``-C·e_idx``), so SGD moves ``w[idx]`` up by ``C/B`` when the canary is sampled."""
  return -RAW * CLIP * jnp.sum(params["w"][idx])


def wb_train(fault: str | None, seed: int, canaries: int) -> tuple[np.ndarray, float]:
  """One private training run with `fault`, on one device; returns every update ``(T, m + p)``
  (the parameters' change over each logical batch) and one canary's contribution ``C/B``."""
  inc = included_wb(seed, canaries)
  data = np.flatnonzero(inc).astype(np.int32)  # the data set: the included canaries
  expected = RATE * canaries / 2  # B, public
  rows = math.ceil((expected + 7 * math.sqrt(expected)) / WB_MICROBATCHES)
  sampler = privacy.PoissonSampler(
    len(data), RATE, rows, seed=seed, max_microbatches=WB_MICROBATCHES
  )  # fmt: skip
  key = jax.random.fold_in(jax.random.key(seed), 2)
  sig = sigma() / 2 if fault == "sigma_half" else sigma()
  if fault == "noise_skipped":
    noise = skip_noise_after_first(sig, expected, key)
  else:
    noise = privacy.dp_noise(sig, CLIP, expected, key)
  tx = oa.accumulate(optax.chain(noise, optax.sgd(1.0)), WB_MICROBATCHES, reduction="sum")
  clip = 2 * CLIP if fault == "clip_double" else CLIP
  grad = jax.grad(privacy.clipped_loss(wb_loss, clip, mask_argnum=2))

  @jax.jit
  def micro_step(params, state, idx, mask):
    updates, state = tx.update(grad(params, idx, mask), state, params)
    return optax.apply_updates(params, updates), state

  params = {"w": jnp.zeros(canaries + WB_PROBES, jnp.float32)}
  state = jax.jit(tx.init)(params)
  updates = []
  for t in range(UPDATES):
    if fault == "same_key":
      state = jax.jit(tx.init)(params)  # the habit: a fresh optimizer state per update
    before = np.asarray(params["w"])
    batch = sampler.batch(t)
    idx = data[batch.indices].reshape(WB_MICROBATCHES, rows)
    mask = batch.mask.reshape(WB_MICROBATCHES, rows).astype(np.float32)
    for j in range(WB_MICROBATCHES):
      params, state = micro_step(params, state, idx[j], mask[j])
    updates.append(np.asarray(params["w"]) - before)
  return np.stack(updates), CLIP / expected


def included_wb(seed: int, canaries: int) -> np.ndarray:
  """Which white-box canaries are in the data set: each with probability ½."""
  return np.random.default_rng((seed, 3)).random(canaries) < 0.5


class WhiteBoxResult(NamedTuple):
  white_box: privacy.AuditResult  # `audit_updates` on every update
  final_model: privacy.AuditResult  # `audit_epsilon` on the final parameters, the same run


def wb_audit(
  fault: str | None, seed: int = SEED, canaries: int = WB_CANARIES, guesses: int = WB_GUESSES
) -> WhiteBoxResult:
  """Trains once with `fault` and audits it twice: white-box (every update) and final model."""
  updates, contribution = wb_train(fault, seed, canaries)
  inc = included_wb(seed, canaries)
  white = privacy.audit_updates(
    updates[:, :canaries],
    updates[:, canaries:],
    inc,
    contribution=contribution,
    sampling_rate=RATE,
    num_positive=guesses,
    delta=DELTA,
    confidence=CONFIDENCE,
  )
  final = privacy.audit_epsilon(
    updates[:, :canaries].sum(0),  # final - initial parameters, at the canaries
    inc,
    num_positive=GUESSES,
    num_negative=GUESSES,
    delta=DELTA,
    confidence=CONFIDENCE,
  )
  return WhiteBoxResult(white, final)


def wb_report(results: dict[str, WhiteBoxResult], seconds: float) -> list[str]:
  claim = claimed_epsilon(sigma())
  lines = [
    "## White-box: every update observed (`privacy.audit_updates`)",
    "",
    f"One device, {seconds:.0f} s. Claimed ε = {claim:.3f} at δ = {DELTA:g} (σ = {sigma():.4f}, "
    f"T = {UPDATES}, q = {RATE}). m = {WB_CANARIES} Dirac canaries (one parameter each) and "
    f"{WB_PROBES} probe parameters no example reaches, in a weight of {WB_CANARIES + WB_PROBES}; "
    f"PoissonSampler batches, K = {WB_MICROBATCHES} micro-batches per update, "
    f"accumulate(chain(dp_noise, sgd(1)), reduction='sum') under jit; the update of each "
    f"logical batch recorded. White-box: {WB_GUESSES} one-sided 'in' guesses from each "
    f"canary's likelihood ratio under the noise read from the probes, judged against DP-SGD's "
    f"tradeoff curve (f-DP). Final model, the same run: `audit_epsilon` on the final "
    f"parameters, {GUESSES} + {GUESSES} guesses. Confidence {CONFIDENCE:.0%}.",
    "",
    "| configuration | what | true ε | final model: correct / guesses, bound | white-box: "
    "correct / guesses, bound | caught (white-box bound > claimed ε)? |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for cfg in WHITE_BOX:
    w, f = results[cfg.name].white_box, results[cfg.name].final_model
    verdict = (
      "**yes**" if w.epsilon > claim else ("no (correct run)" if cfg.fault is None else "no")
    )
    lines.append(
      f"| {cfg.name} | {cfg.what} | {cfg.true_epsilon} | {f.num_correct} / {f.num_guesses}, "
      f"{f.epsilon:.3f} | {w.num_correct} / {w.num_guesses}, {w.epsilon:.3f} | {verdict} |"
    )
  lines.append("")
  return lines


def report(results: dict[str, privacy.AuditResult], seconds: float, command: str) -> str:
  sig = sigma()
  lines = [
    "# One-run privacy audit (Steinke, Nasr, Jagielski 2023)",
    "",
    "## Final model (`privacy.audit_epsilon`), 8 devices",
    "",
    f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, jax {jax.__version__}, "
    f"{jax.device_count()} {jax.devices()[0].platform} devices, {seconds:.0f} s. Command: "
    f"`{command}`",
    "",
    f"Claimed: ε = {claimed_epsilon(sig):.3f} at δ = {DELTA:g} (PLD accountant; RDP says "
    f"{claimed_epsilon(sig, 'rdp'):.3f}) for σ = {sig:.4f}, T = {UPDATES} updates at q = "
    f"{RATE}. Audit: m = {CANARIES} gradient canaries, each in with probability ½, "
    f"{GUESSES} 'in' + {GUESSES} 'out' guesses, confidence {CONFIDENCE:.0%}, δ = {DELTA:g}. "
    f"Training: PoissonSampler batches, K = {MICROBATCHES} micro-batches per update, "
    f"accumulate(axis_name='data') in shard_map over {DEVICES} devices, a linear model of "
    f"weight ({LEAVES}, {CANARIES}), rows as model shards.",
    "",
    "| configuration | what | correct / guesses | ε lower bound | > claimed ε? |",
    "| --- | --- | --- | --- | --- |",
  ]
  claim = claimed_epsilon(sig)
  for cfg in CONFIGS:
    r = results[cfg.name]
    verdict = "**yes: detected**" if r.epsilon > claim else "no"
    lines.append(
      f"| {cfg.name} | {cfg.what} | {r.num_correct} / {r.num_guesses} | {r.epsilon:.3f} | "
      f"{verdict} |"
    )
  lines.append("")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, privacy.AuditResult]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  default = Path(__file__).resolve().parent / "results" / "cpu"
  parser.add_argument("--out", type=Path, default=default, help="folder for dp_audit.md")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  results = {}
  for cfg in CONFIGS:
    results[cfg.name] = audit(cfg.fault, layout=cfg.layout)
    r = results[cfg.name]
    print(f"{cfg.name:22s} {r.num_correct:4d}/{r.num_guesses}  ε ≥ {r.epsilon:.3f}", flush=True)
  command = "XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/dp_audit.py"
  text = report(results, time.perf_counter() - start, command)
  start = time.perf_counter()
  white = {}
  for cfg in WHITE_BOX:
    white[cfg.name] = r = wb_audit(cfg.fault)
    print(
      f"white-box {cfg.name:14s} {r.white_box.num_correct:4d}/{r.white_box.num_guesses}  "
      f"ε ≥ {r.white_box.epsilon:.3f}  (final model: ε ≥ {r.final_model.epsilon:.3f})",
      flush=True,
    )
  text += "\n" + "\n".join(wb_report(white, time.perf_counter() - start))
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "dp_audit.md").write_text(text)
  print(text)
  return results


if __name__ == "__main__":
  main()
