"""`fulmen.config` declares every FULMEN_* variable and is the only module reading them."""

import pathlib
import re

import pytest

from fulmen import config

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fulmen"
_ENVIRON = re.compile(r"os\.environ|os\.getenv|getenv\(")


def environment_readers(package: pathlib.Path = PACKAGE) -> list[str]:
    """`file:line` of every line outside config.py that reads the environment for a FULMEN_
    variable (both on one line, as every reader wrote it)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "config.py":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if _ENVIRON.search(line) and "FULMEN_" in line:
                found.append(f"{path.relative_to(package.parent)}:{lineno}")
    return found


def test_only_config_reads_fulmen_variables():
    assert environment_readers() == []


def test_the_check_finds_a_reader(tmp_path):
    (tmp_path / "fulmen").mkdir()
    (tmp_path / "fulmen" / "jit.py").write_text('import os\nx = os.environ.get("FULMEN_X")\n')
    assert environment_readers(tmp_path / "fulmen") == ["fulmen/jit.py:2"]


def test_every_variable_named_in_fulmen_is_declared():
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"\bFULMEN_[A-Z_]+[A-Z]\b", path.read_text()))
    assert named - set(config.VARIABLES) == set()


def test_get_parses_and_defaults(monkeypatch):
    monkeypatch.delenv("FULMEN_CACHE_SIZE_LIMIT", raising=False)
    assert config.get("FULMEN_CACHE_SIZE_LIMIT") == 8
    monkeypatch.setenv("FULMEN_CACHE_SIZE_LIMIT", "3")
    assert config.get("FULMEN_CACHE_SIZE_LIMIT") == 3
    monkeypatch.setenv("FULMEN_CACHE_SIZE_LIMIT", "many")
    with pytest.raises(ValueError, match="FULMEN_CACHE_SIZE_LIMIT"):
        config.get("FULMEN_CACHE_SIZE_LIMIT")
    with pytest.raises(KeyError):
        config.get("FULMEN_NOT_A_VARIABLE")
    assert "FULMEN_DYNAMIC" in config.describe()
