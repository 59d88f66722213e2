"""Checks a built docs site for what only a reader would see, without a browser: math that would
show as raw LaTeX.

    python .ci/check_site.py docs/_build/html

A formula renders only if its page loads a MathJax script that is part of the site (no network:
a CDN address fails) and only if it is inside a math element (MyST's ``$...$`` outside one, e.g.
with ``dollarmath`` off, stays text). So, for every page:

* a page with math elements (``class="math"``) must load MathJax from a file under the site;
* no page may load MathJax (or KaTeX) from another host;
* outside math elements, code, scripts and styles, no text may look like LaTeX (``$…\\cmd…$``,
  ``$$``, ``\\frac``-like commands).

Exits 1, naming each page and what was found.
"""

from __future__ import annotations

import html.parser
import pathlib
import re
import sys

# A LaTeX command that prose never holds, or an inline $...$ with a command inside.
RAW_LATEX = re.compile(
  r"\$\$|\$[^$\n]*\\[A-Za-z]+[^$\n]*\$|\\(?:frac|sum|operatorname|mathrm|text|sqrt|Sigma|left|"
  r"right|begin|end|cdot|mathbf|tfrac|dfrac)\b"
)
SKIPPED = {"script", "style", "pre", "code", "kbd", "samp", "textarea"}
MATH_HOSTS = re.compile(r"mathjax|katex", re.I)


class _Page(html.parser.HTMLParser):
  """Collects a page's scripts, whether it has math, and its text outside math and code."""

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.scripts: list[str] = []
    self.has_math = False
    self.text: list[str] = []
    self._stack: list[tuple[str, bool]] = []  # (tag, hides its text)

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if tag == "script" and attrs.get("src"):
      self.scripts.append(attrs["src"])
    classes = (attrs.get("class") or "").split()
    is_math = "math" in classes
    self.has_math |= is_math
    if tag in ("br", "img", "meta", "link", "input", "hr", "wbr", "source"):
      return
    self._stack.append((tag, is_math or tag in SKIPPED))

  def handle_endtag(self, tag):
    for i in range(len(self._stack) - 1, -1, -1):
      if self._stack[i][0] == tag:
        del self._stack[i:]
        return

  def handle_data(self, data):
    if not any(hidden for _, hidden in self._stack):
      self.text.append(data)


def check_page(path: pathlib.Path, root: pathlib.Path) -> list[str]:
  """The problems of one page (empty: none)."""
  page = _Page()
  page.feed(path.read_text(encoding="utf-8"))
  name = path.relative_to(root).as_posix()
  problems = []
  remote = [s for s in page.scripts if MATH_HOSTS.search(s) and re.match(r"(https?:)?//", s)]
  if remote:
    problems.append(f"{name}: loads math from the network ({remote[0]}): offline it stays LaTeX")
  local = [
    s for s in page.scripts
    if MATH_HOSTS.search(s) and not re.match(r"(https?:)?//", s)
    and (path.parent / s.split("?")[0]).resolve().is_file()
  ]  # fmt: skip
  if page.has_math and not local:
    problems.append(f"{name}: has math but loads no MathJax file of the site: it shows raw LaTeX")
  for match in RAW_LATEX.finditer(" ".join(page.text)):
    text = " ".join(page.text)
    around = text[max(match.start() - 30, 0) : match.end() + 30].replace("\n", " ")
    problems.append(f"{name}: raw LaTeX outside any math element: ...{around}...")
    break
  return problems


def check_site(root: pathlib.Path) -> list[str]:
  """Every page's problems, and how many pages hold math."""
  pages = sorted(p for p in root.rglob("*.html") if "_static" not in p.parts)
  if not pages:
    return [f"{root}: no HTML pages (build the site first)"]
  return [problem for page in pages for problem in check_page(page, root)]


def main(argv: list[str]) -> int:
  root = pathlib.Path(argv[0] if argv else "docs/_build/html")
  problems = check_site(root)
  for problem in problems:
    print(f"docs: {problem}", file=sys.stderr)
  if problems:
    return 1
  pages = sum(1 for p in root.rglob("*.html") if 'class="math' in p.read_text(encoding="utf-8"))
  print(f"docs: math renders offline: {pages} pages with math load the site's own MathJax")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
