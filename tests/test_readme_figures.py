"""Every figure README.md states comes from a committed results file, and matches it.

* the digits demo's table: `benchmarks/results/digits/results.md` (the committed run of
  ``python -m optax_accum.demo``), quoted whole;
* the fast-path table and the figures around it: `benchmarks/results/cpu/results.md` and
  ``results.json`` (``python benchmarks/bench.py``);
* the noise scale's cost: `benchmarks/results/cpu/noise/results.json`.

(The test suite's size and time in the Development section are CI's, not a results file's.)
"""

from __future__ import annotations

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CPU = ROOT / "benchmarks" / "results" / "cpu"
RESULTS_MD = (CPU / "results.md").read_text()
RESULTS = json.loads((CPU / "results.json").read_text())
DIGITS = ROOT / "benchmarks" / "results" / "digits" / "results.md"

# README's rows of the fast-path table -> the rows of results.md's summary tables.
ROWS = {
  "`accumulate(adam, k)` in your jitted step (defaults)": "accumulate",
  "the same, `skip_nonfinite=False`": "accumulate (skip_nonfinite=False)",
  "`TrainStep` (defaults)": "TrainStep",
  "`TrainStep`, `skip_nonfinite=False`": "TrainStep (skip_nonfinite=False)",
  "`optax.MultiSteps(adam, k)`": "optax.MultiSteps",
}


def _section(text: str, heading: str) -> str:
  start = text.index(heading)
  end = text.find("\n#", start + len(heading))
  return text[start : end if end > 0 else None]


def _summary(model_bold: str) -> dict[str, list[str]]:
  """A summary table of results.md (the paragraph starting with `model_bold`): row -> cells."""
  table = _section(RESULTS_MD, "## Summary")
  block = table[table.index(model_bold) :].split("\n\n", 2)[1]
  rows = [line.strip("|").split("|") for line in block.splitlines()[2:]]
  return {r[0].strip(): [c.strip() for c in r[1:]] for r in rows}


def _adam(model: str) -> list[dict]:
  return [r for r in RESULTS["cross"] if r["model"] == model and r["contender"] == "adam (floor)"]


def test_readme_digits_table_is_the_committed_run():
  committed = re.search(r"```text\n(.*?)```", DIGITS.read_text(), re.S).group(1)
  quoted = re.search(r"```text\n(.*?)```", _section(README, "## The main job"), re.S).group(1)
  assert quoted == committed, f"README's digits table differs from {DIGITS}"


def test_readme_fast_path_table_is_the_committed_summary():
  section = _section(README, "## The fast path")
  big = _summary("**MLP 784-2048-2048-2048-10")
  small = _summary("**MLP 784-1600-1600-1600-1600-10")
  seen = 0
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if cells[0] in ROWS:
      name = ROWS[cells[0]]
      assert cells[1:] == big[name] + small[name], (cells[0], cells[1:], big[name], small[name])
      seen += 1
  assert seen == len(ROWS)


def test_readme_fast_path_prose_figures_are_the_committed_run():
  section = _section(README, "## The fast path")
  total = re.search(r"total (\d+) s", RESULTS_MD).group(1)
  assert f"{total} s on an idle 2-core CPU" in section
  mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
  assert f"Adam's own step has {mib(_adam('mlp')[0]['temp_bytes'])} of temporaries" in section
  assert f"Adam's temporaries {mib(_adam('mlp_1600x4')[0]['temp_bytes'])}" in section
  faults = max(r["faults_per_step"] for r in _adam("mlp"))
  assert f"up to {faults:,.0f} page faults per step" in section
  params = re.search(r"transformer: [^(]*\(([\d,]+) params", RESULTS_MD).group(1)
  assert f"({int(params.replace(',', '')) / 1e6:.2f}M parameters" in section
  transformer = _summary("**transformer")
  others = [float(c) for name, row in transformer.items() if "MultiSteps" not in name for c in row]
  multi = [float(c) for c in transformer["optax.MultiSteps"]]
  assert f"sits at\n{min(others):.2f}–{max(others):.2f}× Adam" in section
  assert f"(`MultiSteps` {min(multi):.2f}–{max(multi):.2f}×)" in section


def test_readme_noise_scale_cost_is_the_committed_run():
  noise = json.loads((CPU / "noise" / "results.json").read_text())["noise"]
  worst = max(r["ratio"] for r in noise)
  assert f"(≤ {round(100 * (worst - 1)):.0f}% per micro-step in the CPU benchmarks)" in README
