"""Sphinx configuration for the optax_accum documentation.

Build (warnings are errors, code cells executed): ``.ci/docs``, or
``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import sys
import tempfile

from jupyter_client.manager import AsyncKernelManager, KernelManager

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # document the source tree this conf.py belongs to
sys.path.insert(0, str(DOCS / "_ext"))

import guide_pages  # noqa: E402

import optax_accum  # noqa: E402

project = "optax_accum"
author = "optax_accum developers"
copyright = "optax_accum developers"
release = optax_accum.__version__
version = release
REPOSITORY = "https://github.com/optax-accum/optax_accum"  # placeholder, as in pyproject.toml

extensions = [
  "myst_nb",  # MyST markdown + notebooks (executes {code-cell}s); includes myst_parser
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",  # Google-style Args/Returns/Raises
  "sphinx.ext.viewcode",
  "optax_accum_docs",  # docs/_ext: API reference from __all__, its coverage check, copies
  "guide_pages",  # docs/_ext: each executed guide's "one script" note; the {output} role
  "sphinx.ext.mathjax",
  # MathJax 3 served from the site itself (copied into _static/mathjax/): formulas render
  # without a network. It sets `mathjax_path`; .ci/check_site.py checks every page with math.
  "sphinx-mathjax-offline",
]

exclude_patterns = ["_build", "README.md", "**.ipynb_checkpoints", "jupyter_execute"]
suppress_warnings: list[str] = []

# -- MyST / MyST-NB -------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist", "substitution"]
myst_heading_anchors = 3

# The figures the language-model guide quotes, from the committed run's results.json
# (``{{ lm_<name> }}``): a name the run did not write is an undefined substitution, an error.
LM_RUN = json.loads((ROOT / "benchmarks" / "results" / "lm" / "results.json").read_text())
myst_substitutions = {f"lm_{name}": value for name, value in LM_RUN["figures"].items()}
myst_substitutions["lm_command"] = f"`{LM_RUN['command']}`"

# Every {code-cell} of a MyST page is executed by the build that reads it, unless the cache
# below holds a run of the same cells; an exception in a cell fails the build. tests/
# test_guides_run.py runs every guide and records its run there, so CI runs each page once
# (`.ci/docs --executed-by-tests`); otherwise `.ci/docs` empties the cache first. The notebook
# copied from notebooks/ is rendered with its committed outputs (tests/test_notebooks.py
# executes it).
nb_execution_mode = "cache"
nb_execution_cache_path = str(guide_pages.EXECUTED)
# The kernels that run them talk to the build over IPC sockets in a private temporary
# directory, not TCP: nothing here needs a network port, and ipykernel ≥ 7 warns at every
# kernel start that TCP is unencrypted. myst-nb has no option that reaches the kernel manager,
# so this sets jupyter_client's defaults for this build: the transport, and an absolute socket
# path (its default, a relative "kernel-ipc", would resolve against two working directories:
# the build's and the page's, where the kernel runs).
_IPC_DIR = tempfile.mkdtemp(prefix="optax_accum_docs_kernels_")
atexit.register(shutil.rmtree, _IPC_DIR, ignore_errors=True)
for _manager in (KernelManager, AsyncKernelManager):
  _manager.transport.default_value = "ipc"
  _manager._ip_default = lambda self: os.path.join(_IPC_DIR, f"kernel-{id(self)}")
del _manager
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_timeout = 120
nb_execution_excludepatterns = ["_generated/notebooks/*.ipynb"]  # matched from the right
nb_merge_streams = True


# -- autodoc --------------------------------------------------------------------------------
default_role = "py:obj"  # `name` in docstrings links when it names a documented object
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_class_signature = "mixed"
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# -- HTML -----------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"optax_accum {release}"
html_theme_options = {
  "repository_url": REPOSITORY,
  "repository_branch": "main",
  "path_to_docs": "docs",
  "use_repository_button": True,
  "use_issues_button": True,
  "use_edit_page_button": False,
  "show_toc_level": 2,
  "navigation_with_keys": False,
  # The book theme's sidebar has the search field; without this, pydata-sphinx-theme 0.20
  # puts a second one in a header bar above the page.
  "navbar_persistent": [],
}
html_last_updated_fmt = None
# Wide tables scroll, code lines of 100 columns fit, figures take the page's width.
html_static_path = ["_static"]
html_css_files = ["optax_accum.css"]
