"""How large a batch should be: the gradient noise scale, and the gain (AdaScale) that scales
the learning rate by it.

`_noise` keeps the noise statistics each front end adds a micro-batch to, and decides
`FollowNoiseScale`'s window lengths; `_gain` is `scale_by_gain`, which reads them. Imports the
core only.
"""

from optax_accum.batch_size._gain import GainState, progress, scale_by_gain
from optax_accum.batch_size._noise import FollowNoiseScale, NoiseScale, noise_scale

__all__ = [
  "FollowNoiseScale",
  "GainState",
  "NoiseScale",
  "noise_scale",
  "progress",
  "scale_by_gain",
]
