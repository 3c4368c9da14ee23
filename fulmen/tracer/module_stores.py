"""Stores a traced forward makes on its modules (`self.calls += 1`, `self.mode = "b"`,
`self.history.append(n)`).

A compiled call runs no Python, so a store made by the forward would happen only while tracing.
While tracing, every module is put back as it was afterwards, and each change is sorted:

- a traced tensor stored on a module (`self.aux_loss = loss`, a buffer replaced:
  `self.mem = torch.cat([self.mem, h])`, or by another tensor the trace reads:
  `self.inv_freq = self.original_inv_freq`), or a new tuple or list of traced tensors and
  constants (`self.kv = (k, v)`, a dict too), is `traced`: the trace returns the tensors and the compiled
  program stores the call's real ones (an epilogue store, `fulmen.tracer.objects`), so autograd
  reaches them as in eager. So is a symbolic size (`self.n = x.shape[0]`, `(k, x.shape[0])`):
  the epilogue stores the call's own value (NOTE [traced numbers in stores]). A traced tensor
  put into a module's list or dict in place (`self.cache["h"] = t`, `self.maps.append(t)`) is
  refused;
- a plain constant stored (numbers, strings, None, dtypes, tuples of them) on a module or on a
  plain object a module holds (`self.config.count += 1`; such objects keep the stores made
  while tracing), or a module's plain list or dict changed in place to hold only such
  constants, is replayed after every call of
  the compiled program. The module attributes the forward reads are part of the cache key
  (`fulmen.tracer.guards`), so a call served by the program starts from the same values and ends
  at the same ones: a counter incremented per call compiles anew for each value, as
  `self.training` does, and never gives a stale one;
- hooks registered on a module are kept, as in eager (HF registers its output-capturing
  hooks in the first forward that asks for hidden states; the jitted module then retraces);
- anything else (another object stored, an attribute deleted, a symbolic size stored on a
  plain object a module holds, where it would stay a symbol) makes the call run eagerly
  (`UnreplayableStore`, a `RunsEagerly`; raised under `fullgraph=True`),
  naming the attribute. (A store such as HF LeViT's eval-mode `attention_bias_cache[key] = t`
  happens on the first call only: that call runs eagerly, the next compile.)

The stores of a program with graph breaks differ per path; they are refused there.

Modules the traced function reaches other than the jitted one (`step(model, batch)`: a module
argument, one held by an argument object, a closure or a global; `held_modules`) are put back
the same way (`module_stores(module, proxy_of, captured)`): constants they store are replayed
as above, an in-place update of a buffer (`self.seen += 1`, which stores the buffer itself
again) needs no store (the trace writes the buffer back), and a traced value stored on them
(`self.last = t`, a symbolic size too) makes the call run eagerly, since the epilogue stores
only into the jitted module and argument objects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fulmen.core import RunsEagerly
from fulmen.proxies import TensorProxy
from fulmen.tracer.module_hooks import backward_hooked
from fulmen.tracer.objects import (
    TRACED_NUMBERS,
    function_roots,
    is_plain_object,
    restore,
    snapshot,
    unchanged,
    walk,
)
from fulmen.tracer.sources import code_names

_MISSING = object()
# hooks a forward registers on its modules (HF installs its output-capturing hooks lazily, in the
# first forward asked for hidden states) stay, as in eager: the jitted module's hook check
# (`fulmen.tracer.module_hooks.HookWatch`) then retraces with them
_HOOK_ATTRIBUTES = frozenset(name for name in vars(torch.nn.Module()) if "hook" in name)
_NOT_STORES = frozenset(["_parameters", "_buffers", *_HOOK_ATTRIBUTES])
_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_MAX_DEPTH = 4


def _constant(value: Any, depth: int = 0) -> bool:
    """Whether `value` is an immutable Python constant a program may store again as it is."""
    if type(value) in _CONSTANT_TYPES:
        return True
    if type(value) in (tuple, frozenset, torch.Size) and depth < _MAX_DEPTH:
        return all(_constant(item, depth + 1) for item in value)
    return False


def _constant_contents(value: Any, depth: int = 0) -> bool:
    """Whether the list or dict `value` holds only constants (nested lists/dicts allowed)."""
    if depth >= _MAX_DEPTH:
        return False
    if isinstance(value, dict) and type(value) is dict:
        items = [*value.keys(), *value.values()]
    elif type(value) is list:
        items = value
    else:
        return _constant(value, depth)
    return all(_constant(item, depth + 1) or _constant_contents(item, depth + 1)
               for item in items)


# what a store may take from the trace's outputs: a traced tensor or number (a symbolic size)
_TRACED = (TensorProxy, *TRACED_NUMBERS)


def _traced_value(value: Any) -> bool:
    """Whether `value` is a traced tensor or number (a symbolic size), or a new tuple, list or
    dict of such and constants, that a store can take from the trace's outputs (numbers: NOTE
    [traced numbers in stores])."""
    if isinstance(value, _TRACED):
        return True
    if type(value) is dict:
        value = [*value.keys(), *value.values()]
    return type(value) in (tuple, list) and all(
        isinstance(item, _TRACED) or _constant(item) for item in value)


def _holds(value, kinds: tuple = (TensorProxy,)) -> bool:
    """Whether `value` is or holds (in a list, tuple, dict or plain object) an instance of
    `kinds`: by default a traced tensor; `_TRACED`, a traced tensor or number."""
    if isinstance(value, kinds):
        return True
    if isinstance(value, (list, tuple, dict)) or is_plain_object(value):
        return any(isinstance(item, kinds) for _, item in walk(value))
    return False


def _traced_kind(value) -> str:
    """What a refused store of `value` (which `_holds(value, _TRACED)`) holds, for the message."""
    return "a traced tensor" if _holds(value) else "a symbolic size"


@dataclass(frozen=True)
class ModuleStore:
    """One store to replay: `module.<key> = value` (`module` may also be a plain object a
    module holds, such as its config), or (`contents`) the list or dict held in `module.<key>`
    given the contents `value` (a `fulmen.tracer.objects.snapshot`)."""

    module: torch.nn.Module
    key: str
    value: Any
    contents: bool = False
    traced: bool = False  # `value` holds proxies: stored by the epilogue, not by `replay`
    path: tuple = ()  # `fulmen.tracer.objects.follow` steps from the jitted module to `module`

    def replay(self) -> None:
        attrs = vars(self.module)
        if self.contents:
            restore(attrs[self.key], self.value)
        else:
            attrs[self.key] = self.value


@dataclass(frozen=True)
class GradClear:
    """`tensor.grad = None` on a tensor the function closes over (a parameter of a closed-over
    model: `model.zero_grad()` in a jitted step), replayed after each call as a module store
    is. The tensor is a captured input of the trace, the same object on every call."""

    tensor: torch.Tensor
    key: str = "grad"
    traced: bool = False

    def replay(self) -> None:
        self.tensor.grad = None


def captured_grad_clears(cleared: list[TensorProxy], captured: dict, has_breaks: bool,
                         ) -> tuple[list[TensorProxy], list[GradClear]]:
    """Split the tensors whose `.grad` the traced code set to None into those it closes over
    (`captured`, the tracer's table: id -> (tensor, proxy)), whose clears are returned as
    `GradClear` stores, and the rest (argument objects' tensors: epilogue stores).

    Raises:
        UnreplayableStore: a closed-over tensor's `.grad` is cleared in a function with graph
            breaks (whose module stores are settled by replaying them while tracing, which a
            gradient's clear cannot undo).
    """
    by_proxy = {id(proxy): tensor for tensor, proxy in captured.values()}
    rest, clears = [], []
    for proxy in cleared:
        tensor = by_proxy.get(id(proxy))
        if tensor is None:
            rest.append(proxy)
        elif has_breaks:
            raise UnreplayableStore(
                f"setting the .grad of {proxy.name}, a tensor the function closes over, in a "
                "function with graph breaks", op="Tensor.grad")
        elif all(clear.tensor is not tensor for clear in clears):
            clears.append(GradClear(tensor))
    return rest, clears


def _is_module(value: Any) -> bool:
    return isinstance(value, torch.nn.Module)


def held_modules(fn, arguments: Any, roots: list, jitted: torch.nn.Module | None,
                 ) -> list[torch.nn.Module]:
    """The modules a traced function reaches besides the jitted module `jitted` (and its
    submodules): modules among `arguments` (a pytree) and held by the object `roots`, the
    bound `self` and closure cells of `fn` (`function_roots`) and the globals its code names
    (`code_names`); none a submodule of another."""
    found: dict[int, torch.nn.Module] = {}

    def add(value) -> None:
        if _is_module(value):
            found.setdefault(id(value), value)

    for leaf in torch.utils._pytree.tree_leaves(arguments):
        add(leaf)
    for root in roots:
        add(root)
        for _, value in walk(root):
            add(value)
    if fn is not None:
        for value in function_roots(fn, wanted=_is_module):
            add(value)
        inner = getattr(fn, "__func__", fn)
        code, scope = getattr(inner, "__code__", None), getattr(inner, "__globals__", {})
        for name in code_names(code) if code is not None else ():
            add(scope.get(name))
    covered = {id(sub) for sub in jitted.modules()} if jitted is not None else set()
    for module in found.values():
        covered |= {id(sub) for sub in module.modules() if sub is not module}
    return [module for key, module in found.items() if key not in covered]


class DistributedWrapper(RunsEagerly):
    """The function reaches a distributed wrapper (`DistributedDataParallel`, FSDP) other than
    as the jitted module: its forward prepares the gradient all-reduce through hooks and reducer
    state a trace cannot replay, so the call runs eagerly."""


def refuse_held(modules: list[torch.nn.Module]) -> None:
    """Raise `DistributedWrapper` if one of `modules` (`held_modules`) or a submodule is a
    distributed wrapper (`loss_fn(ddp_model, batch)` would silently skip the all-reduce), or
    `UnreplayableStore` if one holds backward hooks while grad is on (they would never fire)."""
    hooked = backward_hooked(modules) if torch.is_grad_enabled() else []
    if hooked:
        raise UnreplayableStore(
            f"the module {hooked[0]!r} the function reaches has backward hooks, which a compiled "
            "call would never fire", op="register_full_backward_hook",
            hint="register them on a jitted module's output or its parameters instead")
    for module in modules:
        for sub in module.modules():
            if type(sub).__module__.startswith("torch.distributed") or isinstance(
                    sub, torch.nn.parallel.DistributedDataParallel):
                raise DistributedWrapper(
                    f"the function calls the {type(sub).__name__} it is given; its gradient "
                    "synchronisation cannot be compiled", op=type(sub).__name__,
                    hint="compile the wrapped module instead: DDP(fulmen.jit(model)) or "
                    "fulmen.jit(DDP(model))")


def replay_module_stores(stores: tuple[ModuleStore, ...]) -> None:
    """Apply a compiled program's module stores, in the order the forward made them."""
    for store in stores:
        store.replay()


def make_module_stores(stores: tuple[ModuleStore, ...]) -> Callable[[], None]:
    """Make `stores` (as `replay_module_stores`); return a function that undoes them."""
    before = []
    for store in stores:
        attrs = vars(store.module)
        old = attrs.get(store.key, _MISSING)
        before.append((attrs, store.key, old, snapshot(old) if store.contents else None))
    replay_module_stores(stores)

    def undo() -> None:
        for attrs, key, old, contents in reversed(before):
            if old is _MISSING:
                attrs.pop(key, None)
            else:
                attrs[key] = old
                if contents is not None:
                    restore(old, contents)

    return undo


def _qualified(module_name: str, key: str) -> str:
    """`inner.calls`: the attribute `key` of the submodule named `module_name`."""
    return f"{module_name}.{key}" if module_name else key


class UnreplayableStore(RunsEagerly):
    """A store the forward makes on a module that a compiled call could not repeat (see the
    module docstring): the call runs eagerly, and raises this under `fullgraph=True`."""


def _refuse(name: str, what: str) -> UnreplayableStore:
    return UnreplayableStore(
        f"the forward stores {what} in the module attribute {name!r}; a compiled call would not "
        "repeat that store", op="setattr",
        hint="assign a new value instead (self.mem = t, self.kv = (k, v)), keep Python numbers, "
        "strings or tuples of them in module attributes, or return the value and keep it "
        "outside the module")


def _restore_table(table, saved: dict) -> None:
    """Put a module's parameter or buffer table back as `saved` held it, when it changed (a
    TorchScript module's tables are C++ views without `clear`)."""
    if list(table.keys()) != list(saved) or any(table[k] is not v for k, v in saved.items()):
        table.clear()
        table.update(saved)

@contextlib.contextmanager
def module_stores(module: torch.nn.Module,
                  proxy_of: Callable[[torch.Tensor], TensorProxy],
                  captured: dict | None = None) -> Iterator[list[ModuleStore]]:
    """Around a traced forward: put every module of `module` back as it was, and collect the
    stores to replay after each compiled call (in the yielded list, filled on exit).

    `proxy_of` gives the input proxy of a real tensor the forward stored in place of another
    (`self.register_buffer("inv_freq", self.original_inv_freq)`: the traced code sees a
    module's own tensors, not their proxies, when a call returns one unchanged); the store is
    then that proxy's, like any traced tensor's.

    `captured`, for a module other than the jitted one (see the module docstring), is the tracing
    context's captured table (`id(tensor) -> (tensor, proxy)`): a buffer or parameter stored
    again as its own proxy (an in-place update) is no store, and the rest must be constants.

    Raises:
        UnreplayableStore: a store that cannot be replayed, naming the module attribute.
    """
    saved = []
    for name, sub in module.named_modules():
        attrs = {k: v for k, v in vars(sub).items() if k not in _NOT_STORES}
        contents = {k: snapshot(v) for k, v in attrs.items() if isinstance(v, (list, dict))}
        saved.append((name, sub, attrs, contents, dict(sub._parameters), dict(sub._buffers)))
    held = {}  # plain objects the modules hold (a config): id -> (object, attributes, name)
    for name, _, attrs, *_ in saved:
        for key, value in attrs.items():
            if is_plain_object(value) and id(value) not in held:
                held[id(value)] = (value, snapshot(value), _qualified(name, key))
    found: list[ModuleStore] = []
    failed = True
    try:
        yield found
        failed = False
    finally:
        refusal = None
        for name, sub, attrs, contents, params, buffers in saved:
            now = {k: v for k, v in vars(sub).items() if k not in _NOT_STORES}
            for key, value in [*now.items(), *sub._buffers.items(), *sub._parameters.items()]:
                before = attrs.get(key, buffers.get(key, params.get(key)))
                in_place = key in contents and value is before and not unchanged(value,
                                                                               contents[key])
                if value is before and not in_place:
                    continue
                where = _qualified(name, key)
                if isinstance(value, torch.Tensor) and not isinstance(value, TensorProxy):
                    value = proxy_of(value)  # another buffer, a global tensor: an input
                if captured is not None and isinstance(value, TensorProxy) and isinstance(
                        before, torch.Tensor) and captured.get(id(before), (None, None))[1] is value:
                    continue  # `self.seen += 1`: the tensor updated in place, written back
                if captured is not None and _holds(value, _TRACED):
                    refusal = refusal or _refuse(where, _traced_kind(value))
                elif _holds(value, _TRACED) and not in_place and _traced_value(value):
                    steps = tuple(("attr", part) for part in name.split(".")) if name else ()
                    found.append(ModuleStore(sub, key, value, traced=True, path=steps))
                elif _holds(value):
                    refusal = refusal or _refuse(where, "a traced tensor inside a list or dict")
                elif in_place and _constant_contents(value):
                    found.append(ModuleStore(sub, key, snapshot(value), contents=True))
                elif not in_place and _constant(value):
                    found.append(ModuleStore(sub, key, value))
                else:
                    refusal = refusal or _refuse(where, f"a {type(value).__name__}")
            for key in set(attrs) - set(now):
                refusal = refusal or _refuse(_qualified(name, key), "a deletion")
            for key in set(now) - set(attrs):
                delattr(sub, key)
            vars(sub).update(attrs)
            for key, value in contents.items():
                restore(attrs[key], value)
            _restore_table(sub._parameters, params)
            _restore_table(sub._buffers, buffers)
        for owner, before, where in held.values():  # `self.config.count += 1`
            for key, value in vars(owner).items():
                if value is before.get(key, _MISSING):
                    continue
                if _holds(value, _TRACED):
                    refusal = refusal or _refuse(f"{where}.{key}", _traced_kind(value))
                elif _constant(value):
                    found.append(ModuleStore(owner, key, value))
        if refusal is not None and not failed:
            raise refusal
