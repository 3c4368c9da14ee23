"""Where an operation came from in the user's code.

`user_source_location()` walks the Python stack outward and returns the first frame that is not
inside fulmen or torch: that is the line the user wrote. It is called only while tracing.

The file name and line text are the user's and go into printed traces as comments, which are
compiled: `printable()` escapes every character that could end the comment's line (`\n`, `\r`,
and the other separators `str.splitlines` knows, which would shift the lines `linecache` shows)
or is not printable (NUL, bidirectional overrides). `str(location)` is printable.
"""

from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass

_FULMEN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR: str | None = None
_SKIP_PREFIXES = ("<frozen", "<string>")


def printable(text: str) -> str:
    """`text` with every non-printable character except tab written as its escape (`\\n`,
    `\\x0b`, `\\u2028`), so it stays on one line wherever it is printed; printable text is
    returned unchanged."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() or char == "\t"
                   else char.encode("unicode_escape").decode("ascii") for char in text)


def _torch_dir() -> str:
    global _TORCH_DIR
    if _TORCH_DIR is None:
        spec = sys.modules.get("torch")
        _TORCH_DIR = os.path.dirname(spec.__file__) if spec is not None else "\0"
    return _TORCH_DIR


@dataclass(frozen=True, slots=True)
class SourceLocation:
    """A line of user code: file name, line number and the stripped source text."""

    filename: str
    lineno: int
    text: str

    @property
    def short(self) -> str:
        """`file.py:12`: the base name and line number (escaped by `printable`)."""
        return printable(f"{os.path.basename(self.filename)}:{self.lineno}")

    def __str__(self) -> str:
        return f"{self.short}  {printable(self.text)}" if self.text else self.short


_INTERNAL: dict[str, bool] = {}  # filename -> is_internal's answer (asked per frame while tracing)
_INTERNAL_LIMIT = 4096


def is_internal(filename: str) -> bool:
    """Whether `filename` is fulmen's own code (its tests excepted) or torch's."""
    found = _INTERNAL.get(filename)
    if found is None:
        found = _is_internal(filename)
        if _TORCH_DIR not in (None, "\0") and len(_INTERNAL) < _INTERNAL_LIMIT:
            _INTERNAL[filename] = found
    return found


def is_fulmens_own(filename: str) -> bool:
    """Whether `filename` lies in fulmen's package directory."""
    return filename.startswith(_FULMEN_DIR + os.sep)


def _is_internal(filename: str) -> bool:
    if filename.startswith(_SKIP_PREFIXES):
        return True
    if is_fulmens_own(filename) and os.sep + "tests" + os.sep not in filename:
        return True
    return filename.startswith(_torch_dir() + os.sep)


def user_source_location(skip: int = 1) -> SourceLocation | None:
    """Return the innermost stack frame outside fulmen and torch, or None if there is none."""
    frame = sys._getframe(skip)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_internal(filename):
            text = linecache.getline(filename, frame.f_lineno).strip()
            return SourceLocation(filename, frame.f_lineno, text)
        frame = frame.f_back
    return None
