"""The private names live in `optax_accum.privacy`; the top level keeps the accumulation core.

The library's other folders (core, batch_size, parallel, front_ends, auditing) and the package's
own modules never import the privacy subpackage: a reader knows from the import where a name
belongs and what it may depend on.
"""

import ast
import pathlib

import optax_accum
from optax_accum import privacy

PRIVATE_NAMES = {
  "ClipStats",
  "ClippedGrad",
  "DPNoiseState",
  "Mechanism",
  "PoissonBatch",
  "PoissonSampler",
  "clipped_grad",
  "clipped_loss",
  "dp_epsilon",
  "dp_noise",
  "dp_noise_multiplier",
  "dp_updates",
}
PACKAGE = pathlib.Path(optax_accum.__file__).parent


def test_privacy_subpackage_holds_the_private_names():
  assert set(privacy.__all__) >= PRIVATE_NAMES
  for name in privacy.__all__:
    obj = getattr(privacy, name)
    assert obj.__module__.startswith("optax_accum.privacy."), (name, obj.__module__)


def test_top_level_holds_no_private_name():
  assert not PRIVATE_NAMES & set(optax_accum.__all__)
  assert not [n for n in PRIVATE_NAMES if hasattr(optax_accum, n)]


def _imported_modules(path: pathlib.Path) -> set[str]:
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      found.add(node.module)
      found.update(f"{node.module}.{a.name}" for a in node.names)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
  return found


def test_core_never_imports_privacy():
  # Every library module outside privacy/ and the demo (a client, on top of everything); the
  # package's own __init__ hands the subpackage on and is no module of the core.
  core = [
    p
    for p in PACKAGE.rglob("*.py")
    if p.parts[len(PACKAGE.parts)] not in ("privacy", "demo") and p != PACKAGE / "__init__.py"
  ]
  assert len(core) > 20, core
  leaks = {
    str(p.relative_to(PACKAGE)): sorted(
      m for m in _imported_modules(p) if m.startswith("optax_accum.privacy")
    )
    for p in core
  }
  assert not {k: v for k, v in leaks.items() if v}, leaks
