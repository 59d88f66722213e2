"""The digits task, the demos' default: one model trained three ways, to the same parameters.

Run it with ``python -m optax_accum.demo`` (after ``pip install -e ".[examples]"``). It trains a
small MLP (Flax Linen) on scikit-learn's handwritten digits, which ship with scikit-learn (no
download), three ways on the same sequence of batches:

* **large batch** — one `jax.value_and_grad` over the whole batch of ``--batch-size`` examples
  per optimizer step;
* **accumulate** — `optax_accum.accumulate(adam, k)`: ``k`` jitted micro-steps of
  ``batch_size / k`` examples per optimizer step (the across-steps form);
* **microbatch** — `optax_accum.microbatch(jax.value_and_grad(loss), k)`: one jitted step that
  runs the ``k`` micro-batches under one `lax.scan` (the within-step form).

It prints a table (final training loss, test accuracy, the largest parameter difference to the
large batch, the compiled peak memory of each step program from XLA's memory analysis, and the
time per example) and writes a PNG of the loss curves.

It also prints the gradient noise scale B_simple that `accumulate` measured for free from its
micro-batches (`optax_accum.noise_scale`), in micro-batches and examples.

The optional dependencies (flax, scikit-learn, tqdm, matplotlib) are imported inside `main`, so
importing this module never needs them. The other tasks (``lm``, ``dp``): see
`optax_accum.demo`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum
from optax_accum.core import _hlo
from optax_accum.demo import COMMAND, TASKS, require

_EXTRAS = ("flax", "sklearn", "tqdm", "matplotlib")
# Imports an optional dependency, or says how to install it.
_require = functools.partial(require, command=COMMAND)


@dataclasses.dataclass
class Result:
  """What one training method produced."""

  name: str
  losses: np.ndarray  # the training loss of each optimizer step's batch, before its update
  params: Any
  final_loss: float  # loss over the whole training set after training
  test_accuracy: float
  peak_bytes: int  # compiled peak memory of the step program (arguments + outputs + temps)
  temp_bytes: int  # of which temporaries (activations, gradients, ...)
  seconds: float  # wall time of the training loop, compilation excluded
  max_param_diff: float = float("nan")  # vs the large batch
  # accumulate only: the gradient noise scale B_simple after each optimizer step, in
  # micro-batches (`optax_accum.noise_scale`; NaN before the first window closed)
  b_simple: np.ndarray | None = None


# scikit-learn's digits: 1797 images, 359 of them (20%) held out for the test set.
DIGITS, TEST_FRACTION = 1797, 0.2
TRAIN_EXAMPLES = DIGITS - int(round(TEST_FRACTION * DIGITS))  # 1438: flags are checked against it


def load_digits(seed: int = 0, test_fraction: float = TEST_FRACTION):
  """scikit-learn's 8x8 handwritten digits, scaled to [0, 1], split into train and test."""
  datasets = _require("sklearn.datasets")
  x, y = datasets.load_digits(return_X_y=True)
  assert len(x) == DIGITS, f"scikit-learn's digits: {len(x)} images, not {DIGITS}"
  x = (x / 16.0).astype(np.float32)
  y = y.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  n_test = int(round(test_fraction * len(x)))
  test, train = order[:n_test], order[n_test:]
  return (x[train], y[train]), (x[test], y[test])


def batch_indices(n: int, batch_size: int, steps: int, seed: int = 0) -> np.ndarray:
  """(steps, batch_size) example indices: shuffled epochs, the incomplete last batch dropped.

  Every method trains on these same batches, so their results can be compared step by step.

  Args:
    n: the number of training examples.
    batch_size: examples per optimizer step (at most `n`).
    steps: the number of optimizer steps.
    seed: the shuffling seed.

  Returns:
    An int array of shape ``(steps, batch_size)``; each row holds distinct indices.

  Raises:
    ValueError: if `batch_size` exceeds `n`.

  >>> idx = batch_indices(10, 4, steps=3)
  >>> idx.shape, all(len(set(row)) == 4 for row in idx)
  ((3, 4), True)
  """
  if batch_size > n:
    raise ValueError(f"--batch-size must be at most the {n} training examples, got {batch_size}.")
  rng = np.random.default_rng(seed)
  per_epoch = n // batch_size
  rows = []
  while len(rows) < steps:
    perm = rng.permutation(n)
    rows.extend(perm[i * batch_size : (i + 1) * batch_size] for i in range(per_epoch))
  return np.stack(rows[:steps])


def make_model(hidden: int):
  nn = _require("flax.linen")

  class MLP(nn.Module):
    """Two hidden ReLU layers and a 10-way linear head."""

    hidden: int

    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(self.hidden)(x))
      x = nn.relu(nn.Dense(self.hidden)(x))
      return nn.Dense(10)(x)

  return MLP(hidden)


def _memory(compiled) -> tuple[int, int]:
  """(peak, temp) bytes of a compiled program from XLA's memory analysis (0 where unknown)."""
  m = _hlo.memory(compiled)
  return m.get("peak", 0), m.get("temp", 0)


def train(
  method: str,
  model,
  params0,
  data,
  idx: np.ndarray,
  *,
  k: int,
  learning_rate: float,
  progress: bool = True,
) -> Result:
  """Trains `model` from `params0` by one method on the batches `idx`; see the module doc."""
  tqdm = _require("tqdm").tqdm
  (x_train, y_train), (x_test, y_test) = data
  steps, batch_size = idx.shape

  def loss_fn(params, x, y):
    logits = model.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  adam = optax.adam(learning_rate)
  # accumulate keeps the noise-scale statistics too: a few scalars, free from its micro-batches.
  accumulating = method == "accumulate"
  tx = optax_accum.accumulate(adam, every_k=k, noise_scale=True) if accumulating else adam
  if method == "microbatch":
    grad_fn = optax_accum.microbatch(jax.value_and_grad(loss_fn), k, batch_argnums=(1, 2))
  else:
    grad_fn = jax.value_and_grad(loss_fn)

  def step(params, opt_state, x, y):
    loss, grads = grad_fn(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    b_simple = optax_accum.noise_scale(opt_state).b_simple if accumulating else jnp.nan
    return optax.apply_updates(params, updates), opt_state, (loss, b_simple)

  # A copy: the step donates its parameter and optimizer-state buffers.
  params = jax.tree.map(jnp.array, params0)
  opt_state = tx.init(params)
  # Micro-batch i of a batch holds rows i, i+k, i+2k, ... (the strided split `microbatch` uses).
  micro = [idx[:, i::k] for i in range(k)] if accumulating else [idx]
  shape_x = x_train[micro[0][0]]
  shape_y = y_train[micro[0][0]]
  bar = tqdm(total=steps, desc=f"{method:>11}", disable=not progress, leave=True)
  bar.set_postfix_str("compiling …", refresh=True)
  compiled = (
    jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, shape_x, shape_y).compile()
  )
  peak, temp = _memory(compiled)

  losses, b_simple = np.zeros(steps, np.float64), np.full(steps, np.nan)
  start = time.perf_counter()
  for s in range(steps):
    step_loss = []
    for rows in micro:
      params, opt_state, (loss, noise) = compiled(
        params, opt_state, x_train[rows[s]], y_train[rows[s]]
      )
      step_loss.append(loss)
    # Equal-sized micro-batches: the batch's mean loss is the mean of theirs.
    losses[s], b_simple[s] = float(np.mean(jax.device_get(step_loss))), float(noise)
    if s % 20 == 0 or s == steps - 1:
      postfix = {"B_simple": f"{b_simple[s]:.2f}"} if accumulating else {}
      bar.set_postfix(loss=f"{losses[s]:.4f}", **postfix, refresh=False)
    bar.update(1)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - start
  bar.close()

  final_loss, accuracy = map(float, _evaluate(model, params, x_train, y_train, x_test, y_test))
  return Result(
    method, losses, params, final_loss, accuracy, peak, temp, seconds,
    b_simple=b_simple if accumulating else None,
  )  # fmt: skip


@functools.partial(jax.jit, static_argnums=0)
def _evaluate(model, params, x_train, y_train, x_test, y_test):
  """The loss over the whole training set and the accuracy on the test set."""
  logits = model.apply(params, x_train)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y_train).mean()
  accuracy = jnp.mean(jnp.argmax(model.apply(params, x_test), -1) == y_test)
  return loss, accuracy


def _max_diff(a, b) -> float:
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return float(max(jnp.max(jnp.abs(x - y)) for x, y in pairs))


def _kib(n: int) -> str:
  return f"{n / 1024:,.0f} KiB" if n else "n/a"


def format_table(results: Sequence[Result], batch_size: int, k: int) -> str:
  """The results as a fixed-width text table."""
  head = (
    f"{'method':<12}{'final loss':>12}{'test acc':>10}{'max |Δparam|':>14}"
    f"{'peak mem':>12}{'temp mem':>12}{'µs/example':>12}"
  )
  lines = [head, "-" * len(head)]
  for r in results:
    per_example = 1e6 * r.seconds / (len(r.losses) * batch_size)
    lines.append(
      f"{r.name:<12}{r.final_loss:>12.5f}{r.test_accuracy:>10.4f}{r.max_param_diff:>14.2e}"
      f"{_kib(r.peak_bytes):>12}{_kib(r.temp_bytes):>12}{per_example:>12.2f}"
    )
  lines.append(
    f"(batch {batch_size} = {k} micro-batches of {batch_size // k}; peak/temp: XLA's compiled "
    "memory analysis of one step program; time excludes compilation)"
  )
  return "\n".join(lines)


def describe_noise(b_simple: np.ndarray, batch_size: int, k: int) -> str:
  """The line on the gradient noise scale that `accumulate` measured, in micro-batches.

  Args:
    b_simple: B_simple after each optimizer step, in micro-batches (NaN before it is known).
    batch_size: examples per optimizer step.
    k: micro-batches per optimizer step.

  Returns:
    One line: the last B_simple in micro-batches and in examples, against the batch.

  >>> print(describe_noise(np.array([np.nan, 2.0]), 256, 4))  # doctest: +NORMALIZE_WHITESPACE
  B_simple (gradient noise scale, accumulate's micro-batches): 2.00 micro-batches of 64
  = 128 examples at the last step (the batch: 4 micro-batches = 256 examples)
  """
  micro = batch_size // k
  last = float(b_simple[-1])
  return (
    f"B_simple (gradient noise scale, accumulate's micro-batches): {last:.2f} micro-batches of "
    f"{micro} = {last * micro:.0f} examples at the last step (the batch: {k} micro-batches = "
    f"{batch_size} examples)"
  )


_FLOOR = 1e-10


def plot(results: Sequence[Result], out: str, batch_size: int, k: int) -> None:
  """Writes the loss curves (and their differences to the large batch) to `out` as a PNG."""
  matplotlib = _require("matplotlib")
  matplotlib.use("Agg")
  plt = _require("matplotlib.pyplot")

  fig, (ax, ax_diff) = plt.subplots(1, 2, figsize=(11, 4.2))
  styles = {"large batch": ("-", 3.0), "accumulate": ("--", 1.6), "microbatch": (":", 1.6)}
  ref = results[0].losses
  for r in results:
    ls, lw = styles.get(r.name, ("-", 1.0))
    steps = np.arange(1, len(r.losses) + 1)
    ax.plot(steps, r.losses, ls, lw=lw, label=r.name)
    if r is not results[0]:
      # The curves lie on top of each other: show how far apart they are, on a log scale,
      # with bit-identical steps (a difference of exactly 0) drawn on the floor.
      diff = np.maximum(np.abs(r.losses - ref), _FLOOR)
      ax_diff.semilogy(steps, diff, "o" if r.name == "accumulate" else "x", ms=4, label=r.name)
  ax.set(
    xlabel="optimizer step",
    ylabel="training loss (cross-entropy)",
    title=f"Digits MLP, batch {batch_size}: one batch vs {k} micro-batches",
  )
  ax.set_yscale("log")
  ax.grid(alpha=0.3)
  ax.legend()
  ax_diff.set(
    xlabel="optimizer step",
    ylabel=f"|loss − large-batch loss|  (0 drawn at {_FLOOR:g})",
    title="Difference to the large batch: float32 rounding",
    ylim=(_FLOOR / 3, 1e-3),
  )
  ax_diff.grid(alpha=0.3)
  ax_diff.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog=COMMAND,
    description="Train a digits MLP three ways (large batch, accumulate, microbatch) and compare.",
    epilog="Other tasks, each with its own --help: "
    + "; ".join(f"`{COMMAND} {name}`: {what}" for name, (_, what) in TASKS.items())
    + ".",
  )
  p.add_argument("--k", type=int, default=4, help="micro-batches per optimizer step (default 4)")
  p.add_argument(
    "--batch-size", type=int, default=256, help="examples per optimizer step (default 256)"
  )
  p.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
  p.add_argument("--hidden", type=int, default=256, help="MLP hidden width (default 256)")
  p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
  p.add_argument("--seed", type=int, default=0, help="seed for init and data order")
  p.add_argument(
    "--out",
    default="digits_loss.png",
    help="PNG path for the loss curves (default digits_loss.png)",
  )
  p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  args = p.parse_args(argv)
  if args.k < 1:
    p.error(f"--k must be a positive int, got {args.k}")
  if args.steps < 1:
    p.error(f"--steps must be a positive int, got {args.steps}")
  if args.batch_size < 1 or args.batch_size % args.k:
    p.error(f"--batch-size must be a positive multiple of --k={args.k}, got {args.batch_size}")
  return args


def main(argv: Sequence[str] | None = None) -> list:
  """Runs the digits task; returns the three `Result`s (large batch first)."""
  args = parse_args(argv)
  for module in _EXTRAS:
    _require(module)
  data = load_digits(seed=args.seed)
  (x_train, _), (x_test, _) = data
  idx = batch_indices(len(x_train), args.batch_size, args.steps, seed=args.seed)
  model = make_model(args.hidden)
  params0 = model.init(jax.random.key(args.seed), x_train[:1])
  n_params = sum(x.size for x in jax.tree.leaves(params0))
  print(
    f"digits: {len(x_train)} train / {len(x_test)} test images, MLP 64-{args.hidden}-"
    f"{args.hidden}-10 ({n_params:,} params), Adam lr={args.lr}, {args.steps} steps of "
    f"batch {args.batch_size}, k={args.k}, {jax.devices()[0].platform}"
  )
  results = [
    train(
      method,
      model,
      params0,
      data,
      idx,
      k=args.k,
      learning_rate=args.lr,
      progress=not args.no_progress,
    )
    for method in ("large batch", "accumulate", "microbatch")
  ]
  for r in results:
    r.max_param_diff = _max_diff(r.params, results[0].params)
  print(format_table(results, args.batch_size, args.k))
  print(describe_noise(results[1].b_simple, args.batch_size, args.k))
  plot(results, args.out, args.batch_size, args.k)
  print(f"loss curves written to {args.out}")
  return results
