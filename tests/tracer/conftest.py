"""Fixtures shared by the tracer tests."""

import pytest

import fulmen.jitted


@pytest.fixture
def traces(monkeypatch):
    """A one-item list counting the calls that traced and compiled (`_Jitted._compile_call`),
    of every jitted function, while the test runs."""
    count = [0]
    original = fulmen.jitted._Jitted._compile_call

    def counted(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(fulmen.jitted._Jitted, "_compile_call", counted)
    return count
