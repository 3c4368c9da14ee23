"""The FULMEN_* settings every test run uses: pytest (`tests/conftest.py`) and `make fuzz`
(`tests/fuzz/run_fuzz.py`) apply the same ones, so a fuzz campaign checks what the tests check.

- `FULMEN_CHECK=1`: `check_trace` after every pass.
- `FULMEN_FUSE_TINY=1`: tests check kernels on small tensors, so every region is fused, even
  those the tiny-region policy (`fulmen.transforms.region_size.TINY_REGION`) leaves on torch; its
  own tests unset it.

A value already in the environment wins (`FULMEN_FUSE_TINY=0 make fuzz` fuzzes the partition
users get).
"""

from __future__ import annotations

import os

TEST_ENVIRONMENT = {"FULMEN_CHECK": "1", "FULMEN_FUSE_TINY": "1"}


def apply_test_environment() -> None:
    """Set each of `TEST_ENVIRONMENT` not already set in `os.environ`."""
    for name, value in TEST_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
