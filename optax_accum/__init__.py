"""optax_accum: exact gradient accumulation for JAX and optax.

The private-training pieces (clipping, DP noise, accounting, Poisson sampling) live in the
public subpackage :mod:`optax_accum.privacy`.
"""

# The public subpackage, as optax keeps its families (optax.contrib, optax.losses): it imports
# the core's modules, never the reverse.
from optax_accum import privacy as privacy
from optax_accum.auditing import AuditReport, audit
from optax_accum.batch_size import (
  FollowNoiseScale,
  GainState,
  NoiseScale,
  noise_scale,
  progress,
  scale_by_gain,
)
from optax_accum.core import AccumulateState, count_collectives, has_updated, window_mean_grad
from optax_accum.front_ends import (
  MicrobatchInfo,
  MicrobatchPlan,
  TrainStep,
  accumulate,
  microbatch,
  plan_microbatches,
)
from optax_accum.parallel import data_parallel, state_partition_specs

__all__ = [
  "AccumulateState",
  "AuditReport",
  "FollowNoiseScale",
  "GainState",
  "MicrobatchInfo",
  "MicrobatchPlan",
  "NoiseScale",
  "TrainStep",
  "accumulate",
  "audit",
  "count_collectives",
  "data_parallel",
  "has_updated",
  "microbatch",
  "noise_scale",
  "plan_microbatches",
  "progress",
  "scale_by_gain",
  "state_partition_specs",
  "window_mean_grad",
]

__version__ = "0.1.0"
