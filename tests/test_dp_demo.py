"""`python -m optax_accum.demo dp`: the DP task end to end (an integration test)."""

import re

import pytest

import optax_accum as oa
from optax_accum import demo

pytestmark = pytest.mark.slow


def test_dp_demo_quick_accounts_updates_and_learns(capsys):
  out = demo.main(["dp", "--quick", "--epsilon", "3.0"])
  printed = capsys.readouterr().out
  assert out["updates"] == 40  # --quick: 40 noisy updates, each a Poisson batch
  assert out["micro_steps"] > 4 * out["updates"]  # a logical batch is many micro-steps
  q = 256 / 1438
  assert out["epsilon"] == oa.privacy.dp_epsilon(40, q, out["sigma"], 1e-5)
  assert 2.9 < out["epsilon"] <= 3.0  # σ was calibrated for the target
  assert out["private_accuracy"] > 0.5 and out["plain_accuracy"] > 0.8  # chance is 0.1
  assert "ε = " in printed and "non-private: test accuracy" in printed


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--micro", "0"], r"--micro must be a positive int, got 0"),
    (["--epsilon", "-1"], r"--epsilon must be > 0, got -1.0"),
    (["--delta", "1.5"], r"--delta must be in \(0, 1\), got 1.5"),
  ],
)
def test_dp_demo_bad_flags_name_the_flag(argv, match, capsys):
  with pytest.raises(SystemExit):
    demo.main(["dp", *argv])
  assert re.search(match, capsys.readouterr().err)
