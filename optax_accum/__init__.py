"""optax_accum: exact gradient accumulation for JAX and optax."""

from optax_accum._accumulate import AccumulateState, accumulate, has_updated
from optax_accum._train_step import TrainStep

__all__ = [
  "AccumulateState",
  "TrainStep",
  "accumulate",
  "has_updated",
]

__version__ = "0.1.0"
