"""Type aliases shared by the modules (one definition each)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import jax

# A mapped axis (shard_map mesh axis, pmap axis_name), or several of them.
AxisName = str | tuple[str, ...]
# Anything `jnp.dtype` accepts: jnp.float32, "bfloat16", np.dtype(...).
DType = jax.typing.DTypeLike
# One position or several, as in `jax.grad(argnums=...)`.
ArgNums = int | Sequence[int]

# How `accumulate` (and the core) combines a window: the weighted mean, or the sum.
Reduction = Literal["mean", "sum"]
REDUCTIONS: tuple[str, ...] = get_args(Reduction)

# How `microbatch` combines one output leaf over the micro-batches: the weighted mean, the
# weighted sum, per-example rows joined in batch order, one entry per micro-batch stacked on a
# new leading axis, or the last micro-batch's value.
OutReduction = Literal["mean", "sum", "concat", "stack", "last"]
OUT_REDUCTIONS: tuple[str, ...] = get_args(OutReduction)

# Which rows go into micro-batch i.
Split = Literal["strided", "contiguous"]
SPLITS: tuple[str, ...] = get_args(Split)
