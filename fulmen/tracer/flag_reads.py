"""Autograd flags of real tensors the traced code reads: keyed, so a flip recompiles.

NOTE [flags of closed-over tensors]
A function may branch on the autograd state of a tensor it closes over (a global, a closure
cell, a parameter of a module it reaches, the jitted module's own parameter's `.grad`):
`y * 2 if layer.weight.requires_grad else y * 3`, `if p.grad is not None: ...`. Traced, such a
read answers with the real flag, and the branch it decides is baked into the program, so the
key of every later call must cover it. The tracer records each read (`note_flag_read`: the
tensor and which flag) in `TracedProgram.flag_reads`; the cache key covers the flags of every
tensor any trace of the function read (`FlagReads`, part of the global key), so a call after the
caller froze the layer, or after a backward gave `p` its first gradient, traces anew.

- `requires_grad`: keyed by value. (The traced module's own parameters are keyed by their
  metadata already, and torch's own reads decide nothing the results show: neither is noted.)
- `.grad`: keyed by `requires_grad`, whether the gradient is None and, when it is not, its
  metadata (`_tensor_key`). A gradient the code then computes with is a trace input read
  afresh from its tensor on every call (`TracedProgram.captured_grads`): each backward after
  `zero_grad()` makes a new one, which a captured constant would miss. Torch's own reads of
  `.grad` are keyed the same way (`clip_grad_norm_`, `Module.zero_grad(set_to_none=False)`
  on a closed-over model scale or zero the current gradients in place); `requires_grad_(flag)`
  on such a gradient that already has `flag` changes nothing (`keyed_gradient`: its flag is
  keyed), as `zero_grad` calls it. (`p.grad = None` of a closed-over tensor still runs the
  call eagerly: nothing replays it.)

The tensors are held by weak references; one that died keys as `None`. A miss explains a
flip by the flag's name (`FlagReads.describe`: `a.weight.requires_grad changed from True to
False`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fulmen.core import RunsEagerly
from fulmen.tracer.leaf_keys import _tensor_key
from fulmen.tracer.objects import _grad_of

REQUIRES_GRAD = "requires_grad"
GRAD = "grad"
_MAX_WATCHED = 4096  # a bound on the flags the key covers (`FlagReads.watch`)


class UnkeyedFlagRead(RunsEagerly):
    """The traced code reads an autograd flag of a tensor it closes over, and the key already
    covers `_MAX_WATCHED` such flags: the call runs eagerly."""


def note_flag_read(ctx: Any, tensor: torch.Tensor, flag: str) -> None:
    """Record, while tracing, that the user's code read `flag` (`REQUIRES_GRAD` or `GRAD`) of
    the real tensor `tensor` (NOTE [flags of closed-over tensors])."""
    ctx.flag_reads.setdefault((id(tensor), flag), (tensor, flag))
    if flag == GRAD:
        grad = _grad_of(tensor)
        if grad is not None:
            ctx.grad_owners.setdefault(id(grad), tensor)


def keyed_gradient(ctx: Any, proxy: Any) -> torch.Tensor | None:
    """The real gradient that the captured trace input `proxy` stands for, if it is one the
    cache key covers (read as `p.grad` of a real tensor: its metadata, `requires_grad` with it,
    is keyed); else None."""
    for tensor, captured in ctx.captured.values():
        if captured is proxy:
            return tensor if id(tensor) in ctx.grad_owners else None
    return None


def _flag_key(tensor: torch.Tensor | None, flag: str) -> Any:
    if tensor is None:
        return None
    if flag == REQUIRES_GRAD:
        return tensor.requires_grad
    grad = _grad_of(tensor)
    return (tensor.requires_grad, None if grad is None else _tensor_key(grad))


class FlagReads:
    """The flags of real tensors that traces of one jitted function read (`watch`), and their
    key for each call (`key`)."""

    def __init__(self) -> None:
        self._watched: dict[tuple[int, str], tuple[weakref.ref, str]] = {}

    def __bool__(self) -> bool:
        return bool(self._watched)

    def watch(self, reads: tuple) -> bool:
        """Key the flags `reads` (`(tensor, flag)` pairs) from now on; whether that is new.
        Raises `UnkeyedFlagRead` when one more flag would pass `_MAX_WATCHED`."""
        new = False
        for tensor, flag in reads:
            slot = (id(tensor), flag)
            known = self._watched.get(slot)
            if known is not None and known[0]() is tensor:
                continue
            if known is None and len(self._watched) >= _MAX_WATCHED:
                raise UnkeyedFlagRead(
                    f"reading {flag} of a tensor the function closes over, beyond the "
                    f"{_MAX_WATCHED} such flags the cache key covers", op=f"Tensor.{flag}",
                    hint="pass the tensor as an argument")
            self._watched[slot] = (weakref.ref(tensor), flag)
            new = True
        return new

    def describe(self, names: dict[int, str]) -> dict[str, object]:
        """Each watched flag by name (`names`: a name per tensor id; else the tensor's shape
        and address), for explaining a miss in words: `{'a.weight.requires_grad': False,
        'p.grad': None}`; a gradient by its shape, dtype and strides, as keyed."""
        described: dict[str, object] = {}
        for ref, flag in self._watched.values():
            tensor = ref()
            if tensor is None:
                continue
            name = names.get(id(tensor)) or f"<tensor {tuple(tensor.shape)} at {id(tensor):#x}>"
            described[f"{name}.requires_grad"] = tensor.requires_grad
            if flag == GRAD:
                grad = _grad_of(tensor)
                described[f"{name}.grad"] = None if grad is None else (
                    f"<tensor {tuple(grad.shape)} {grad.dtype} stride {grad.stride()}>")
        return described

    def key(self) -> tuple:
        """The current value of every watched flag."""
        return tuple([_flag_key(ref(), flag) for ref, flag in self._watched.values()])
