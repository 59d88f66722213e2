"""optax_accum.privacy: differentially private training on top of the accumulation core.

DP-SGD with exact virtual batches: per-example clipping (``clipped_grad``, ``clipped_loss``),
Gaussian noise drawn once per logical batch (``dp_noise``), the accountant (``dp_epsilon``,
``dp_noise_multiplier``) and Poisson sampling (``PoissonSampler``). The accumulation core never
imports this package; its front ends recognise a private chain and check their options against
the privacy contract.
"""

from optax_accum.privacy import _guard
from optax_accum.privacy._accounting import dp_epsilon, dp_noise_multiplier
from optax_accum.privacy._audit import (
  AuditResult,
  audit_epsilon,
  audit_updates,
  epsilon_lower_bound,
)
from optax_accum.privacy._clipping import (
  ClipAux,
  ClippedGrad,
  ClipStats,
  clipped_grad,
  clipped_loss,
)
from optax_accum.privacy._contract import CONTRACT, ContractRow, contract_table
from optax_accum.privacy._mechanism import Mechanism
from optax_accum.privacy._noise import DPNoiseState, dp_noise, dp_updates
from optax_accum.privacy._poisson import PoissonBatch, PoissonSampler

_guard.install()  # the front ends' private-path checks (`optax_accum.core._checks.private_check`)

__all__ = [
  "AuditResult",
  "CONTRACT",
  "ClipAux",
  "ClipStats",
  "ClippedGrad",
  "ContractRow",
  "DPNoiseState",
  "Mechanism",
  "PoissonBatch",
  "PoissonSampler",
  "audit_epsilon",
  "audit_updates",
  "clipped_grad",
  "clipped_loss",
  "contract_table",
  "dp_epsilon",
  "dp_noise",
  "dp_noise_multiplier",
  "dp_updates",
  "epsilon_lower_bound",
]
