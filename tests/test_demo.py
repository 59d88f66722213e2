"""The main job (`python -m optax_accum.demo`) on tiny flags: the three methods agree; its
language-model task (``demo lm --quick``): token-weighted accumulation agrees, the naive mean of
means does not."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from optax_accum import demo
from optax_accum.demo import digits

pytestmark = pytest.mark.slow  # the demo's main job end to end: an integration test


def test_demo_main_three_methods_agree(tmp_path, capsys):
  out = tmp_path / "loss.png"
  results = demo.main(
    ["--k", "2", "--batch-size", "32", "--steps", "4", "--hidden", "16", "--no-progress"]
    + ["--out", str(out)]
  )
  assert [r.name for r in results] == ["large batch", "accumulate", "microbatch"]
  large = results[0]
  assert large.losses[-1] < large.losses[0]  # it trained
  for r in results[1:]:
    # Float32: k micro-batch means summed in another order than one large-batch mean.
    np.testing.assert_allclose(r.losses, large.losses, rtol=1e-5)
    assert r.max_param_diff < 1e-5
    assert r.final_loss == pytest.approx(large.final_loss, rel=1e-5)
    assert r.test_accuracy == large.test_accuracy
  assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
  table = capsys.readouterr().out
  for r in results:
    assert r.name in table
  assert "µs/example" in table and "peak mem" in table
  # accumulate measured the gradient noise scale (in micro-batches) and the demo printed it.
  printed = re.search(r"B_simple \(gradient noise scale.*\): (\S+) micro-batches of 16", table)
  assert printed, table
  b_simple = float(printed.group(1))
  assert np.isfinite(b_simple) and b_simple > 0
  assert b_simple == pytest.approx(results[1].b_simple[-1], abs=0.005)  # the printed figure
  assert results[0].b_simple is None and results[2].b_simple is None


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--k", "3", "--batch-size", "32"], "--batch-size must be a positive multiple of --k=3"),
    (["--k", "0"], "--k must be a positive int"),
  ],
)
def test_demo_bad_flags_name_the_flag(argv, match, capsys):
  with pytest.raises(SystemExit):
    digits.parse_args(argv)
  assert match in capsys.readouterr().err


def test_demo_missing_extra_says_how_to_install(monkeypatch):
  import importlib

  real = importlib.import_module

  def fake(name, *args):
    if name == "tqdm":
      raise ImportError("No module named 'tqdm'")
    return real(name, *args)

  monkeypatch.setattr(importlib, "import_module", fake)
  with pytest.raises(ImportError, match=r"pip install 'optax-accum\[examples\]'"):
    demo.main(["--steps", "1", "--no-progress"])


def test_demo_lm_quick_matches_large_batch_and_naive_does_not(tmp_path, capsys):
  results = demo.main(["lm", "--quick", "--out", str(tmp_path)])
  names = [r.name for r in results]
  assert names == ["large batch", "TrainStep", "microbatch", "naive", "large batch, reordered"]
  captured = capsys.readouterr()
  # No silent phase: the set-up, each method's compilation, then a bar per method (stderr).
  for shown in ["setup", "planning under the memory budget", "compiling", *names, "8/8"]:
    assert shown in captured.err, (shown, captured.err[-3000:])
  large, ours, naive, floor = results[0], results[1:3], results[3], results[4]
  assert large.losses[-1] < large.losses[0] - 1.0  # it trained
  for r in ours:
    # Float32: the window's sums in another order than the large batch's; Adam then carries
    # the last-bit differences on (the reordered large batch drifts as far: `floor`).
    np.testing.assert_allclose(r.losses, large.losses, rtol=1e-5)
    assert r.max_param_diff < 1e-5 and r.max_param_diff < 10 * max(floor.max_param_diff, 1e-7)
  assert naive.max_param_diff > 100 * max(r.max_param_diff for r in ours)
  assert np.max(np.abs(naive.losses - large.losses)) > 1e-4
  assert np.max(np.abs(naive.reported - naive.losses)) > 1e-3  # the mean of means it shows
  out = captured.out
  budget, large_peak, k, k_peak = re.search(
    r"memory budget ([\d.]+) MiB: .* needs ([\d.]+) MiB .* k=(\d+) micro-batches of \d+, "
    r"gradient program peak ([\d.]+) MiB",
    out,
  ).groups()
  assert float(large_peak) > float(budget) >= float(k_peak) and int(k) > 1
  assert (tmp_path / "lm_loss.png").read_bytes()[:4] == b"\x89PNG"
  table = (tmp_path / "results.md").read_text()
  assert all(name in table for name in names) and "tokens/s" in table
  assert "held-out loss" in table and "final loss" not in table
  # One definition of peak memory: the table's, the step line's, the guide's figures.
  steps = re.search(r"peak memory \(the table's: .*within the [\d.]+ MiB budget (.*); over", out)
  assert steps and f"TrainStep {ours[0].peak_bytes / 2**20:.2f} MiB" in steps.group(1)
  figures = json.loads((tmp_path / "results.json").read_text())["figures"]
  assert figures["trainstep_peak_mib"] == f"{ours[0].peak_bytes / 2**20:.1f}"
  assert figures["naive_diff"] == f"{naive.max_param_diff:.1e}"
  assert all(r.tokens_per_s > 0 for r in results)
  # TrainStep measured the noise scale in tokens as it trained; the run prints and tables it.
  b_simple = ours[0].b_simple
  assert len(b_simple) == len(large.losses) and np.isfinite(b_simple[-1]) and b_simple[-1] > 0
  assert all(r.b_simple is None for r in results if r is not ours[0])
  line = re.search(r"B_simple \(gradient noise scale, TrainStep.*\): ([\d,]+) tokens", out)
  assert line and float(line.group(1).replace(",", "")) == pytest.approx(b_simple[-1], abs=0.5)
  assert f"{b_simple[-1]:,.0f} tokens" in table


def test_demo_package_is_imported_by_nothing_in_the_library():
  """The demos sit on top of the library, in a folder of their own: no library module imports
  them (`python -m optax_accum.demo` imports the library, never the other way round)."""
  import pathlib

  import optax_accum

  root = pathlib.Path(optax_accum.__file__).parent
  library = [p for p in root.rglob("*.py") if "demo" not in p.relative_to(root).parts]
  assert len(library) > 20
  pattern = re.compile(
    r"^\s*(from|import)\s+optax_accum\.demo|^\s*from\s+optax_accum\s+import\s+.*\bdemo\b|^\s*from\s+\.+demo\b",
    re.M,
  )
  importers = [str(p.relative_to(root)) for p in library if pattern.search(p.read_text())]
  assert importers == []
  assert sorted(p.name for p in (root / "demo").iterdir() if p.suffix == ".py") == [
    "__init__.py",
    "__main__.py",
    "digits.py",
    "dp.py",
  ]
