"""Python objects the traced code reads and writes: tensors inside them are inputs, stores into
them are replayed, and their Python state is guarded.

Model code hands objects around that are not tensors or pytrees: an HF `DynamicCache` (a list of
layers, each holding key and value tensors and flags), an optimizer (`param_groups`, `state`),
a config. Baking what the code read from them into the trace would be wrong on the next call,
and so would leaving proxies in them after tracing. For every such object among the call's
arguments (and the `self` of a jitted bound method), `ObjectInputs`
(`fulmen.tracer.object_inputs`, the layer above this module):

- walks what it holds (attributes, lists, tuples, dicts; `walk`), and makes each tensor found a
  trace input, read again through the same path on every call (`read_tensors`);
- guards everything else it holds: the cache key of the object is its walked structure, each
  Python value and each tensor's metadata (`object_key`);
- after tracing, compares the object with how it was and records each store the code made
  (`obj.keys = t5`, `layers.append(DynamicLayer(...))`, `self.seen = 3`) as an epilogue
  action; the object is then put back as it was, and the compiled program replays the stores
  with the real values on every call (`Epilogue.run`). Objects the program returns that hold
  traced tensors (a cache created inside the model) are rebuilt the same way.

Values are rebuilt from *templates*: the object as traced, in which proxies are replaced by the
run's real tensors, objects that existed before the call by the current call's objects at the
same path, and everything else is copied (`copy.deepcopy` with a prepared memo).
"""

from __future__ import annotations

import copy
import dis
import enum
import functools
import logging
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from fulmen.ops.host_float import FloatProxy, sign_class
from fulmen.proxies import TensorProxy

TRACED_NUMBERS = (torch.SymInt, torch.SymFloat, torch.SymBool)
# the Python type of each symbolic number's value (`int(s0)`)
PLAIN_NUMBER = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}
_ATOMS = (*TRACED_NUMBERS, bool, int, float, complex, str, bytes, type(None), torch.dtype,
          torch.device, torch.Size, enum.Enum, slice, range, type(Ellipsis), torch.memory_format,
          torch.layout)


class NotWalked:
    """Base of fulmen's own objects a user's object may hold (`opt.step = fulmen.jit(opt.step)`,
    as `GradScaler.step(opt)` calls `opt.step`): such an attribute is keyed by identity and
    never looked inside. Walked, the key of a call held the jitted function's cache and traces
    (and the traces' unhashable bound symbols), so the call raised `TypeError`."""


# (loggers: their `_cache` fills as they are asked, and their manager holds every logger)
_OPAQUE = (NotWalked, torch.Tensor, torch.nn.Module, type, types.FunctionType, types.MethodType,
           types.ModuleType, types.BuiltinFunctionType, functools.partial, torch.Generator,
           logging.Logger, logging.Manager, logging.LoggerAdapter)
_NOT_PLAIN = _ATOMS + _OPAQUE
# their exact types (and Parameter's): an instance of one is no plain object, known without
# `isinstance` trying each of the classes above in turn (the common case of a walked value)
_NOT_PLAIN_TYPES = frozenset([*_NOT_PLAIN, torch.nn.Parameter])
_MAX_DEPTH = 6
ARGUMENTS = "arguments"  # the `roots` key under which `Epilogue.run` finds the call's (args, kwargs)
MODULE = "module"  # the `roots` key under which `Epilogue.run` finds the jitted module
_MAX_SLOTS = 4096
INT_KEY = ("symbolic int",)  # the key of an integer traced as a symbol (its value left out)
FLOAT_KEY = ("float read at run time",)  # the mask of such a float (`fulmen.ops.host_float`)


def float_key(value: float) -> tuple:
    """The key of a float read at run time: its type and the class of its sign, which the
    trace may have compared with zero (`fulmen.ops.host_float.sign_class`)."""
    return (*FLOAT_KEY, sign_class(value))


def has_argument_grad(t: torch.Tensor) -> bool:
    """Whether `t` is a leaf with a `.grad` (read without the non-leaf warning): a program that
    reads the grad of such an argument depends on it (`clip_grad_norm_(params)`)."""
    return t.requires_grad and t.is_leaf and t.grad is not None


def _grad_of(t: torch.Tensor) -> torch.Tensor | None:
    """`t.grad` where autograd fills it (a leaf, or a tensor that retains its grad), else None:
    reading a non-leaf's `.grad` warns (a KV cache built under grad mode holds non-leaves)."""
    return t.grad if t.is_leaf or t.retains_grad else None


def is_plain_object(value: Any) -> bool:
    """Whether fulmen looks inside `value`: an instance of a Python class with a `__dict__`
    (not a tensor, module, function, class or atom such as a number or dtype)."""
    if type(value) in _NOT_PLAIN_TYPES:
        return False
    return not isinstance(value, _NOT_PLAIN) and hasattr(value, "__dict__")


def _children(value: Any) -> list[tuple[tuple, Any]]:
    """`(step, child)` for what `value` holds: attributes, list/tuple items, dict entries."""
    if isinstance(value, (list, tuple)):
        return [(("item", i), item) for i, item in enumerate(value)]
    if isinstance(value, dict):  # tensor keys too: an optimizer's `state[param]`
        return [(("key", key), item) for key, item in value.items()
                if isinstance(key, (str, int, bool, enum.Enum, torch.Tensor))]
    if is_plain_object(value):
        return [(("attr", name), item) for name, item in vars(value).items()]
    return []


def _walkable(value: Any) -> bool:
    return isinstance(value, (list, tuple, dict)) or is_plain_object(value)


# the opcodes that read a name from the globals (Python 3.12 adds LOAD_FROM_DICT_OR_GLOBALS,
# for class bodies inside functions); a read missed here would be a global left out of the key
_GLOBAL_READS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})


@functools.lru_cache(maxsize=4096)
def global_names(code) -> frozenset[str]:
    """The names `code` and the code objects nested in it read as globals (`_GLOBAL_READS`),
    unlike `code_names`, whose `co_names` also holds attribute names: `ctx.n = 5` in a custom
    autograd Function reads no global `n`, and keying a global `n` would retrace the program at
    each change of it."""
    names = {instruction.argval for instruction in dis.get_instructions(code)
             if instruction.opname in _GLOBAL_READS}
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= global_names(const)
    return frozenset(names)


def function_roots(fn: Any, depth: int = 0, wanted=None, log: list | None = None) -> list[Any]:
    """The objects a function reads besides its arguments: the `self` of a bound method, the
    plain objects it reads as globals and the objects in its closure cells (through weak references and the bound methods and
    functions found there, as an LR scheduler wraps `optimizer.step`), in a fixed order; also
    those held one step away: in small lists, tuples and dicts it reads (`opts[0].step()`,
    `_held_objects`), as a module's optimizers (`self.opt`, `_module_optimizers`), as default
    argument values and as a `functools.partial`'s bound arguments.
    `wanted(value)` chooses them (by default plain objects, and among closure cells only those
    that are not callable: not another jitted function). `log` (a list) gets every read the
    answer depends on (`key_memo.RootsMemo`), or None where a read is not one it can repeat."""
    found: list[Any] = []
    if depth > 2:
        return found
    if log is not None and not (type(fn) is types.FunctionType or (
            type(fn) is types.MethodType and type(fn.__func__) is types.FunctionType)):
        log.append(None)  # (`__self__`, `__closure__` of other callables may change)
    if isinstance(fn, functools.partial):  # `jit(partial(step, opt))`: its bound arguments
        if wanted is None:
            for value in (*fn.args, *fn.keywords.values()):
                found += [value] if is_plain_object(value) and not callable(value) else \
                    _held_objects(value)
        return _unique(found + function_roots(fn.func, depth, wanted, log))
    bound = getattr(fn, "__self__", None)
    if log is not None:
        log.append(("value", bound))
    if is_plain_object(bound) if wanted is None else wanted(bound):
        found.append(bound)
    elif wanted is None:  # a module's method stepping `self.opt`
        found += _module_optimizers(bound, log)
    inner = getattr(fn, "__func__", fn)
    if log is not None and type(inner) is types.FunctionType:
        log.append(("code", inner, inner.__code__))
    for cell in getattr(inner, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            if log is not None:
                log.append(None)
            continue
        if log is not None:
            log.append(("cell", cell, value))
        if isinstance(value, weakref.ReferenceType):
            value = value()
            if log is not None:  # (a memo would hold the referent alive)
                log.append(None)
        if log is not None:
            log.append(("value", value))
        if isinstance(value, (types.FunctionType, types.MethodType)):
            found += function_roots(value, depth + 1, wanted, log)
        elif (is_plain_object(value) and not callable(value)) if wanted is None else \
                wanted(value):
            found.append(value)
        elif wanted is None:  # `opts = [opt]` ... `opts[0].step()`: the objects a list holds
            found += _held_objects(value, log=log) + _module_optimizers(value, log)
    if wanted is None and depth == 0 and isinstance(inner, types.FunctionType):
        # the plain objects it reads as globals, as those of its closure: a module-level
        # `def train_step(): opt.step()` stores the first step's state into `opt.state`
        namespace = inner.__globals__
        names = sorted(global_names(inner.__code__))
        if log is not None:
            log.append(("globals", namespace, names, [namespace.get(name) for name in names]))
        for name in names:
            value = namespace.get(name)
            found += [value] if is_plain_object(value) and not callable(value) else \
                _held_objects(value, log=log) + _module_optimizers(value, log)
    if wanted is None and isinstance(inner, types.FunctionType):
        # default argument values (`def step(x, opt=opt)`), read when the call leaves them out
        for value in (*(inner.__defaults__ or ()), *(inner.__kwdefaults__ or {}).values()):
            held = [value] if is_plain_object(value) and not callable(value) else \
                _held_objects(value)
            if held and log is not None:
                log.append(None)  # (`__defaults__` may be assigned)
            found += held
    return _unique(found)


def _unique(found: list[Any]) -> list[Any]:
    unique: dict[int, Any] = {}
    for value in found:
        unique.setdefault(id(value), value)
    return list(unique.values())


def _module_optimizers(value: Any, log: list | None = None) -> list[Any]:
    """The optimizers and LR schedulers a module holds as plain attributes (`self.opt`, as a
    model with its own training step keeps them): roots as if the function held them itself
    (else their first step's state, proxies, stayed in the real optimizer). Only these kinds:
    a module's other attributes (an HF config) are read as constants. `log`: as
    `function_roots`'s (the module and what it gave: `RootsMemo` asks again)."""
    if not isinstance(value, torch.nn.Module):
        return []
    kinds = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
    found = [item for item in vars(value).values() if isinstance(item, kinds)]
    if log is not None:
        log.append(("module", value, tuple(found)))
    return found


_HELD_ITEMS = 8  # the most items of a container whose objects `_held_objects` takes


def _held_objects(value: Any, depth: int = 0, log: list | None = None) -> list[Any]:
    """The plain, non-callable objects a list, tuple or dict read by a function holds as its
    items: an optimizer kept in `opts = [opt]` stores its first step's state into
    `opt.state` as one held directly does, so it is a root too (else the state made while
    tracing, proxies, stayed in the real optimizer after a call that ran eagerly); containers
    nested in them too, two levels deep. Only small containers (`_HELD_ITEMS`): a list of many
    records the function reads is data, each of them walked by every call's key otherwise.
    `log`: as `function_roots`'s (a container's items may change: not remembered)."""
    if isinstance(value, (list, tuple)):
        items = value
    elif type(value) is dict:
        items = list(value.values())
    else:
        return []
    if log is not None:
        log.append(None)
    if len(items) > _HELD_ITEMS:
        return []
    found = [item for item in items if is_plain_object(item) and not callable(item)]
    if depth < 1:
        for item in items:
            found += _held_objects(item, depth + 1)
    return found


def walk(root: Any) -> list[tuple[tuple, Any]]:
    """Every `(path, value)` reachable from `root` through attributes and containers (depth
    first, each container once, at most 6 levels deep). A path is a tuple of steps
    `("attr", name)`, `("item", index)`, `("key", key)`."""
    found: list[tuple[tuple, Any]] = []
    seen: set[int] = set()

    def visit(value, path):
        if len(found) >= _MAX_SLOTS or id(value) in seen or len(path) > _MAX_DEPTH:
            return
        seen.add(id(value))
        for step, child in _children(value):
            found.append(((*path, step), child))
            if _walkable(child):
                visit(child, (*path, step))

    visit(root, ())
    return found


def path_text(path: tuple) -> str:
    """`(("attr", "layers"), ("item", 0), ("attr", "keys"))` -> `.layers[0].keys`; a tensor
    key (an optimizer's `state[param]`) is shown by kind and shape, not by its values."""
    return "".join(f".{key}" if kind == "attr" else f"[{_key_text(key)}]" for kind, key in path)


def _key_text(key: Any) -> str:
    if isinstance(key, torch.Tensor):
        kind = "parameter" if isinstance(key, torch.nn.Parameter) else "tensor"
        return f"<{kind} {tuple(key.shape)} at {id(key):#x}>"
    return repr(key)


def float_in_tuple(root: Any, path: tuple) -> bool:
    """Whether the number at `path` inside `root` is an item of a plain tuple held by a list,
    dict or object (Adam's `param_groups[0]["betas"][0]`, which OneCycleLR changes): one read
    at run time is traced in a copy of the tuple stored in its place."""
    if len(path) < 2 or path[-1][0] != "item":
        return False
    owner, holder = follow(root, path[:-1]), follow(root, path[:-2])
    return type(owner) is tuple and not isinstance(holder, tuple)


def tuple_chain(root: Any, path: tuple) -> int | None:
    """For a tensor at `path` inside `root` whose owner is a tuple: the length `k` of the path
    to the outermost of the tuples nested in one another that end at its owner, held by a list,
    dict or object (xLSTM's cache state `rnn_state[layer]`, a tuple of tensors; a tuple of
    `(key, value)` pairs in a cache: two tuples). The tensor becomes an input, traced in a copy
    of those tuples stored at `path[:k]` (`rebuilt_tuples`) and read through the path on every
    call (a tensor kept from tracing would be another call's). None when the tuples reach
    `root` itself (nothing holds them to store a copy into)."""
    k = len(path) - 1
    while k > 0 and isinstance(follow(root, path[:k - 1]), tuple):
        k -= 1
    return k if k > 0 else None


def rebuilt_tuples(outer: tuple, steps: tuple, value: Any) -> tuple | None:
    """A copy of the nested tuples `outer` with the item at `steps` (item steps, one per
    level) replaced by `value`; a named tuple stays of its type. None if a tuple on the way is
    of a kind that cannot be rebuilt from its items."""
    index = steps[0][1]
    inner = value if len(steps) == 1 else rebuilt_tuples(outer[index], steps[1:], value)
    if inner is None:
        return None
    items = list(outer)
    items[index] = inner
    kind = type(outer)
    if kind is tuple:
        return tuple(items)
    make = getattr(kind, "_make", None)  # a named tuple
    return make(items) if callable(make) and hasattr(kind, "_fields") else None


def follow(root: Any, path: tuple) -> Any:
    """The value at `path` inside `root`."""
    for kind, key in path:
        root = getattr(root, key) if kind == "attr" else root[key]
    return root


def _store(owner: Any, step: tuple, value: Any) -> None:
    kind, key = step
    if kind == "attr":
        setattr(owner, key, value)
    else:
        owner[key] = value


def object_key(root: Any, leaf_key, masks: dict | None = None, walked: list | None = None
               ) -> tuple:
    """The cache key of an object argument: each walked path with its value's key (`leaf_key`
    for tensors and Python values; the type for containers, whose contents are walked).
    `masks` maps tensor paths to `masked_key(tensor)` for tensors with symbolic sizes, and
    the paths of integers traced as symbols to `INT_KEY` (an integer there is keyed by its type
    only). `walked`: `walk(root)`, where the caller has it (of `root` as it is now)."""
    parts = [type(root)]
    for path, value in walk(root) if walked is None else walked:
        if isinstance(value, torch.Tensor):
            grad = _grad_of(value)
            key = masks[path](value) if masks and path in masks and callable(masks[path]) \
                else leaf_key(value)
            parts.append((path, key, None if grad is None else leaf_key(grad)))
        else:
            if masks and path in masks and type(value) is int and masks[path] is INT_KEY:
                parts.append((path, INT_KEY))
            elif masks and path in masks and type(value) is float and masks[path] is FLOAT_KEY:
                parts.append((path, float_key(value)))
            else:
                parts.append((path, type(value) if _walkable(value) else leaf_key(value)))
    return tuple(parts)


def snapshot(container: Any) -> Any:
    """A shallow copy of what `container` holds: a list's items, a dict's entries, a plain
    object's attributes (None for anything else). The storage itself, not what a subclass's
    `__iter__`/`__getitem__` answer (HF's `ACT2FN` makes an instance per item read)."""
    if isinstance(container, list):
        return list.copy(container)
    if type(container) is dict:
        return dict(container)
    if isinstance(container, dict):  # (`dict.copy` of an OrderedDict reads its `__getitem__`)
        return {key: dict.__getitem__(container, key) for key in dict.keys(container)}
    if is_plain_object(container):
        return dict(vars(container))
    return None


def unchanged(container: Any, saved: Any) -> bool:
    """Whether `container` holds the very objects its `snapshot` recorded."""
    now = snapshot(container)
    if saved is None or now is None:
        return saved is now
    if isinstance(now, list):
        return len(now) == len(saved) and all(a is b for a, b in zip(now, saved))
    return now.keys() == saved.keys() and all(now[key] is saved[key] for key in now)


def restore(container: Any, saved: Any) -> None:
    """Put back what `snapshot(container)` recorded, in place."""
    if isinstance(container, list):
        container[:] = saved
    elif isinstance(container, dict):
        if unchanged(container, saved):
            return
        # dict's own methods: subclasses may refuse theirs (HF ModelOutput raises on `update`)
        dict.clear(container)
        dict.update(container, saved)
    elif saved is not None:
        state = vars(container)
        state.clear()
        state.update(saved)


_COPIED = object()  # `_copy_memo`: the value is a new container, copied with what it holds


def _copy_memo(template: Any, kept) -> dict[int, Any]:
    """The memo under which `copy.deepcopy(template, memo)` copies only the new containers of
    `template`, at every depth (a new cache layer inside a new list: its proxies are not
    copied): `kept(value)` gives what stands for a value that is not copied, or `_COPIED`."""
    memo: dict[int, Any] = {}

    def prepare(value, depth=0):
        if id(value) in memo or depth > _MAX_DEPTH + 2:
            return
        stand_in = kept(value)
        if stand_in is not _COPIED:
            memo[id(value)] = stand_in
            return
        for _, child in _children(value):
            prepare(child, depth + 1)

    prepare(template)
    return memo


@dataclass
class Epilogue:
    """Stores to replay after each call, and outputs to rebuild (see the module docstring).

    `stores`: `(root, path_to_owner, step, template)`; `outputs`: `(leaf_index, template)`;
    `names`: the proxies the templates hold, which the trace returns after the user's output;
    `existing`: id of each object that existed before the traced call -> `(root, path)`;
    `arguments`: id of each argument tensor and container (as traced) -> its path in the
    call's `(args, kwargs)` (`ArgumentContainers`), and `keep` the objects these ids belong to,
    so the ids stay theirs. `replaces_buffers`: a store replaces a buffer of the jitted module
    (`fulmen.tracer.module_stores`). `numbers`: the traced Python numbers (`torch.SymInt`,
    `SymFloat`, `SymBool`: symbolic sizes and integers, `fulmen.tracer.symbolic`) the templates
    hold, and `number_fn` their values for one call, computed from the call's inputs
    (`fulmen.tracer.symbolic.number_function`; NOTE [traced numbers in stores]).
    """

    stores: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    existing: dict = field(default_factory=dict)
    arguments: dict = field(default_factory=dict)
    keep: list = field(default_factory=list)
    replaces_buffers: bool = False
    numbers: list = field(default_factory=list)
    number_fn: Any = None

    def __bool__(self) -> bool:
        return bool(self.stores or self.outputs)

    def _materialize(self, template: Any, real: dict[str, Any], roots: dict[int, Any],
                     current: dict[int, Any], numbers: dict[int, Any]) -> Any:
        def kept(value):
            if id(value) in numbers:  # a traced number: its value in this call
                return numbers[id(value)]
            if id(value) in current:  # an argument's tensor or container, found before any store
                return current[id(value)]
            if id(value) in self.existing:  # the current call's object
                root, path = self.existing[id(value)]
                return follow(roots[root], path) if path else roots[root]
            if isinstance(value, (TensorProxy, FloatProxy)):
                return real[value.name]
            if isinstance(value, _OPAQUE) or not _walkable(value):
                return value  # shared, never copied
            return _COPIED

        return copy.deepcopy(template, _copy_memo(template, kept))

    def run(self, out_leaves: list, extras, roots: dict[int, Any], inputs=()) -> None:
        """Replay the stores into the call's objects and rebuild the objects among the output
        leaves (in place in `out_leaves`); `inputs` are the compiled call's (`numbers`)."""
        real = dict(zip(self.names, extras))
        current = {key: follow(roots[ARGUMENTS], steps) for key, steps in self.arguments.items()}
        numbers = {} if self.number_fn is None else dict(
            zip(map(id, self.numbers), self.number_fn(*inputs)))
        for root, path, step, template in self.stores:
            owner = follow(roots[root], path)
            if step is None and isinstance(owner, dict):  # an argument dict changed in place
                new = self._materialize(template, real, roots, current, numbers)
                dict.clear(owner)
                dict.update(owner, new)
            elif step is None:  # a list changed in place
                owner[:] = self._materialize(template, real, roots, current, numbers)
            else:
                kind, key = step
                if isinstance(key, TensorProxy):  # a new entry keyed by an input tensor
                    key = real[key.name]
                _store(owner, (kind, key), self._materialize(template, real, roots, current, numbers))
        for index, template in self.outputs:
            out_leaves[index] = self._materialize(template, real, roots, current, numbers)
