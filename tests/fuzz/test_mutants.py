"""The mutation harness itself (`tests/fuzz/mutants.py`): edits apply to a copy only when their
text occurs exactly once, and pytest's report is read back. Running the mutants is `make
mutants`, not part of `make test`."""

import pytest

from tests.fuzz.mutants import Mutant, _first_failure, apply_mutant


def _mutant(old, new="X"):
    return Mutant("m", "area", "mod.py", old, new, ("tests",))


def test_an_edit_applies_once_to_the_copy(tmp_path):
    (tmp_path / "mod.py").write_text("a = 1\nb = a - 2\n")
    apply_mutant(tmp_path, _mutant("a - 2", "a + 2"))
    assert (tmp_path / "mod.py").read_text() == "a = 1\nb = a + 2\n"


@pytest.mark.parametrize("old", ["missing", "a"], ids=["absent", "twice"])
def test_an_edit_whose_text_is_not_unique_is_refused(tmp_path, old):
    (tmp_path / "mod.py").write_text("a = 1\nb = a - 2\n")
    with pytest.raises(ValueError, match="occurs"):
        apply_mutant(tmp_path, _mutant(old))
    assert (tmp_path / "mod.py").read_text() == "a = 1\nb = a - 2\n"


def test_the_first_failing_test_is_read_from_the_report():
    report = ("..F\nFAILED tests/x.py::test_y[sum dims keepdim-whole] - AssertionError: no\n"
              "FAILED tests/x.py::test_z - boom\n1 failed")
    assert _first_failure(report) == "tests/x.py::test_y[sum dims keepdim-whole]"
    assert _first_failure("3 passed") == ""


def test_every_mutant_of_the_table_applies_to_fulmen_as_it_is():
    """A refactor that rewrites a mutated line leaves its mutant stale (the harness would
    report an error, not a kill): each `old` text must still occur exactly once."""
    from pathlib import Path

    from tests.fuzz.mutant_table import MUTANTS

    root = Path(__file__).resolve().parents[2] / "fulmen"
    stale = [m.name for m in MUTANTS if (root / m.path).read_text().count(m.old) != 1]
    assert not stale
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
