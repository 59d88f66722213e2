"""The main job (`python -m optax_accum.demo`) on tiny flags: the three methods agree."""

from __future__ import annotations

import numpy as np
import pytest

from optax_accum import demo

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


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--k", "3", "--batch-size", "32"], "--batch-size must be a positive multiple of --k=3"),
    (["--k", "0"], "--k must be a positive int"),
  ],
)
def test_demo_bad_flags_name_the_flag(argv, match, capsys):
  with pytest.raises(SystemExit):
    demo.parse_args(argv)
  assert match in capsys.readouterr().err


def test_demo_missing_extra_says_how_to_install(monkeypatch):
  import importlib

  real = importlib.import_module

  def fake(name, *args):
    if name == "tqdm":
      raise ImportError("No module named 'tqdm'")
    return real(name, *args)

  monkeypatch.setattr(demo.importlib, "import_module", fake)
  with pytest.raises(ImportError, match=r"pip install 'optax-accum\[examples\]'"):
    demo.main(["--steps", "1", "--no-progress"])
