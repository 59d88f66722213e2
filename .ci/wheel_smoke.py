"""Smoke test of an installed optax_accum wheel, run by .ci/package outside the repository.

Usage: python wheel_smoke.py <wheel file name>
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

wheel_version = sys.argv[1].split("-")[1]
location = pathlib.Path(optax_accum.__file__).resolve()
assert "site-packages" in location.parts, f"optax_accum imported from {location}, not the venv"
assert optax_accum.__version__ == wheel_version, (optax_accum.__version__, wheel_version)
assert importlib.metadata.version("optax-accum") == wheel_version
assert importlib.resources.files("optax_accum").joinpath("py.typed").is_file(), "no py.typed"
for name in optax_accum.__all__:
  getattr(optax_accum, name)
# Every subject folder shipped, each with its face (setuptools finds packages by their
# __init__.py: a folder without one would be left out of the wheel).
FOLDERS = ("core", "batch_size", "parallel", "front_ends", "auditing", "privacy", "demo")
package = importlib.resources.files("optax_accum")
missing = [f for f in FOLDERS if not package.joinpath(f, "__init__.py").is_file()]
assert not missing, f"the wheel lacks the folders {missing}"
shipped = {
  f"{folder}/{m.name}"
  for folder in FOLDERS
  for m in package.joinpath(folder).iterdir()
  if m.name.endswith(".py")
}


def loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


rng = np.random.default_rng(0)
batch = {"x": rng.standard_normal((16, 3), np.float32), "y": rng.standard_normal(16, np.float32)}
params = {"w": np.zeros(3, np.float32)}
inner = optax.adamw(1e-2)

# The large batch: one step on all 16 examples.
updates, _ = inner.update(jax.grad(loss)(params, batch), inner.init(params), params)
want = optax.apply_updates(params, updates)

# accumulate: four micro-batches of 4 examples.
tx = optax_accum.accumulate(inner, every_k=4)
state = tx.init(params)
for i in range(4):
  micro = jax.tree.map(lambda a, i=i: a[4 * i : 4 * i + 4], batch)
  updates, state = tx.update(jax.grad(loss)(params, micro), state, params)
got = optax.apply_updates(params, updates)
np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6, atol=1e-7)
assert int(state.gradient_step) == 1

print(
  f"wheel smoke: optax_accum {optax_accum.__version__} from {location.parent}, py.typed present, "
  f"{len(FOLDERS)} folders ({len(shipped)} modules), {len(optax_accum.__all__)} public names, "
  "accumulate(adamw, 4) == large batch "
  f"(max |diff| {float(np.max(np.abs(got['w'] - want['w']))):.1e}); jax {jax.__version__}"
)
