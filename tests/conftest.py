"""Test configuration: 8 host CPU devices for the multi-device tests.

`XLA_FLAGS` must be set before JAX initialises its backends; the README's test command sets it,
and this file sets it too so that `pytest tests/test_x.py` alone behaves the same.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
