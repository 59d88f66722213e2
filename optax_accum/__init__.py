"""optax_accum: exact gradient accumulation for JAX and optax.

The private-training pieces (clipping, DP noise, accounting, Poisson sampling) live in the
public subpackage :mod:`optax_accum.privacy`.
"""

# The public subpackage, as optax keeps its families (optax.contrib, optax.losses): it imports
# the core's modules, never the reverse.
from optax_accum import privacy as privacy
from optax_accum._accumulate import AccumulateState, accumulate, has_updated, window_mean_grad
from optax_accum._audit import AuditReport, audit
from optax_accum._data_parallel import data_parallel
from optax_accum._gain import GainState, progress, scale_by_gain
from optax_accum._hlo import count_collectives
from optax_accum._microbatch import microbatch
from optax_accum._noise import FollowNoiseScale, NoiseScale, noise_scale
from optax_accum._plan import MicrobatchPlan, plan_microbatches
from optax_accum._scan import MicrobatchInfo
from optax_accum._sharding import state_partition_specs
from optax_accum._train_step import TrainStep

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
