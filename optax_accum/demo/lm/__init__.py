"""The language-model task of the demos: ``python -m optax_accum.demo lm``.

A small causal byte-level transformer (Flax NNX) trained on the Python standard library's source
four ways on the same micro-batches, a memory budget that the recipe's batch exceeds, and an
Orbax-checkpointed run that resumes bit for bit. Modules, one idea each: `data` (the corpus and
the grain pipeline), `model` (the transformer and its token-masked loss), `methods` (the four
training runs), `budget` (the memory plan), `report` (table and figure), `resume` (the
checkpointed run), `cli` (the command line).

The optional dependencies (flax, grain, tqdm, matplotlib; orbax-checkpoint for the checkpointed
run) are imported where they are used, so importing these modules never needs them.
"""

from __future__ import annotations

import functools

from optax_accum import demo

# Imports an optional dependency of the task, or says how to install it.
require = functools.partial(demo.require, command=f"{demo.COMMAND} lm")
