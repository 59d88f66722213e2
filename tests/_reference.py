"""Large-batch references for the equivalence tests, shared by the test modules.

The tests prove one claim: k micro-batches of size b give what one batch of size k·b gives. The
reference side of every comparison is computed here *independently* of optax_accum: a direct
`jax.value_and_grad` of the loss on the whole batch, then one plain optax step on it.

Import it from a test module as ``import _reference as ref`` (pytest puts ``tests/`` on the path).

* `mlp_params`, `mlp_loss`, `regression_data` — a tiny MLP regression problem;
* `split` — a batch cut into k contiguous micro-batches (a list), `stack` — a list stacked on a
  new leading axis (what `lax.scan` consumes), `concat` — the inverse of `split`;

Parameters and data are host numpy arrays made with numpy's generator, and `split`/`concat`/
`stack` work on the host: eager JAX slicing compiles one tiny program per distinct slice, which
on a 2-core CI machine costs more than the tests themselves.
* `run_steps` — n optimizer steps, one per batch, jitted per step or driven by one `lax.scan`.
  The reference is ``run_steps(inner, params, loss, big_batches)``; the same function run on the
  micro-batches with an accumulating transformation is the side under test.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def mlp_params(seed: int, sizes: Sequence[int] = (3, 8, 2), dtype=np.float32) -> dict:
  """Parameters of a tanh MLP with layer widths `sizes` (a dict of w0, b0, w1, b1, ...)."""
  rng = np.random.default_rng(seed)
  params = {}
  for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
    params[f"w{i}"] = (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(dtype)
    params[f"b{i}"] = (0.1 * rng.standard_normal(n_out)).astype(dtype)
  return params


def mlp_apply(params: dict, x: jax.Array) -> jax.Array:
  n = len(params) // 2
  for i in range(n):
    x = x @ params[f"w{i}"] + params[f"b{i}"]
    if i < n - 1:
      x = jnp.tanh(x)
  return x


def mlp_loss(params: dict, batch: dict) -> jax.Array:
  """Mean squared error of the MLP over the batch's examples (a mean, so batch-size free)."""
  pred = mlp_apply(params, batch["x"])
  return jnp.mean(jnp.sum((pred - batch["y"]) ** 2, axis=-1))


def regression_data(seed: int, n: int, d_in: int = 3, d_out: int = 2, dtype=np.float32) -> dict:
  """`n` examples ``{"x": (n, d_in), "y": (n, d_out)}`` of a noisy nonlinear target."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d_in))
  w = rng.standard_normal((d_in, d_out))
  y = np.sin(x @ w) + 0.1 * rng.standard_normal((n, d_out))
  return {"x": x.astype(dtype), "y": y.astype(dtype)}


def split(batch: Any, k: int) -> list:
  """Cuts every leaf's leading axis into `k` equal contiguous micro-batches."""
  sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch)}
  (n,) = sizes
  assert n % k == 0, f"batch of {n} does not split into {k}"
  b = n // k
  return [jax.tree.map(lambda x, i=i: x[i * b : (i + 1) * b], batch) for i in range(k)]


def concat(batches: Sequence[Any]) -> Any:
  """Concatenates batches along the leading axis (the large batch of some micro-batches)."""
  return jax.tree.map(lambda *xs: np.concatenate(xs), *batches)


def stack(batches: Sequence[Any]) -> Any:
  """Stacks equally shaped batches on a new leading axis (numpy on host, jnp under a trace)."""
  host = all(isinstance(x, np.ndarray) for x in jax.tree.leaves(batches))
  return jax.tree.map(lambda *xs: (np.stack if host else jnp.stack)(xs), *batches)


@functools.cache
def _program(tx: optax.GradientTransformation, loss_fn: Callable, scan: bool):
  """The jitted step (or whole scan) of `run_steps`, cached: same tx and loss, no recompile."""

  def step(carry, batch):
    params, state = carry
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), None

  if scan:
    return jax.jit(lambda carry, xs: jax.lax.scan(step, carry, xs)[0])
  return jax.jit(lambda carry, batch: step(carry, batch)[0])


def run_steps(
  tx: optax.GradientTransformation,
  params: Any,
  loss_fn: Callable[[Any, Any], jax.Array],
  batches: Sequence[Any],
  *,
  scan: bool = False,
  state: Any = None,
) -> tuple[Any, Any]:
  """One `tx` step per batch: ``g = grad(loss_fn)(params, batch)``, update, apply.

  Args:
    tx: any optax transformation (a plain optimizer for the reference).
    params: initial parameters.
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    batches: a sequence of batches, one step each.
    scan: False runs one jitted step per batch; True runs all steps in one jitted `lax.scan`
      whose carry is ``(params, state)``.
    state: the initial optimizer state; ``tx.init(params)`` when None.

  Returns:
    ``(params, state)`` after the last step.

  The compiled programs are cached per ``(tx, loss_fn, scan)``: reuse one `tx` object (and a
  module-level loss) across tests to compile each reference once per process.
  """
  if state is None:
    state = tx.init(params)
  run = _program(tx, loss_fn, scan)
  if scan:
    return run((params, state), stack(batches))
  carry = (params, state)
  for batch in batches:
    carry = run(carry, batch)
  return carry
