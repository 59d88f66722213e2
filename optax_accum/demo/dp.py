"""The DP task of the demo: ``python -m optax_accum.demo dp [--quick]``.

Differentially private training (DP-SGD, here DP-Adam) of a small MLP on scikit-learn's
handwritten digits with Poisson-sampled logical batches far larger than the micro-batch:

* `PoissonSampler` draws each logical batch (expected size ``--batch-size``) and pads it to
  whole micro-batches of ``--micro`` examples with a mask; micro-step ``i`` takes
  ``batch.take(x, y, microbatch=i)``: micro-batch ``i``'s rows in the batch's own layout (its
  split) *and* their mask, which never travel apart;
* `privacy.Mechanism(loss, C, sampler=..., key=..., noise_multiplier=σ)` holds the whole
  mechanism; its `train_step(adam)` is
  ``TrainStep(clipped_loss(loss, C, mask_argnum=3), chain(dp_noise(σ, C, B, key), adam),
  reduction="sum")``: it sums the clipped per-example gradients over the batch's micro-steps
  (the window length is chosen on the host, ``force_emit`` on the last micro-step) and adds the
  noise once;
* σ is calibrated for ``--epsilon`` at δ (`dp_noise_multiplier`), and ε is reported from the
  update count the optimizer state holds (`Mechanism.epsilon`: `dp_updates`, `dp_epsilon`).

A non-private model (same model, same number of updates, batches of the expected size, no
clipping or noise) is trained beside it, and both test accuracies are printed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum
from optax_accum.demo import (
  COMMAND,
  NON_NEGATIVE_INT,
  POSITIVE,
  POSITIVE_INT,
  Phases,
  digits,
  number,
  require,
)

DELTA = number(float, lambda v: 0 < v < 1, "in (0, 1)")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """The flags, each checked before any training: a bad one exits with argparse's usage and a
  message naming it."""
  p = argparse.ArgumentParser(
    prog=f"{COMMAND} dp",
    description="DP-SGD on the digits with Poisson-sampled logical batches and exact "
    "accumulation of clipped per-example gradients.",
  )
  n = digits.TRAIN_EXAMPLES
  p.add_argument(
    "--batch-size", type=POSITIVE_INT, default=256, help=f"expected logical batch, ≤ {n} (256)"
  )
  p.add_argument("--micro", type=POSITIVE_INT, default=16, help="examples per micro-step (16)")
  p.add_argument("--updates", type=POSITIVE_INT, default=150, help="noisy updates (150)")
  p.add_argument("--epsilon", type=POSITIVE, default=4.0, help="target ε, finite (4.0)")
  p.add_argument("--delta", type=DELTA, default=1e-5, help="δ (1e-5, below 1/N)")
  p.add_argument("--clip", type=POSITIVE, default=1.0, help="per-example clip norm C (1.0)")
  p.add_argument("--lr", type=POSITIVE, default=5e-3, help="Adam learning rate (5e-3)")
  p.add_argument("--hidden", type=POSITIVE_INT, default=128, help="MLP hidden width (128)")
  p.add_argument("--seed", type=NON_NEGATIVE_INT, default=0, help="seed of init, sampling, noise")
  p.add_argument("--quick", action="store_true", help="40 updates: a smoke run")
  p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  args = p.parse_args(argv)
  if args.batch_size > n:
    # Poisson sampling at rate batch_size / N: a rate above 1 samples nothing meaningful.
    p.error(f"--batch-size must be at most the {n} training examples, got {args.batch_size}")
  if args.quick:
    args.updates = min(args.updates, 40)
  return args


def init_mlp(key: jax.Array, sizes: Sequence[int]) -> dict:
  params = {}
  for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
    key, sub = jax.random.split(key)
    params[f"w{i}"] = jax.random.normal(sub, (n_in, n_out)) / np.sqrt(n_in)
    params[f"b{i}"] = jnp.zeros(n_out)
  return params


def logits(params: dict, x: jax.Array) -> jax.Array:
  n = len(params) // 2
  for i in range(n):
    x = x @ params[f"w{i}"] + params[f"b{i}"]
    x = jax.nn.relu(x) if i < n - 1 else x
  return x


def loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
  """Mean cross-entropy of a batch (of one example, inside `clipped_loss`)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def accuracy(params: dict, x: np.ndarray, y: np.ndarray) -> float:
  return float(jnp.mean(jnp.argmax(logits(params, x), -1) == y))


def train_private(args, params, x, y, sigma: float) -> tuple[Any, Any, int]:
  """DP training: one Poisson batch per update, its micro-steps chosen on the host."""
  # The sampler's seed and the noise key are secrets (a real run draws them from the OS).
  sampler = optax_accum.privacy.PoissonSampler(
    len(x), args.batch_size / len(x), args.micro, seed=args.seed
  )
  mech = optax_accum.privacy.Mechanism(
    loss, args.clip, sampler=sampler, key=jax.random.key(args.seed + 1), noise_multiplier=sigma,
    delta=args.delta, batch_argnums=(1, 2),
  )  # fmt: skip
  # A window per Poisson batch: force_emit closes each one.
  step = mech.train_step(optax.adam(args.lr))
  state, micro_steps = step.init(params), 0
  bar = _bar(args, "private")
  for _ in range(args.updates):
    batch = next(sampler)
    for i in range(batch.num_microbatches):
      last = i == batch.num_microbatches - 1
      rows = batch.take(x, y, microbatch=i)  # (x rows, y rows, mask), in the batch's layout
      params, state, _ = step(params, state, *rows, force_emit=last)
      micro_steps += 1
    bar.set_postfix_str(f"{micro_steps} micro-steps", refresh=False)
    bar.update(1)
  bar.close()
  return params, state, micro_steps


def _bar(args, desc: str):
  """A bar over the updates; it says "compiling …" until the first one is done."""
  bar = require("tqdm").tqdm(
    total=args.updates, desc=f"{desc:>11}", unit="update", disable=args.no_progress, leave=True
  )
  bar.set_postfix_str("compiling …", refresh=True)
  return bar


def train_plain(args, params, x, y) -> Any:
  """The non-private reference: Adam on shuffled batches of the expected size."""
  opt = optax.adam(args.lr)
  rng = np.random.default_rng(args.seed)

  @jax.jit
  def step(params, state, xb, yb):
    grads = jax.grad(loss)(params, xb, yb)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = opt.init(params)
  bar = _bar(args, "non-private")
  for _ in range(args.updates):
    idx = rng.choice(len(x), args.batch_size, replace=False)
    params, state = step(params, state, x[idx], y[idx])
    bar.set_postfix_str("", refresh=False)
    bar.update(1)
  bar.close()
  return params


def main(argv: Sequence[str]) -> dict:
  """Runs the DP task; returns its figures (ε, δ, σ, updates, micro-steps, accuracies)."""
  args = parse_args(argv)
  for module in ("sklearn", "tqdm", "dp_accounting"):
    require(module, command=f"{COMMAND} dp")
  phases = Phases(2, "setup", progress=not args.no_progress)
  phases("the digits")
  (x, y), (x_test, y_test) = digits.load_digits(seed=args.seed)
  q = args.batch_size / len(x)
  phases(f"calibrating σ for ε={args.epsilon} (the accountant)")
  sigma = optax_accum.privacy.dp_noise_multiplier(args.epsilon, args.updates, q, args.delta)
  phases.close()
  params0 = init_mlp(jax.random.key(args.seed), (x.shape[1], args.hidden, 10))
  print(
    f"digits: {len(x)} train / {len(x_test)} test, MLP 64-{args.hidden}-10; Poisson q={q:.4f} "
    f"(expected batch {args.batch_size}), micro-batch {args.micro}, C={args.clip}, "
    f"σ={sigma:.3f} for ε={args.epsilon} at δ={args.delta}, {args.updates} updates"
  )
  t0 = time.perf_counter()
  copy = jax.tree.map(jnp.copy, params0)  # TrainStep donates its parameters
  private, state, micro_steps = train_private(args, copy, x, y, sigma)
  seconds = time.perf_counter() - t0
  updates = int(optax_accum.privacy.dp_updates(state))
  eps = optax_accum.privacy.dp_epsilon(updates, q, sigma, args.delta)
  plain = train_plain(args, params0, x, y)
  out = {
    "epsilon": eps,
    "delta": args.delta,
    "sigma": sigma,
    "updates": updates,
    "micro_steps": micro_steps,
    "private_accuracy": accuracy(private, x_test, y_test),
    "plain_accuracy": accuracy(plain, x_test, y_test),
  }
  print(
    f"private:     test accuracy {out['private_accuracy']:.3f}  (ε = {eps:.2f}, δ = {args.delta}; "
    f"{updates} updates accounted, from {micro_steps} micro-steps, {seconds:.1f} s)\n"
    f"non-private: test accuracy {out['plain_accuracy']:.3f}  (same model and updates, "
    f"batches of {args.batch_size}, no clipping or noise)"
  )
  return out
