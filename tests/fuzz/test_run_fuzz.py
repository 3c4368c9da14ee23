"""`make fuzz` (`run_fuzz.py`) runs its generators under the settings the tests use."""

import os

from tests.environment import TEST_ENVIRONMENT
from tests.fuzz import run_fuzz


def test_a_campaign_runs_under_the_tests_settings(monkeypatch):
    # `make fuzz` runs outside pytest, so conftest's settings are not there: without them the
    # codegen generators kept tiny regions on torch and checked no kernel of them
    for name in TEST_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def campaign(tally, examples, seed_value):
        seen.update({name: os.environ.get(name) for name in TEST_ENVIRONMENT})

    monkeypatch.setattr(run_fuzz, "_break_programs", campaign)
    run_fuzz.run_generator("breaks", 1)
    assert seen == TEST_ENVIRONMENT
    assert seen["FULMEN_FUSE_TINY"] == "1"
