"""The front ends a user calls: across steps (`accumulate`, `TrainStep`), within one step
(`microbatch`, its loop and NNX threading), and the planner of `microbatch`'s k.

`_accumulate` is the optax transformation, built from `_config` (its configuration and the
checks of a call) and `_window` (add, close, advance); `TrainStep` (`_train_step`, with
`_fsdp_train_step` for sharded parameters and `_host` for what a host-side driver checks of the
arrays it is given) compiles its programs from the same pieces. `_microbatch` (its argument
checks in `_microbatch_checks`) runs `_scan`'s loop, threading NNX objects through `_nnx`;
`_plan` picks its k from compiled memory. Imports the core, the batch size and parallel.
"""

from optax_accum.front_ends._accumulate import accumulate
from optax_accum.front_ends._microbatch import microbatch
from optax_accum.front_ends._plan import MicrobatchPlan, plan_microbatches
from optax_accum.front_ends._scan import MicrobatchInfo
from optax_accum.front_ends._train_step import TrainStep

__all__ = [
  "MicrobatchInfo",
  "MicrobatchPlan",
  "TrainStep",
  "accumulate",
  "microbatch",
  "plan_microbatches",
]
