"""The language-model task of the main job: ``python -m optax_accum.demo lm``.

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

import importlib

_EXTRAS = {
  "flax": "flax",
  "sklearn": "scikit-learn",
  "grain": "grain",
  "tqdm": "tqdm",
  "matplotlib": "matplotlib",
  "orbax": "orbax-checkpoint",
}


def require(module: str, command: str = "python -m optax_accum.demo lm"):
  """Imports an optional dependency of the main job, or says how to install it."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    package = _EXTRAS[module.split(".")[0]]
    how = "pip install 'optax-accum[examples]'"
    if package == "orbax-checkpoint":
      how = "pip install orbax-checkpoint"
    raise ImportError(
      f"`{command}` needs {package!r}, which is not installed. Install it:\n\n    {how}\n\n"
      "(or, from a clone of the repository: pip install -e '.[examples]')."
    ) from e
