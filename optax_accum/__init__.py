"""optax_accum: exact gradient accumulation for JAX and optax."""

from optax_accum._accounting import dp_epsilon, dp_noise_multiplier
from optax_accum._accumulate import AccumulateState, accumulate, has_updated
from optax_accum._clipping import ClippedGrad, ClipStats, clipped_grad, clipped_loss
from optax_accum._data_parallel import data_parallel
from optax_accum._gain import GainState, progress, scale_by_gain
from optax_accum._hlo import count_collectives
from optax_accum._microbatch import microbatch
from optax_accum._noise import FollowNoiseScale, NoiseScale, noise_scale
from optax_accum._plan import MicrobatchPlan, plan_microbatches
from optax_accum._poisson import PoissonBatch, PoissonSampler
from optax_accum._privacy import DPNoiseState, dp_noise, dp_updates
from optax_accum._scan import MicrobatchInfo
from optax_accum._sharding import state_partition_specs
from optax_accum._train_step import TrainStep

__all__ = [
  "AccumulateState",
  "ClipStats",
  "ClippedGrad",
  "DPNoiseState",
  "FollowNoiseScale",
  "GainState",
  "MicrobatchInfo",
  "MicrobatchPlan",
  "NoiseScale",
  "PoissonBatch",
  "PoissonSampler",
  "TrainStep",
  "accumulate",
  "clipped_grad",
  "clipped_loss",
  "count_collectives",
  "data_parallel",
  "dp_epsilon",
  "dp_noise",
  "dp_noise_multiplier",
  "dp_updates",
  "has_updated",
  "microbatch",
  "noise_scale",
  "plan_microbatches",
  "progress",
  "scale_by_gain",
  "state_partition_specs",
]

__version__ = "0.1.0"
