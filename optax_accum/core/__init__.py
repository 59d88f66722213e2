"""The accumulation core, and what every other folder shares.

One window's arithmetic (`_core`: zeros, the finite check, the weighted add, the guarded mean),
the state that holds it between micro-steps (`_state`), the checks of the arguments that every
front end takes (`_checks`), batch parsing and output plans (`_batch`, `_outputs`), the state
finder (`_find`), the shared types (`_typing`) and the compiled-program reader (`_hlo`). It
imports no other folder of the package.
"""

from optax_accum.core._hlo import count_collectives
from optax_accum.core._state import AccumulateState, has_updated, window_mean_grad

__all__ = ["AccumulateState", "count_collectives", "has_updated", "window_mean_grad"]
