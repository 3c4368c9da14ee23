"""Tests' helper: record which calls a fulmen function made, without changing what it does."""

from __future__ import annotations


def record_calls(monkeypatch, owner, name: str) -> list:
    """Replace `owner.name`, a function of `(fn, args, kwargs)` (`meta.call_on_meta`,
    `dispatch.eager_layouts`), by one that appends `fn` to the returned list and then calls
    the original; `monkeypatch` restores it after the test.

        asked = record_calls(monkeypatch, meta, "call_on_meta")
    """
    asked = []
    original = getattr(owner, name)

    def recording(fn, args, kwargs):
        asked.append(fn)
        return original(fn, args, kwargs)

    monkeypatch.setattr(owner, name, recording)
    return asked
