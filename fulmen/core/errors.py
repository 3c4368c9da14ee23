"""Errors raised by fulmen.

Every error names the operation, the offending argument where there is one, and the user's
source line (`file:line`), so a failure inside a traced program points back to user code.
"""

from __future__ import annotations


class FulmenError(RuntimeError):
    """A fulmen error: the op, the argument, the user's source location and a hint.

    Example:
        FulmenError("x.item() needs a tensor's value", op="Tensor.item",
                    where="model.py:12  y = x.item()", hint="pass Python numbers instead")
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        argument: str | None = None,
        where: object | None = None,
        hint: str | None = None,
    ):
        self.message = message
        self.op = op
        self.argument = argument
        self.where = where
        self.hint = hint
        super().__init__(self._text())

    def _text(self) -> str:
        parts = []
        if self.op is not None:
            parts.append(f"{self.op}: ")
        parts.append(self.message)
        if self.argument is not None:
            parts.append(f" (argument {self.argument})")
        if self.where is not None:
            parts.append(f"\n  at {self.where}")
        if self.hint is not None:
            parts.append(f"\n  hint: {self.hint}")
        return "".join(parts)

    def locate(self, where: object) -> None:
        """Give the error the user's source location `where` if it has none yet (raised below
        the user's call, by a decomposition or a meta check that cannot know it)."""
        if self.where is None and where is not None:
            self.where = where
            self.args = (self._text(), *self.args[1:])


class NotYetSupportedError(FulmenError):
    """A construct fulmen does not handle yet; raised instead of returning a wrong result."""


class RunsEagerly(NotYetSupportedError):
    """A call fulmen does not compile but eager PyTorch runs as written (`loss.backward()` inside
    the function, a draw from Python's random generator): `fulmen.jit` runs such calls eagerly,
    warning once per reason, and raises this error with `fullgraph=True` or for functional
    autodiff (`fulmen.grad`), whose results no eager call has."""

    # whether later calls with the same cache key run eagerly without tracing again; False
    # where the reason goes away by itself (a lazy module materialises at its first call)
    remembered = True

