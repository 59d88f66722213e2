"""`.ci/check_site.py`, the docs build's check that no formula shows as raw LaTeX, on small
hand-written pages: it must pass a page whose math loads the site's own MathJax, and fail a page
with raw LaTeX in its text, or whose MathJax comes from the network (offline: raw LaTeX)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

CHECK = pathlib.Path(__file__).resolve().parent.parent / ".ci" / "check_site.py"
spec = importlib.util.spec_from_file_location("check_site", CHECK)
check_site = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_site)

LOCAL = '<script src="_static/mathjax/tex-chtml.js"></script>'
CDN = '<script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script>'
MATH = r'<p>the noise scale <span class="math notranslate">\(B = \frac{a}{b}\)</span></p>'


def _site(tmp_path, body: str, script: str = LOCAL) -> pathlib.Path:
  (tmp_path / "_static" / "mathjax").mkdir(parents=True)
  (tmp_path / "_static" / "mathjax" / "tex-chtml.js").write_text("// MathJax")
  (tmp_path / "page.html").write_text(f"<html><head>{script}</head><body>{body}</body></html>")
  return tmp_path


def test_check_site_passes_math_served_by_the_site(tmp_path):
  code = r"<pre>$x = \frac{1}{2}$ in a code block is not math</pre>"
  assert check_site.check_site(_site(tmp_path, MATH + code)) == []


@pytest.mark.parametrize(
  "body",
  [
    r"<p>$$B_\text{simple} = \frac{\operatorname{tr}\Sigma}{|G|^2},$$</p>",  # dollarmath off
    r"<p>the ratio $\frac{T}{Q}$ inline</p>",
    r"<td>\operatorname{tr}\Sigma</td>",
  ],
)
def test_check_site_fails_raw_latex_in_the_text(tmp_path, body, capsys):
  problems = check_site.check_site(_site(tmp_path, body))
  assert len(problems) == 1 and "page.html: raw LaTeX outside any math element" in problems[0]
  assert check_site.main([str(tmp_path)]) == 1
  assert "raw LaTeX" in capsys.readouterr().err


def test_check_site_fails_math_loaded_from_the_network(tmp_path):
  problems = check_site.check_site(_site(tmp_path, MATH, script=CDN))
  assert any("loads math from the network (https://cdn.jsdelivr.net" in p for p in problems)
  assert any("has math but loads no MathJax file of the site" in p for p in problems)


def test_check_site_fails_a_missing_mathjax_file(tmp_path):
  site = _site(tmp_path, MATH, script='<script src="_static/mathjax/missing.js"></script>')
  assert check_site.check_site(site) == [
    "page.html: has math but loads no MathJax file of the site: it shows raw LaTeX"
  ]
