"""SSA name allocation for one trace.

Names are Python identifiers, unique within a trace, handed out in order. Each name remembers
its serial number, so the tracer can tell proxies created by an op from those that existed
before it ran.

A name a printed trace could not use as a local variable is never handed out: Python keywords,
the globals printed traces call (`torch`, `math`, `prims`, an executor's name such as `codegen`:
every `Namespace` alias registers itself here), the builtins they call (`PRINTED_BUILTINS`:
`float`, `slice`, `max`, ...), the names of printed constants (`_c0`), temporaries (`t0`) and
symbols of symbolic sizes (`s0`, bound as `s0 = x.shape[0]`), and the profiler's timers
(`_fulmen_t`). Names are NFKC-normalised first, as Python normalises identifiers, so `ﬁ` and
`fi` (or `𝐱` and `x`) are one identifier and the second gets a suffix.
"""

from __future__ import annotations

import keyword
import re
import unicodedata

# temporaries, the printer's constants, symbolic sizes' symbols (`s0 = x.shape[0]`); a name
# made unique (`t1_1`) must never match
_GENERATED = re.compile(r"t\d+|_c\d+|[su]\d+")
# builtins printed traces call: the printer's literals (`float('inf')`, `slice(1, None, None)`)
# and symbolic sizes as torch's PythonPrinter writes them (`max(1, s0)`, `round(...)`)
PRINTED_BUILTINS = frozenset({"float", "complex", "slice", "int", "abs", "min", "max", "round",
                              "pow"})
# the names `fulmen.profile` adds to a compiled trace (`_fulmen_t = _fulmen_clock()`)
_PROFILER_NAMES = frozenset({"_fulmen_t", "_fulmen_clock", "_fulmen_times"})
_GLOBALS: set[str] = {"torch", "math", *PRINTED_BUILTINS, *_PROFILER_NAMES}  # + Namespace aliases


def reserve_global(name: str) -> None:
    """Keep `name` from being a trace variable: printed traces use it as a global."""
    _GLOBALS.add(name)


def is_reserved(ident: str) -> bool:
    """Whether a printed trace cannot use the identifier `ident` as a local variable."""
    return keyword.iskeyword(ident) or ident in _GLOBALS or _GENERATED.fullmatch(ident) is not None


def _identifier_char(char: str) -> str:
    return char if ("a" + char).isidentifier() else "_"


def sanitize(name: str) -> str:
    """The identifier a name prints as: `layers.0.weight` -> `layers_0_weight`, `ﬁ` -> `fi`,
    `torch` -> `torch_`, `if` -> `if_` (see the module docstring for what is reserved)."""
    text = unicodedata.normalize("NFKC", name)
    ident = "".join(_identifier_char(char) for char in text)
    ident = ident if ident[:1].isidentifier() else "_" + ident
    if unicodedata.normalize("NFKC", ident) != ident or not ident.isidentifier():
        ident = "_" + re.sub(r"\W", "_", ident.encode("ascii", "replace").decode())
    if keyword.iskeyword(ident) or ident in _GLOBALS:
        ident = ident + "_"
    return ident


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
        """`name` made a valid, unused identifier (`x`, then `x_1`, `x_2`, ...); see
        `sanitize` for the spelling."""
        base = sanitize(name)
        candidate, k = base, 0
        while candidate in self._serials or is_reserved(candidate):
            k += 1
            candidate = f"{base}_{k}"
        return self._take(candidate)
