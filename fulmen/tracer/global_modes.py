"""torch's global modes a traced function may leave changed: the grad mode
(`torch.set_grad_enabled(False)` called, not used as a context manager) and the default dtype
(`torch.set_default_dtype`). A compiled call does not repeat such a call, so later calls would
leave the modes as the caller had them (and the first call ran its program under the mode the
function left); `modes_snapshot()` before tracing and `check_modes_kept(before)` after it find the
change, put the modes back and raise `ChangesGlobalModes`: the call runs eagerly, as eager does,
leaving the modes changed. Changes undone before returning (`with torch.no_grad():`, a
`set_grad_enabled` context) are traced as usual."""

from __future__ import annotations

import torch

from fulmen.core import RunsEagerly


class ChangesGlobalModes(RunsEagerly):
    """The traced function leaves torch's grad mode or default dtype changed: a compiled call
    would not repeat that, so the call runs eagerly."""


def modes_snapshot() -> tuple[bool, torch.dtype]:
    """The global modes a function may change: (grad mode, default dtype)."""
    return torch.is_grad_enabled(), torch.get_default_dtype()


def restore_modes(before: tuple[bool, torch.dtype]) -> None:
    """Put the modes back to `before` (a trace that failed may have left them changed)."""
    torch.set_grad_enabled(before[0])
    torch.set_default_dtype(before[1])


def check_modes_kept(before: tuple[bool, torch.dtype]) -> None:
    """Raise `ChangesGlobalModes` (after putting the modes back to `before`) when tracing left
    them changed."""
    grad, dtype = modes_snapshot()
    if (grad, dtype) == before:
        return
    restore_modes(before)
    what = "torch.set_grad_enabled" if grad != before[0] else "torch.set_default_dtype"
    raise ChangesGlobalModes(
        f"the function calls {what}(...) and returns with the mode changed; a compiled function "
        "would not change it on later calls", op=what,
        hint="use it as a context manager (`with torch.set_grad_enabled(False):`), or set it "
        "outside the compiled function")
