"""The batch that does not fit: `plan_microbatches` under a memory budget.

The recipe asks for a batch of ``batch_size`` sequences per optimizer step. The budget stands for
the accelerator's memory (a CPU reports none, so it is given in MiB). `plan_microbatches`
compiles the gradient program ``microbatch(value_and_grad(loss), k)`` for candidate ``k`` —
never runs it — and picks the fewest micro-batches whose compiled peak (XLA's memory analysis)
fits.
"""

from __future__ import annotations

import jax
import numpy as np

import optax_accum
from optax_accum.demo.lm import model

MIB = 2.0**20


def batch_shape(batch_size: int, seq_len: int) -> dict:
  """The abstract large batch: `jax.ShapeDtypeStruct`s, so it need never exist in memory."""
  return {
    "tokens": jax.ShapeDtypeStruct((batch_size, seq_len + 1), np.int32),
    "mask": jax.ShapeDtypeStruct((batch_size, seq_len), np.float32),
  }


def plan(loss, params, batch_size: int, seq_len: int, budget_bytes: int):
  """The plan for the recipe's batch under `budget_bytes`, token-weighted as it trains."""
  return optax_accum.plan_microbatches(
    jax.value_and_grad(loss),
    params,
    batch_shape(batch_size, seq_len),
    memory_limit=budget_bytes,
    batch_argnums=(1,),
    weight_fn=model.real_tokens,
    split="contiguous",
  )


def large_batch_peak(p) -> int:
  """The compiled peak of the whole batch in one program (k = 1), from the plan."""
  return p.peak_bytes[1]


def describe(p, batch_size: int) -> str:
  """The plan line: the budget, and the gradient program's compiled peak whole and at the k
  that `plan_microbatches` chose (it sizes the gradient program, not the optimizer update)."""
  k = p.num_microbatches
  large = large_batch_peak(p)
  verdict = "exceeds" if large > p.memory_limit else "fits"
  return (
    f"memory budget {p.memory_limit / MIB:.1f} MiB: the gradient program of the batch of "
    f"{batch_size} needs {large / MIB:.1f} MiB (XLA's compiled peak; {verdict} the budget) -> "
    f"plan_microbatches: k={k} micro-batches of {batch_size // k}, gradient program peak "
    f"{p.peak_bytes[k] / MIB:.1f} MiB"
  )


def step_peaks(p, results) -> str:
  """The step line: each run's peak memory as the table gives it (the whole training step,
  gradient and Adam update), against the budget."""
  within = [r for r in results if r.peak_bytes and r.peak_bytes <= p.memory_limit]
  over = [r for r in results if r.peak_bytes and r.peak_bytes > p.memory_limit]
  said = lambda rs: ", ".join(f"{r.name} {r.peak_bytes / MIB:.2f} MiB" for r in rs)  # noqa: E731
  return (
    "peak memory (the table's: XLA's compiled peak of the whole training step, gradient and "
    "Adam update, parameters and optimizer state donated; the gradient program above is part "
    f"of it): within the {p.memory_limit / MIB:.1f} MiB budget {said(within) or 'none'}; "
    f"over it {said(over) or 'none'}"
  )
