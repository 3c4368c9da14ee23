"""What eager's autograd would do with a program, found by running it once on fake tensors.

NOTE [eager's gradient layouts]: `torch.autograd.grad` returns each input's gradient in the
layout its backward formulas produce: `x @ w` with a transposed `x` gives a transposed
gradient (`mm_mat1_backward` keeps mat1's layout), `x.mean(0)` a row-major one (an expand
divided), `F.mse_loss(x.T, y)` the layout of `y`. fulmen's VJP rules compute the same values
with other formulas (`mean` as `sum * 1/n`: the gradient an expand), so their layouts differ,
and code reading `g.stride()`, `g.is_contiguous()` or `g.view(...)` saw another tensor. (`.grad`
is not concerned: AccumulateGrad lays every gradient out like its parameter, or row-major.)
The first backward of a compiled call whose inputs or gradients are not all row-major runs the
program's computation trace with torch's ops on its inputs and cotangents (detached; CPU inputs
up to `REAL_REPLAY_BYTES`) or on fake tensors of their layouts (PyTorch's meta kernels, which
lay a few backwards out otherwise than the CPU kernels), asks torch's autograd for the
gradients, and keeps their layouts (the random state restored after); that backward and
the later ones relay out a gradient that differs (`EagerReplay.relaid`), a copy (an eager
gradient that is an expand is left as fulmen computed it). Row-major inputs with row-major
gradients, the common case, cost one check at the first backward.

NOTE [inference tensors saved for backward]: eager raises "Inference tensors cannot be saved
for backward" when an op recording a graph saves a tensor made under `torch.inference_mode()`
(`x * w` saves `x` for `w`'s gradient; `x.exp() * w` saves only `x.exp()`, an ordinary
tensor). A compiled call's residuals are not eager's saved tensors, so the call with an
inference tensor argument runs the program on fake tensors with a saved-tensors hook
(`EagerReplay.refuse_saved_inference`, once per set of inference arguments) and raises
eager's error, naming the argument, where eager would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch._prims_common import is_non_overlapping_and_dense_or_false as _dense

from fulmen.core import Tag, Trace, any_tagged
from fulmen.core.ambient import without_autocast
from fulmen.proxies import TensorProxy


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode(allow_non_fake_inputs=True)


# inputs (all on the CPU) up to this size replay on the real tensors: PyTorch's meta kernels
# lay some backwards out otherwise than its CPU kernels (`mse_loss` of a transposed input, an
# eval-mode `batch_norm` of a channels-last one); larger ones, and other devices, on fake ones
REAL_REPLAY_BYTES = 1 << 26


def _real_like(t, writes: bool):
    """`t` detached (a copy where the program writes into its inputs, or an inference tensor),
    requiring grad as `t` does; other values as they are."""
    if not isinstance(t, torch.Tensor):
        return t
    same = t.detach()
    if (writes or t.is_inference()) and _dense(t):
        same = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        same.copy_(t.detach())
    elif writes or t.is_inference():  # (overlapping: an expand)
        same = same.clone()
    return same.requires_grad_(t.requires_grad)


def _like(t):
    """A fake stand-in (inside a fake mode) with `t`'s layout and requires_grad where `t` is a
    tensor; other values as they are."""
    if not isinstance(t, torch.Tensor):
        return t
    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return fake.requires_grad_(t.requires_grad)


class EagerReplay:
    """A program's computation trace, run with torch's ops (on fake tensors, or on its inputs)
    to learn what eager's autograd would do with it (NOTE [eager's gradient layouts], NOTE [inference
    tensors saved for backward])."""

    def __init__(self, computation: Trace):
        self._trace = computation
        self._fn: Callable | None = None
        self.names = [p.name if isinstance(p, TensorProxy) else None for p in computation.args]
        # until the first backward has decided `layouts`: per input, eager's (shape, strides)
        # of its gradient where a relayout is due, else None; None where none is
        self.pending = True
        self.layouts: tuple | None = None
        self._saving: dict[tuple, frozenset[int]] = {}
        self._writes = any_tagged(computation.bsyms, frozenset({Tag.WRITE_BACK}))

    def _run(self, inputs, cotangents=None, saved: list | None = None, real: bool = False,
             wrt: frozenset[int] | None = None):
        """The stand-ins of `inputs`, and eager's gradients of them (with `cotangents`) or None.
        Fake stand-ins, or with `real`, the inputs themselves (detached; copies where the
        program writes into them), the random state restored after."""
        if self._fn is None:
            self._fn = without_autocast(self._trace.python_callable())
        hooks = contextlib.nullcontext()
        mode = torch.random.fork_rng(devices=[]) if real else _fake_mode()
        with mode, torch.enable_grad():
            stand_ins = [_real_like(x, self._writes) if real else _like(x) for x in inputs]
            if wrt is not None:  # (`fulmen.grad`: the inputs differentiated)
                stand_ins = [x.detach().requires_grad_(i in wrt)
                             if isinstance(x, torch.Tensor) and x.dtype.is_floating_point else x
                             for i, x in enumerate(stand_ins)]
            if saved is not None:
                ids = {id(f): i for i, f in enumerate(stand_ins)}

                def pack(t):
                    while t is not None:
                        if id(t) in ids:
                            saved.append(ids[id(t)])
                            break
                        t = t._base
                    return None

                hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None)
            with hooks:
                outputs = pytree.tree_leaves(self._fn(*stand_ins))
            if cotangents is None:
                return stand_ins, None
            pairs = [(o, g.detach() if real else _like(g)) for o, g in zip(outputs, cotangents)
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            wrt = [f for f in stand_ins if isinstance(f, torch.Tensor) and f.requires_grad]
            if not pairs or not wrt:
                return stand_ins, [None] * len(wrt)
            grads = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                        allow_unused=True)
            return stand_ins, grads

    def decide_layouts(self, inputs: list, cotangents, grads,
                       wrt: tuple[int, ...] | None = None) -> None:
        """Record, from the first backward's call `inputs`, `cotangents` and fulmen's `grads`
        (one per input, or with `wrt`, one per input at those positions), which gradients to
        relay out (NOTE [eager's gradient layouts])."""
        self.pending = False
        positions = range(len(inputs)) if wrt is None else wrt
        pairs = [(inputs[i], g) for i, g in zip(positions, grads) if isinstance(g, torch.Tensor)]
        if all(x.is_contiguous() and g.is_contiguous() for x, g in pairs):
            return
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        real = (all(x.device.type == "cpu" for x in tensors)
                and sum(x.numel() * x.element_size() for x in tensors) <= REAL_REPLAY_BYTES)
        try:
            stand_ins, eager = self._run(inputs, cotangents, real=real,
                                         wrt=None if wrt is None else frozenset(wrt))
        except Exception:  # a program torch cannot run so: layouts left as computed
            return
        differentiated = [i for i, x in enumerate(stand_ins)
                          if isinstance(x, torch.Tensor) and x.requires_grad]
        eager_of = dict(zip(differentiated, eager))
        layouts = []
        for i, grad in zip(positions, grads):
            want = eager_of.get(i)
            if (not isinstance(grad, torch.Tensor) or want is None or not _dense(want)
                    or grad.stride() == want.stride() or grad.shape != want.shape):
                layouts.append(None)
            else:
                layouts.append((tuple(want.shape), tuple(want.stride())))
        if any(layouts):
            self.layouts = tuple(layouts)

    def relaid(self, grads) -> tuple:
        """`grads` with each one laid out as eager's (`self.layouts`)."""
        return tuple(_relaid(g, layout) for g, layout in zip(grads, self.layouts))

    def refuse_saved_inference(self, inputs) -> None:
        """Raise eager's error where an op recording a graph would save an inference tensor
        argument (NOTE [inference tensors saved for backward])."""
        made = tuple(i for i, x in enumerate(inputs)
                     if isinstance(x, torch.Tensor) and x.is_inference())
        key = (made, tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs))
        saved = self._saving.get(key)
        if saved is None:
            found: list[int] = []
            try:
                self._run(inputs, saved=found)
            except Exception:  # fake tensors cannot run it: the call goes ahead
                pass
            saved = self._saving[key] = frozenset(found)
        for i in made:
            if i in saved:
                name = self.names[i] if i < len(self.names) else None
                raise RuntimeError(
                    "Inference tensors cannot be saved for backward. Please do not use Tensors "
                    "created in inference mode in computation tracked by autograd. To work "
                    "around this, you can make a clone to get a normal tensor (the argument "
                    f"`{name}` of the fulmen-compiled function was made under "
                    "torch.inference_mode(), and eager saves it for backward)")


def _relaid(grad, layout):
    if layout is None or grad is None:
        return grad
    shape, strides = layout
    if grad.stride() == strides and tuple(grad.shape) == shape:
        return grad
    if tuple(grad.shape) == shape:
        out = torch.empty_strided(shape, strides, dtype=grad.dtype, device=grad.device)
    else:  # another size of a symbolic entry: eager's order of dims in memory
        order = sorted(range(len(shape)), key=lambda d: -strides[d])
        out = torch.empty_permuted(grad.shape, order, dtype=grad.dtype, device=grad.device)
        if out.stride() == grad.stride():
            return grad
    return out.copy_(grad)


def grads_laid_out_as_eager(fn: Callable, computation: Trace, wrt) -> Callable:
    """`fn` (a compiled `fulmen.grad` program of `computation`: `inputs -> (value, grads)`,
    one gradient per input named in `wrt`) with its gradients in the layouts eager's
    `torch.func.grad` gives (NOTE [eager's gradient layouts])."""
    replay = eager_replay(computation)
    if replay is None:
        return fn
    positions = tuple(replay.names.index(name) for name in wrt)

    def run(*inputs):
        value, grads = fn(*inputs)
        if replay.pending:
            replay.decide_layouts(list(inputs), [torch.ones_like(value)], grads, positions)
        if replay.layouts is not None:
            grads = replay.relaid(grads)
        return value, grads

    return run


def eager_replay(computation: Trace) -> EagerReplay | None:
    """An `EagerReplay` of `computation`; None where running it again could act on the world
    (side effects)."""
    if any_tagged(computation.bsyms, frozenset({Tag.SIDE_EFFECT})):
        return None
    return EagerReplay(computation)


__all__ = ["EagerReplay", "eager_replay", "grads_laid_out_as_eager"]
