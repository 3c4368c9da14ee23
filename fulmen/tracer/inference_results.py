"""Tensors made under `torch.inference_mode()` inside a traced function that leave the call.

NOTE [inference tensors made inside]: eager's tensor made inside `torch.inference_mode()` is an
inference tensor (`is_inference()`: updating it in place outside inference mode, or saving it
for backward, raises); a view is of its base's kind. A compiled call runs outside the block, so
such a tensor returned or stored by the epilogue would come back as an ordinary tensor that
allows what eager refuses. When the call itself is not made under inference mode (where every
result is an inference tensor, in eager as compiled), such a call runs eagerly
(`InferenceTensorResult`). The proxies answer `is_inference()` as made (a view made inside the
block too: the rule here reads the view's root).
"""

from __future__ import annotations

import torch

from fulmen.core import RunsEagerly
from fulmen.proxies import TensorProxy


class InferenceTensorResult(RunsEagerly):
    """A tensor made under `torch.inference_mode()` inside the function leaves the call (NOTE
    [inference tensors made inside]): the call runs eagerly."""


def refuse_inference_results(ctx, leaves: list) -> None:
    """Raise `InferenceTensorResult` if one of `leaves` (results and stored values) is an
    inference tensor in eager while the compiled call would return an ordinary one."""
    if torch.is_inference_mode_enabled():
        return
    views, roots = ctx.mutation.views, ctx.mutation.roots
    with torch._C.DisableTorchFunctionSubclass():
        for leaf in leaves:
            if not isinstance(leaf, TensorProxy):
                continue
            view = views.get(leaf.name)
            base = roots[view.root].proxy if view is not None and view.root in roots else leaf
            if base.is_inference():
                raise InferenceTensorResult(
                    f"{leaf.name}, a result of the function, was made under "
                    "torch.inference_mode(): eager returns an inference tensor, the compiled "
                    "call an ordinary one", op="torch.inference_mode")


__all__ = ["InferenceTensorResult", "refuse_inference_results"]
