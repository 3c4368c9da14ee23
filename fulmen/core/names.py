"""SSA name allocation for one trace.

Names are Python identifiers, unique within a trace, handed out in order. Each name remembers
its serial number, so the tracer can tell proxies created by an op from those that existed
before it ran.
"""

from __future__ import annotations

import keyword
import re

_NOT_IDENT = re.compile(r"\W|^(?=\d)")


def sanitize(name: str) -> str:
    """Turn `layers.0.weight` into the identifier `layers_0_weight`."""
    ident = _NOT_IDENT.sub("_", name)
    if keyword.iskeyword(ident) or ident in {"torch", "prims", "ltorch"}:
        ident = ident + "_"
    return ident or "_"


class NameAllocator:
    """Allocates unique identifiers: user names as given (made unique), others as t0, t1, ..."""

    def __init__(self) -> None:
        self._serials: dict[str, int] = {}
        self._next_temp = 0

    @property
    def serial(self) -> int:
        """How many names have been allocated so far."""
        return len(self._serials)

    def serial_of(self, name: str) -> int:
        return self._serials.get(name, -1)

    def __contains__(self, name: str) -> bool:
        return name in self._serials

    def _take(self, name: str) -> str:
        self._serials[name] = len(self._serials)
        return name

    def reserve(self, name: str) -> None:
        """Mark `name` as taken (names of an existing trace a new one must not reuse)."""
        if name not in self._serials:
            self._take(name)

    def new(self, prefix: str = "t") -> str:
        """A fresh temporary name such as `t7`."""
        while True:
            name = f"{prefix}{self._next_temp}"
            self._next_temp += 1
            if name not in self._serials:
                return self._take(name)

    def named(self, name: str) -> str:
        """`name` made a valid, unused identifier (`x`, then `x_1`, `x_2`, ...)."""
        base = sanitize(name)
        candidate, k = base, 0
        while candidate in self._serials or re.fullmatch(r"t\d+", candidate):
            k += 1
            candidate = f"{base}_{k}"
        return self._take(candidate)
