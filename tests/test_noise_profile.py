"""`benchmarks/noise_profile.py`: the profile that says where `noise_scale=True`'s time goes.

It sorts the ops of each compiled program by what they read. These tests pin down that it sees
what the batch-size guide says it sees (no timing is asserted, only which classes of ops hold
time): without the statistics the finite check is a matrix-vector `dot` of each gradient leaf
and no op reduces one; with them the micro-batch's ``Σ|g|²`` is that check, a reduction, and
no gradient goes through a `dot` to a vector.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import noise_profile  # noqa: E402

pytestmark = pytest.mark.slow  # traces 16 micro-steps of four contenders: ~20 s


def test_profile_sorts_the_finite_check_and_the_squared_norms(tmp_path):
  argv = ["--ks", "2", "--steps", "4", "--sizes", "128,512,512,10", "--micro", "8"]
  table = noise_profile.main([*argv, "--out", str(tmp_path)])
  for path in ("accumulate", "TrainStep"):
    for phase in ("open", "closing"):
      without, with_ = table[2, path][phase], table[2, path + " + noise_scale"][phase]
      assert without["reductions"] == 0 and without["dots to a vector"] > 0, (path, without)
      assert with_["reductions"] > 0 and with_["dots to a vector"] == 0, (path, with_)
      assert with_["everything else"] > 0
  text = (tmp_path / "noise_profile.md").read_text()
  assert "| 2 | TrainStep + noise_scale | closing |" in text
