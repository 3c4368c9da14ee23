"""Tests' helpers: record which calls fulmen made, without changing what they do."""

from __future__ import annotations

import sys


def record_calls(monkeypatch, owner, name: str) -> list:
    """Replace the function `owner.name` by one that appends its first positional argument
    (`fn` of `meta.call_on_meta(fn, args, kwargs)` or `layout_truth.eager_layouts`) to the
    returned list and then calls the original; `monkeypatch` restores it after the test.

        asked = record_calls(monkeypatch, meta, "call_on_meta")
    """
    asked = []
    original = getattr(owner, name)

    def recording(*args, **kwargs):
        asked.append(args[0] if args else None)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return asked


def count_traces(monkeypatch) -> list:
    """A list that grows by one entry each time a jitted callable traces (a cache miss:
    `fulmen.compile_miss.trace_program`); compare its length."""
    return record_calls(monkeypatch, sys.modules["fulmen.compile_miss"], "trace_program")
