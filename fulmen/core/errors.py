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
        self.op = op
        self.argument = argument
        self.where = where
        self.hint = hint
        parts = []
        if op is not None:
            parts.append(f"{op}: ")
        parts.append(message)
        if argument is not None:
            parts.append(f" (argument {argument})")
        if where is not None:
            parts.append(f"\n  at {where}")
        if hint is not None:
            parts.append(f"\n  hint: {hint}")
        super().__init__("".join(parts))


class NotYetSupportedError(FulmenError):
    """A construct fulmen does not handle yet; raised instead of returning a wrong result."""
