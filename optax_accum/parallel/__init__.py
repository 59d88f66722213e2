"""Many devices: the data axis and its collectives, the binder that binds it under plain
`jax.jit`, FSDP's gathers and reduce-scatters, partition specs of any optimizer state, and
`data_parallel`.

`_collectives` resolves an axis once into the object every front end hands down; `_gspmd` binds
it over a mesh; `_fsdp` plans what stays gathered for a window; `_sharding` gives the state's
partition specs; `_data_parallel` binds a whole user step. Imports the core and the batch size
(the noise statistics FSDP reduces) only.
"""

from optax_accum.parallel._data_parallel import data_parallel
from optax_accum.parallel._sharding import state_partition_specs

__all__ = ["data_parallel", "state_partition_specs"]
