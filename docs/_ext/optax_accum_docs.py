"""Sphinx extension for the optax_accum docs: the API reference from `__all__`, and its check.

Directives (use them inside ``{eval-rst}`` blocks of a MyST page, since autodoc renders the
docstrings as reStructuredText):

* ``.. api-summary::`` — a table of every name in ``optax_accum.__all__`` with the first
  line of its docstring, each linked to its entry.
* ``.. api-members::`` with one public name per content line — the full autodoc entries of
  those names, in that order. A name that is not in ``__all__`` is an error.
* ``.. api-remaining::`` — the entries of every name in ``__all__`` that no ``api-members``
  on the same page has listed (under an "Other public names" rubric; nothing when there is
  none), so a name added to ``__all__`` appears without editing the docs.

At the end of reading, the build fails (``ApiCoverageError``) if a name of ``__all__`` has no
entry in the rendered reference. A plural after interpreted text in a docstring (`Array`s)
is made valid reStructuredText. Fields of ``NamedTuple`` classes get their description from
the comment beside them in the source, instead of autodoc's "Alias for field number N".

At ``config-inited`` the files that live outside ``docs/`` (the notebook, the benchmark
results) are copied into ``docs/_generated/``, which git ignores: Sphinx only reads sources
under its source directory, and a copy keeps one committed original of each. For each
backend's committed run, ``_generated/benchmarks/<backend>/figures.inc`` lists its plots as
MyST figures, captioned from its ``results.json`` (the Benchmarks page includes it), so a
plot added by a new run appears without editing the page.
"""

from __future__ import annotations

import filecmp
import importlib
import inspect
import json
import pathlib
import re
import shutil
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.errors import SphinxError
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

PACKAGE = "optax_accum"
DOCS = pathlib.Path(__file__).resolve().parent.parent
ROOT = DOCS.parent
GENERATED = DOCS / "_generated"

logger = logging.getLogger(__name__)


class ApiCoverageError(SphinxError):
  category = "API reference incomplete"


# Public subpackages: their names are listed as ``privacy.clipped_grad`` on the API page.
SUBPACKAGES = ("privacy",)


def _public_names() -> list[str]:
  names = list(importlib.import_module(PACKAGE).__all__)
  for sub in SUBPACKAGES:
    names += [f"{sub}.{n}" for n in importlib.import_module(f"{PACKAGE}.{sub}").__all__]
  return names


def _entry(name: str) -> str:
  module, _, attr = f"{PACKAGE}.{name}".rpartition(".")
  obj = getattr(importlib.import_module(module), attr)
  if inspect.isclass(obj):
    return f".. autoclass:: {PACKAGE}.{name}\n   :members:\n"
  if callable(obj):
    return f".. autofunction:: {PACKAGE}.{name}\n"
  return f".. autodata:: {PACKAGE}.{name}\n"


def _note_api_page(env: Any) -> None:
  if not hasattr(env, "optax_accum_api_pages"):
    env.optax_accum_api_pages = set()
  env.optax_accum_api_pages.add(env.docname)


def _listed(env: Any) -> set[str]:
  # temp_data is cleared after each document, so this is "listed on this page so far".
  return env.temp_data.setdefault("optax_accum_api_listed", set())


class ApiSummary(SphinxDirective):
  """A table of every public name, linked to its entry."""

  def run(self) -> list[nodes.Node]:
    _note_api_page(self.env)
    rows = "".join(f"   ~{PACKAGE}.{name}\n" for name in _public_names())
    return self.parse_text_to_nodes(f".. autosummary::\n\n{rows}")


class ApiMembers(SphinxDirective):
  """The autodoc entries of the public names in the content, in order."""

  has_content = True

  def run(self) -> list[nodes.Node]:
    _note_api_page(self.env)
    public = _public_names()
    names = [line.strip() for line in self.content if line.strip()]
    unknown = [n for n in names if n not in public]
    if unknown:
      raise self.error(f"api-members: {unknown} not in {PACKAGE}.__all__ (public names: {public})")
    listed = _listed(self.env)
    twice = [n for n in names if n in listed]
    if twice:
      raise self.error(f"api-members: {twice} already listed on this page")
    listed.update(names)
    return self.parse_text_to_nodes("\n".join(_entry(n) for n in names))


class ApiRemaining(SphinxDirective):
  """The autodoc entries of every public name not yet listed on this page."""

  def run(self) -> list[nodes.Node]:
    _note_api_page(self.env)
    listed = _listed(self.env)
    names = [n for n in _public_names() if n not in listed]
    listed.update(names)
    if not names:
      return []
    heading = ".. rubric:: Other public names\n\n"
    return self.parse_text_to_nodes(heading + "\n".join(_entry(n) for n in names))


def reread_api_pages(app: Sphinx, env: Any, added: Any, changed: Any, removed: Any) -> list[str]:
  """Re-reads the API pages on every build: docstrings live in modules Sphinx does not watch."""
  return sorted(getattr(env, "optax_accum_api_pages", set()))


def purge_api_page(app: Sphinx, env: Any, docname: str) -> None:
  getattr(env, "optax_accum_api_pages", set()).discard(docname)


def merge_api_pages(app: Sphinx, env: Any, docnames: Any, other: Any) -> None:
  if not hasattr(env, "optax_accum_api_pages"):
    env.optax_accum_api_pages = set()
  env.optax_accum_api_pages |= getattr(other, "optax_accum_api_pages", set())


def check_api_coverage(app: Sphinx, env: Any) -> None:
  """Fails the build when a name of ``__all__`` has no entry in the reference."""
  documented = env.get_domain("py").objects
  missing = [n for n in _public_names() if f"{PACKAGE}.{n}" not in documented]
  if missing:
    raise ApiCoverageError(
      f"{PACKAGE}.__all__ names missing from the API reference: {missing}. "
      "docs/api.md must end with `.. api-remaining::` (or list them in `.. api-members::`)."
    )
  logger.info(f"[optax_accum_docs] API reference covers all {len(_public_names())} public names")


# `name`s (a plural after interpreted text) reads well in plain text but is invalid
# reStructuredText; an escaped space ends the interpreted text without showing a space.
_PLURAL_AFTER_ROLE = re.compile(r"(?<!`)(`[^`\s][^`]*`)(?!`)(?=\w)")


def allow_plural_after_role(
  app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
  lines[:] = [_PLURAL_AFTER_ROLE.sub(r"\1\\ ", line) for line in lines]


_FIELD = re.compile(r"^(\w+)\s*:[^#]*?(?:#\s*(.*))?$")


def _field_comments(cls: type) -> dict[str, str]:
  """``{field: comment}`` from the ``name: type  # comment`` lines of a NamedTuple's source."""
  out: dict[str, str] = {}
  pending: list[str] = []
  for line in inspect.getsource(cls).splitlines()[1:]:
    text = line.strip()
    if text.startswith("#"):
      pending.append(text[1:].strip())
      continue
    match = _FIELD.match(text)
    if match and match.group(1) in cls._fields:
      out[match.group(1)] = " ".join(pending + [match.group(2) or ""]).strip()
    pending = []
  return out


def describe_namedtuple_fields(
  app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
  if what not in ("attribute", "property") or not (
    lines and lines[0].startswith("Alias for field number")
  ):
    return
  owner_path, _, field = name.rpartition(".")
  module_name, _, cls_name = owner_path.rpartition(".")
  try:
    cls = getattr(importlib.import_module(module_name), cls_name)
    comment = _field_comments(cls).get(field)
  except (ImportError, AttributeError, OSError, TypeError):
    return
  if comment:
    lines[:] = [comment]


def _copy_if_changed(src: pathlib.Path, dst: pathlib.Path) -> None:
  if dst.exists() and filecmp.cmp(src, dst, shallow=False):
    return  # an unchanged copy keeps its mtime, so Sphinx does not re-read it
  dst.parent.mkdir(parents=True, exist_ok=True)
  shutil.copyfile(src, dst)


def copy_outside_sources(app: Sphinx, config: Any) -> None:
  """Copies the notebook and the benchmark results into ``docs/_generated/``."""
  wanted: dict[pathlib.Path, pathlib.Path] = {}
  for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
    wanted[GENERATED / "notebooks" / notebook.name] = notebook
  for result in sorted((ROOT / "benchmarks" / "results").glob("*/*")):
    if result.suffix in (".md", ".png") and result.parent.name != "tmp":
      wanted[GENERATED / "benchmarks" / result.parent.name / result.name] = result
  # A section run on its own (`bench.py --only noise --out benchmarks/results/cpu/noise`): its
  # page is `<backend>/<section>.md`.
  for result in sorted((ROOT / "benchmarks" / "results").glob("*/*/results.md")):
    backend, section = result.parent.parent.name, result.parent.name
    if backend != "tmp":
      wanted[GENERATED / "benchmarks" / backend / f"{section}.md"] = result
  for dst, src in wanted.items():
    _copy_if_changed(src, dst)
  if GENERATED.exists():  # drop copies whose original is gone
    for stale in sorted(GENERATED.rglob("*"), reverse=True):
      if stale.is_file() and stale not in wanted and stale.name != "figures.inc":
        stale.unlink()
      elif stale.is_dir() and not any(stale.iterdir()):
        stale.rmdir()
  check_lm_run(ROOT / "benchmarks" / "results" / "lm")
  for results in sorted((ROOT / "benchmarks" / "results").glob("*/results.json")):
    backend = results.parent.name
    if backend == "lm":  # the language-model run: its figures are the guide's (substitutions)
      continue
    text = _figures(json.loads(results.read_text()), backend, sorted(results.parent.glob("*.png")))
    dst = GENERATED / "benchmarks" / backend / "figures.inc"
    if not dst.exists() or dst.read_text() != text:  # unchanged: Sphinx need not re-read
      dst.parent.mkdir(parents=True, exist_ok=True)
      dst.write_text(text)


class LmRunError(SphinxError):
  category = "language-model run inconsistent"


def check_lm_run(run: pathlib.Path) -> None:
  """The language-model guide quotes ``results.json`` and shows ``results.md`` and the plot of
  the committed run: all three must come from one run (its command and wall time in both)."""
  quoted = json.loads((run / "results.json").read_text())
  table = (run / "results.md").read_text()
  said = [f"Made by `{quoted['command']}`.", f"Wall time {quoted['figures']['wall_s']} s "]
  missing = [s for s in said if s not in table]
  if missing or not (run / "lm_loss.png").is_file():
    raise LmRunError(
      f"{run}: results.json and results.md are not from the same run (results.md lacks "
      f"{missing}), or lm_loss.png is missing: make them again with the command in results.json."
    )


def _figures(res: dict[str, Any], backend: str, pngs: list[pathlib.Path]) -> str:
  """MyST figures for a run's plots, paths relative to ``docs/``, captions from its meta."""
  meta = res.get("meta", {})  # the gain experiments' results say which run made each part
  models, within = meta.get("models", {}), meta.get("within_model", {})
  captions = {
    f"cross_{name}": f"Cross-step, {m.get('shape', name)} ({m['params']:,} parameters, "
    f"micro-batch {m['micro']}): time per micro-step against plain Adam, and compiled temp."
    for name, m in models.items()
  }
  captions["within"] = (
    f"Within one step, global batch {within.get('global_batch', '?')}, "
    f"{within.get('name', '')}: time per example, compiled peak and compile time against k."
  )
  captions["precision"] = "bf16 gradients: error of each accumulator against the float64 mean."
  order = [*captions]  # cross-step models in run order, then within, then precision
  out = []
  for png in sorted(pngs, key=lambda f: order.index(f.stem) if f.stem in order else len(order)):
    caption = captions.get(png.stem, png.stem)
    path = f"_generated/benchmarks/{backend}/{png.name}"
    out += [f"```{{figure}} {path}", f":alt: {caption}", "", caption, "```", ""]
  return "\n".join(out)


def setup(app: Sphinx) -> dict[str, Any]:
  app.add_directive("api-summary", ApiSummary)
  app.add_directive("api-members", ApiMembers)
  app.add_directive("api-remaining", ApiRemaining)
  app.connect("config-inited", copy_outside_sources)
  app.connect("env-get-outdated", reread_api_pages)
  app.connect("env-purge-doc", purge_api_page)
  app.connect("env-merge-info", merge_api_pages)
  app.connect("env-check-consistency", check_api_coverage)
  app.connect("autodoc-process-docstring", describe_namedtuple_fields)
  app.connect("autodoc-process-docstring", allow_plural_after_role)
  return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
