"""A user's `torch.autograd.Function` as one op: forward and backward are the user's own.

`function_symbol(cls, autocast_state)` is the symbol for `cls.apply`. Outside tracing it runs
`cls.apply` itself on real tensors (under the autocast state the call was traced in), so when the
autodiff transform keeps the op's torch.autograd graph (as for every opaque op, see NOTE [whole
ops in forward]) the backward is the user's `backward`, exactly as in eager: `ctx.saved_tensors`,
`needs_input_grad`, `mark_non_differentiable`, `set_materialize_grads`, `once_differentiable`.

Its meta function runs `cls.apply` once on fake tensors (no storage, no compute) to describe the
outputs; the op has no decomposition, so executors run it whole and never fuse across it, and
it is never dropped or reordered (forward may draw random numbers). A
`forward` that modifies an input in place (`ctx.mark_dirty`), or that gets a Python object it
may change (a cache, a list it appends to: Reformer's reversible layers) is not traced: the call
runs eagerly.
"""

from __future__ import annotations

import contextlib
import enum

import torch
import torch.utils._pytree as pytree

from fulmen.core import FulmenError, NotYetSupportedError, RunsEagerly, Symbol
from fulmen.core.source import user_source_location
from fulmen.core.symbol import Namespace
from fulmen.core.trace import get_tracectx, not_tracing
from fulmen.ops.meta import fake_run
from fulmen.proxies import TensorProxy


class UntraceableFunction(RunsEagerly):
    """A custom autograd.Function fulmen cannot trace: its forward modifies an input in place
    (`ctx.mark_dirty`), reads a traced tensor that is no argument of `apply`, or cannot run on
    fake tensors (`.item()`, NumPy). The call runs eagerly, as written."""


NAMESPACE = Namespace("autograd_function", "fulmen.ops.autograd_function",
                      "from fulmen.ops import autograd_function")
_SYMBOLS: dict[tuple, Symbol] = {}
_BY_NAME: dict[str, Symbol] = {}

# ((device type, dtype), ...) for every device type with autocast enabled
AutocastState = tuple[tuple[str, torch.dtype], ...]
_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> AutocastState:
    """The ambient autocast state, `()` when autocast is off everywhere."""
    if not torch._C._is_any_autocast_enabled():
        return ()
    return tuple((device, torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(device))


def _autocast(state: AutocastState) -> contextlib.AbstractContextManager:
    """Exactly `state`: its devices autocast to their dtypes, every other device not at all."""
    if not state and not torch._C._is_any_autocast_enabled():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    enabled = dict(state)
    for device in _AUTOCAST_DEVICES:
        if device in enabled:
            stack.enter_context(torch.autocast(device, dtype=enabled[device]))
        elif torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


class FunctionApply:
    """`cls.apply` under a fixed autocast state: the implementation of the symbol."""

    def __init__(self, cls: type, state: AutocastState) -> None:
        self.cls = cls
        self.state = state
        self.__name__ = cls.__name__
        self.__qualname__ = f"{cls.__qualname__}.apply"

    def __call__(self, *args, **kwargs):
        with _autocast(self.state):
            return self.cls.apply(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.cls.__module__}.{self.__qualname__}>"


def _label(cls: type) -> str:
    return f"{cls.__qualname__}.apply"


# arguments of `apply` that forward cannot change: constants (symbolic sizes too), modules
# (their tensors are traced values, refused when forward reads them) and functions
_INERT = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.layout, torch.memory_format, torch.Size, slice, type(Ellipsis), range, enum.Enum,
          torch.SymInt, torch.SymFloat, torch.SymBool, torch.nn.Module, TensorProxy, torch.Tensor)


def _refuse_held_objects(cls: type, arguments) -> None:
    """Raise UntraceableFunction when `apply` gets a Python object other than a constant, a
    module or a function (Reformer's reversible layers get the model's cache and append to it):
    the fake run that describes the outputs would change it, and the compiled call would pass
    the object kept from tracing, not the caller's."""
    for leaf in pytree.tree_leaves(arguments):
        if not isinstance(leaf, _INERT) and not callable(leaf):
            raise UntraceableFunction(
                f"the custom autograd.Function gets a {type(leaf).__name__}, a Python object "
                "its forward may change (eager changes the caller's; a compiled call would "
                "change the one kept from tracing)", op=_label(cls), where=user_source_location(),
                hint="pass tensors and constants to apply, or call the Function outside the "
                "compiled function")


def _fake_outputs(cls: type, args: tuple, kwargs: dict, requires: set[str]):
    """Run `cls.apply` on fake tensors standing for the proxies; return the outputs with each
    fake tensor replaced by a new proxy, and raise if `forward` modified an input in place.
    The fakes are made outside inference mode (a call under `torch.inference_mode()`: inference
    tensors have no version counter to check, and the outputs' shapes are the same)."""
    fakes: dict[str, torch.Tensor] = {}
    with not_tracing(), fake_run(allow_non_fake_inputs=True):

        def fake(leaf):
            if not isinstance(leaf, TensorProxy):
                return leaf
            if leaf.name not in fakes:
                tensor = torch.empty_strided(tuple(leaf.shape), tuple(leaf.stride()),
                                             dtype=leaf.dtype, device=leaf.device)
                if leaf.name in requires and (leaf.dtype.is_floating_point or leaf.dtype.is_complex):
                    tensor = tensor.requires_grad_().clone()  # not a leaf, as a traced value
                fakes[leaf.name] = tensor
            return fakes[leaf.name]

        _refuse_held_objects(cls, (args, kwargs))
        fake_args, fake_kwargs = pytree.tree_map(fake, (args, kwargs))
        structure = pytree.tree_structure((fake_args, fake_kwargs))
        versions = {name: t._version for name, t in fakes.items()}
        with torch.enable_grad():
            out = cls.apply(*fake_args, **fake_kwargs)
        modified = [name for name, t in fakes.items() if t._version != versions[name]]
    if pytree.tree_structure((fake_args, fake_kwargs)) != structure:
        raise UntraceableFunction(
            "the custom autograd.Function's forward adds to or removes from a list or dict "
            "it gets (eager changes the caller's; a compiled call would change a copy)",
            op=_label(cls), where=user_source_location(),
            hint="return the values from forward, or call the Function outside the compiled "
            "function")
    if modified:
        raise UntraceableFunction(
            f"the custom autograd.Function's forward modifies its input {modified[0]} in place "
            "(ctx.mark_dirty)", op=_label(cls), where=user_source_location(),
            hint="return a new tensor from forward, or call the Function outside the compiled "
            "function")

    def proxy(leaf):
        if isinstance(leaf, torch.Tensor):
            return TensorProxy(None, leaf.shape, leaf.dtype, leaf.device, strides=leaf.stride())
        return leaf

    return pytree.tree_map(proxy, out)


def function_symbol(cls: type, state: AutocastState = ()) -> Symbol:
    """The (cached) symbol for `cls.apply` called under autocast state `state`."""
    sym = _SYMBOLS.get((cls, state))
    if sym is not None:
        return sym
    name = cls.__name__ if not state else f"{cls.__name__}_autocast"
    while name in _BY_NAME:
        name += "_"

    def meta(*args, **kwargs):
        ctx = get_tracectx()
        requires = getattr(ctx, "requires_grad_names", set())
        try:
            return _fake_outputs(cls, args, kwargs, requires)
        except NotYetSupportedError:
            raise
        except FulmenError as error:  # a proxy reached fake tensors' dispatch
            raise UntraceableFunction(
                "the custom autograd.Function's forward uses a traced tensor that is not an "
                "argument of apply (a module parameter, or a tensor held by an object)",
                op=_label(cls), where=user_source_location(),
                hint="pass every tensor forward uses as an argument of apply, so its gradient "
                "is the one backward returns") from error
        except Exception as error:
            raise UntraceableFunction(
                f"cannot describe the outputs of a custom autograd.Function by running its "
                f"forward on fake tensors: {type(error).__name__}: {error}", op=_label(cls),
                where=user_source_location(),
                hint="make forward run on tensors without storage (no .item(), .numpy() or "
                "data-dependent shapes), or call it outside the compiled function",
            ) from error

    run = FunctionApply(cls, state)
    # "random": forward may draw random numbers or have Python effects, so the call is never
    # dropped or reordered, as eager runs it
    sym = Symbol(name, meta, namespace=NAMESPACE, impl=run, torch_fn=run,
                 tags={"opaque", "random", "autograd_function"})
    _SYMBOLS[(cls, state)] = sym
    _BY_NAME[name] = sym
    return sym


def __getattr__(name: str) -> Symbol:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise AttributeError(name) from None


__all__ = ["FunctionApply", "autocast_state", "function_symbol"]
