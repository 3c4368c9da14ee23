"""Cache keys: what a trace was specialised on.

A trace is valid for another call when the key of that call equals the key it was traced under.
The key covers the input tree's structure; for each tensor its shape, dtype, device,
requires_grad and strides (and its storage offset where a program read it); the values of Python scalars and other
constants; grad mode, autocast state and the default dtype; and, for modules, the `training`
flag of every submodule.

Computing the key is the whole cost of a cache hit besides the call itself, so the common case
(positional tensor arguments, no kwargs) avoids pytree flattening.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import operator
import types
from collections.abc import Hashable
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen.core import RunsEagerly
from fulmen.core.ambient import autocast_key
from fulmen.proxies import TensorProxy
from fulmen.tracer.key_memo import (
    HashedKey,
    KeyMemo,
    TensorKeyMemo,
    holder_snapshot,
    typed_snapshot,
)
from fulmen.tracer.objects import (
    FLOAT_KEY,
    INT_KEY,
    function_roots,
    has_argument_grad,
    is_plain_object,
    object_key,
    restore,
    snapshot,
    unchanged,
    walk,
)
from fulmen.tracer.source_reads import source_reader
from fulmen.tracer.sources import (
    ATOMS,
    CONTAINERS,
    FUNCTIONS,
    HOOK_LABEL,
    NUMPY_ARRAYS,
    NUMPY_SCALARS,
    SCALARS,
    array_key,
    functions_of,
    is_user_class,
    reads_cell,
    reads_global,
    scalar_sources,
)
from fulmen.tracer.symbolic import INT, STRIDES

Tensor = torch.Tensor
_is_grad_enabled = torch.is_grad_enabled
_get_default_dtype = torch.get_default_dtype
_any_autocast = torch._C._is_any_autocast_enabled
_training = operator.attrgetter("training")


def _tensor_key(t: Tensor) -> tuple:
    # the strides, not only contiguity: code reads `x.stride(0)` and
    # `is_contiguous(memory_format=...)`, and in-place updates of views depend on them
    return (t.shape, t.dtype, t.device, t.requires_grad, t.stride())


class StateRemoved(Exception):
    """A parameter or buffer the compiled calls read was set to None in place (`m.bias = None`
    replaces no dict entry, so `StructureWatch`'s O(1) check cannot see it)."""


def _state_key(t: Tensor) -> tuple:
    if t is None:
        raise StateRemoved
    return _tensor_key(t)


def _argument_tensor_key(t: Tensor) -> tuple:
    key = _tensor_key(t)
    return (*key, _tensor_key(t.grad)) if has_argument_grad(t) else key


def _object_tensor_key(t: Tensor) -> tuple:
    return (*_tensor_key(t), t.storage_offset())


def _float_key(value: float) -> Any:
    """NaN equals itself, and -0.0 differs from 0.0 (`x * math.copysign(1, s)` bakes the sign
    in), though Python's `==` says otherwise for both."""
    if value != value:
        return "nan"
    if value == 0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    return value


# leaves keyed by their type and value (`_leaf_key`'s last case), found by their exact type
_BY_VALUE = frozenset([bool, int, str, type(None), torch.device, torch.dtype])


def _leaf_key(leaf: Any) -> Any:
    if type(leaf) in _BY_VALUE:  # (what the last case below gives them, without the tests)
        return (type(leaf), leaf)
    if isinstance(leaf, Tensor):
        return _argument_tensor_key(leaf)
    if isinstance(leaf, float):
        return (type(leaf), _float_key(leaf))
    if isinstance(leaf, NUMPY_SCALARS):  # by value (a NaN too, as floats), and by type
        return (type(leaf), _leaf_key(leaf.item()))
    if isinstance(leaf, NUMPY_ARRAYS):
        return array_key(leaf)
    if isinstance(leaf, complex):
        return (complex, _float_key(leaf.real), _float_key(leaf.imag))
    if is_plain_object(leaf):  # its tensors are inputs, the rest of what it holds is guarded
        return object_key(leaf, _object_leaf_key)
    if isinstance(leaf, Hashable):
        try:
            return (type(leaf), leaf)
        except TypeError:
            pass
    return (type(leaf), id(leaf))


def _is_object_leaf(leaf: Any) -> bool:
    """Whether `_leaf_key` keys `leaf` as an object argument (`object_key`)."""
    return type(leaf) not in _BY_VALUE and not isinstance(
        leaf, (Tensor, float, complex, *NUMPY_SCALARS)) and is_plain_object(leaf)


def _float_masks(positions) -> dict[int, dict]:
    """Object root -> {path: FLOAT_KEY} for the floats read at run time at `positions`."""
    masks: dict[int, dict] = {}
    for position in positions:
        if isinstance(position, tuple):
            masks.setdefault(position[0], {})[position[1]] = FLOAT_KEY
    return masks


def _mask_floats(leaves: list, leaf_keys: list, positions, walks: dict) -> None:
    """Key the floats read at run time (`positions`) among a call's leaves by their type."""
    for root, paths in _float_masks(positions).items():
        if 0 <= root < len(leaves) and is_plain_object(leaves[root]):
            leaf_keys[root] = object_key(leaves[root], _object_leaf_key, paths, walks.get(root))
    for position in positions:
        if type(position) is int and position < len(leaves) and type(leaves[position]) is float:
            leaf_keys[position] = FLOAT_KEY


def _walked_key(leaf: Any, walks: dict[int, list], position: int) -> tuple:
    """`_leaf_key` of an object argument, keeping its walk in `walks` for the masked key of
    the same call (`CacheKeyBuilder.key`)."""
    walked = walks[position] = walk(leaf)
    return object_key(leaf, _object_leaf_key, walked=walked)


def _masked_key(t: Tensor, dims: tuple) -> tuple:
    """The key of a tensor whose sizes in `dims` are symbolic: those sizes left out (the entry's
    shape guard checks them), contiguity instead of strides (left out too where `dims` ends
    with `STRIDES`: the strides have symbols of their own, checked by the shape guard);
    whether it has a `.grad`, as `_argument_tensor_key` says."""
    shape = list(t.shape)
    free = dims[-1] == STRIDES
    if free:
        dims = dims[:-1]
    if any(d >= len(shape) for d in dims):
        return ("symbolic", "rank", len(shape))
    for dim in dims:
        shape[dim] = None
    return ("symbolic", tuple(shape), t.dtype, t.device, t.requires_grad,
            None if free else t.is_contiguous(), has_argument_grad(t))


def _object_leaf_key(leaf: Any) -> Any:
    return _object_tensor_key(leaf) if isinstance(leaf, Tensor) else _leaf_key(leaf)


# argument types pytree treats as leaves, exactly (subclasses may be registered as nodes)
_FLAT_LEAVES = frozenset([Tensor, torch.nn.Parameter, bool, int, float, str, type(None)])


def _pytree_leaf(value: Any) -> bool:
    """Whether pytree treats `value` as a leaf: its exact type is no registered node, and it is
    no tuple (every namedtuple is a node). An object argument (a KV cache) is one."""
    return type(value) not in pytree.SUPPORTED_NODES and not isinstance(value, tuple)


_EXACT_SCALARS = frozenset([bool, int, str, type(None)])
_MAX_ITEMS = 64  # containers longer than this are keyed by their length only
_NESTED_DEPTH = 2  # levels of containers inside a container keyed by their items


def source_key(value: Any) -> Any:
    """The key of a value read from a global, a closure cell or a module attribute: scalars by
    value; tensors by identity (the program captured that tensor object: its in-place updates
    are seen, a new tensor bound to the name is not; the entry keeps the old one alive, so the
    id cannot be reused while it matters); lists, tuples and dicts by their items, one level
    deep (`CONFIG["scale"]`, `self.sizes[0]`)."""
    kind = type(value)
    if kind in _EXACT_SCALARS:  # the common case, without `_leaf_key`'s isinstance chain
        return (kind, value)
    if kind is float:
        return (float, _float_key(value))
    if isinstance(value, Tensor):
        return ("tensor", id(value))
    if isinstance(value, FUNCTIONS):  # held in the key: its id cannot be reused meanwhile
        try:
            return ("function", value, hash(value))
        except TypeError:  # a method of an unhashable object
            return ("function", id(value.__self__), value.__func__)
    if kind in CONTAINERS:
        if len(value) > _MAX_ITEMS:
            return (kind, len(value))
        items = value.items() if kind is dict else enumerate(value)
        return (kind, tuple([(k, _item_key(v)) for k, v in items]))
    return _leaf_key(value)


def _written_key(value: Any) -> Any:
    """The key of a module attribute that compiled programs store traced tensors into and never
    read as a tensor (`self.aux_loss = loss`): tensors by metadata, not identity (each call
    stores a new one), so Python that reads `self.aux_loss is None` or its shape is still
    guarded; containers one level deep."""
    if isinstance(value, Tensor):
        return ("tensor", _tensor_key(value))
    if type(value) in CONTAINERS and len(value) <= _MAX_ITEMS:
        items = value.items() if type(value) is dict else enumerate(value)
        return (type(value), tuple([(k, ("tensor", _tensor_key(v)) if isinstance(v, Tensor)
                                     else _item_key(v)) for k, v in items]))
    return source_key(value)


def _tensors_in(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if type(value) in CONTAINERS:
        return [v for v in (value.values() if type(value) is dict else value)
                if isinstance(v, Tensor)]
    return []


_MAX_ATTRIBUTES = 512


def class_source_key(cls: type) -> Any:
    """The key of a user class the code reads (`CFG.lr`, `self.scale` from the module's class):
    the class and its data attributes (numbers, strings, tensors, containers), as
    `object_source_key` keys a plain object's."""
    return (cls, tuple([(k, _item_key(v)) for k, v in vars(cls).items()
                        if not k.startswith("__") and _is_data(v)]))


def _is_data(value: Any) -> bool:
    return isinstance(value, (*SCALARS, Tensor)) or type(value) in CONTAINERS


def changed_classes(before: list[tuple[type, dict]]) -> list[type]:
    """The classes among `(class, dict(vars(class)))` snapshots whose attributes were stored
    or deleted since (compared by identity)."""
    return [cls for cls, saved in before if len(vars(cls)) != len(saved) or any(
        vars(cls).get(k, before) is not v for k, v in saved.items())]


def restore_classes(before: list[tuple[type, dict]]) -> None:
    """Put the classes of `changed_classes` snapshots back as they were."""
    for cls, saved in before:
        for k in [k for k in vars(cls) if k not in saved]:
            delattr(cls, k)
        for k, v in saved.items():
            if vars(cls).get(k, before) is not v:
                setattr(cls, k, v)


def object_source_key(value: Any) -> Any:
    """The key of a plain object a module holds (`self.config`): its type and its attributes,
    as `source_key` keys a dict's items; containers and data objects inside a data object
    (`_is_data_object`: a config) by their items too, inside another object (a logger, whose
    `_cache` fills as it is used) by identity."""
    state = vars(value)
    if len(state) > _MAX_ATTRIBUTES:
        return (type(value), id(value), len(state))
    depth = _NESTED_DEPTH if _is_data_object(value) else 0
    return (type(value), tuple([(k, _item_key(v, depth)) for k, v in state.items()]))


_DATA_OBJECTS = (types.SimpleNamespace, argparse.Namespace)


def _is_data_object(value: Any) -> bool:
    """A configuration object whose attributes `_item_key` keys when it is nested in a keyed
    value (`CFG.attention.dropout`): a dataclass, a namespace, an instance of a user class. Not
    any object with a `__dict__`: a logger nested in a config would key every logger."""
    return (type(value) in _DATA_OBJECTS or dataclasses.is_dataclass(value)
            and not isinstance(value, type)) or (
        is_user_class(type(value)) and is_plain_object(value))


def _nested_items(value: Any, depth: int) -> Any:
    """The items `_item_key` keys inside `value` (a container or data object), or None when it
    keys `value` by identity (too deep, too many)."""
    if depth <= 0:
        return None
    if type(value) in CONTAINERS:
        return value if len(value) <= _MAX_ITEMS else None
    if _is_data_object(value):
        state = vars(value)
        return state if len(state) <= _MAX_ATTRIBUTES else None
    return None


def _container_snapshots(value: Any, depth: int = _NESTED_DEPTH) -> list[tuple]:
    """Snapshots (`KeyMemo`) of a container or plain object and of the containers and data
    objects `_item_key` keys by their items inside it, so that changing a nested one recomputes
    the key."""
    snapshots = [holder_snapshot(value)]
    if type(value) in CONTAINERS:
        items = value if len(value) <= _MAX_ITEMS else ()  # (longer: keyed by length only)
    else:
        items = vars(value) if len(vars(value)) <= _MAX_ATTRIBUTES else ()
    if depth > 0:
        for item in (items.values() if isinstance(items, dict) else items):
            if _nested_items(item, depth) is not None:
                snapshots += _container_snapshots(item, depth - 1)
    return snapshots


def _collect_holders(value: Any, found: dict[int, Any], depth: int) -> None:
    if id(value) in found or not (type(value) in (list, dict) or is_plain_object(value)):
        return
    found[id(value)] = value
    items = snapshot(value)
    if depth > 0 and items is not None and len(items) <= _MAX_ITEMS:
        for item in (items.values() if isinstance(items, dict) else items):
            _collect_holders(item, found, depth - 1)


class GlobalStore(RunsEagerly):
    """The traced code stores a traced tensor into a global or a closure variable, or into a
    container or object held by one (`STATS["loss"] = loss`, `nonlocal last; last = y`):
    a compiled call would leave a proxy there, so the call runs eagerly (and what it stored
    into is put back as it was before tracing)."""


def stored_proxies(snapshots: list[tuple[Any, Any]]) -> list[str]:
    """Put back the holders and names of `global_snapshots` that now hold a proxy; return
    what each was ("the global name 'LAST'", "a global dict"). Where one does, the call runs
    eagerly, which makes the trace's other stores again: every holder is put back then
    (`counter[0] += 1; feats.append(y)` would count twice)."""
    leaked = []
    changed = []
    for holder, saved in snapshots:
        if type(holder) is tuple:  # (a module's globals, a name) or (a closure cell, None)
            now = _bound(holder)
            if isinstance(now, TensorProxy):
                leaked.append("a variable of an enclosing function" if holder[1] is None
                              else f"the global name {holder[1]!r}")
            if now is not saved:
                changed.append((holder, saved))
            continue
        if unchanged(holder, saved):
            continue
        now = snapshot(holder)
        if any(isinstance(item, TensorProxy)
               for item in (now.values() if isinstance(now, dict) else now)):
            restore(holder, saved)
            leaked.append(f"a global {type(holder).__name__}")
        else:
            changed.append((holder, saved))
    for holder, saved in changed if leaked else ():
        if type(holder) is not tuple:
            restore(holder, saved)
        elif holder[1] is None:
            holder[0].cell_contents = saved
        else:
            holder[0][holder[1]] = saved
    return leaked


def _bound(binding: tuple) -> Any:
    owner, name = binding
    return owner.cell_contents if name is None else owner.get(name)


def _item_key(value: Any, depth: int = _NESTED_DEPTH) -> Any:
    """The key of an item of a container `source_key` reads: as `source_key`'s for scalars and
    tensors; nested containers by their items too, `depth` more levels (`CFG["model"]["act"]`
    changed in place), then by identity."""
    kind = type(value)
    if kind in _EXACT_SCALARS:
        return (kind, value)
    if isinstance(value, Tensor):
        return ("tensor", id(value))
    if isinstance(value, (*SCALARS, *NUMPY_ARRAYS)):
        return _leaf_key(value)
    items = _nested_items(value, depth)
    if items is not None:
        items = items.items() if isinstance(items, dict) else enumerate(items)
        return (kind, tuple([(k, _item_key(v, depth - 1)) for k, v in items]))
    return (type(value), id(value))


_MAX_HELD_MODULES = 4096  # a bound on the modules whose flags the key covers (`add_modules`)
_MAX_ARGUMENT_CODE = 4096  # ... on the arguments' functions and classes scanned (`add_functions`)


class CacheKeyBuilder:
    """Builds the cache key of a call; `modules` are the submodules whose `training` is guarded.

    `key(args, kwargs, state)` returns `(key, flat_leaves)`; `flat_leaves` is the flattened
    `(args, kwargs)` the runtime takes tensor inputs from; `state` are the module's current
    parameters and buffers (their shapes, dtypes, devices, strides and requires_grad flags are
    guarded).
    """

    def __init__(self, modules: tuple[torch.nn.Module, ...] = (), fn=None) -> None:
        self.modules = modules
        self._source_fn = fn
        self._argument_functions: list = []  # `add_functions`
        # module attributes `(module, name)` stored by a call (`watch_attributes`); those
        # (`(id(module), name)`) that programs store traced tensors into and never read as
        # tensors are written (`_written_key`), those a program read are never written again
        self._watched: list[tuple[torch.nn.Module, str]] = []
        self._written: set[tuple[int, str]] = set()
        self._read: set[tuple[int, str]] = set()
        self._fresh: set[tuple[int, str]] = set()  # tensor attributes programs read afresh
        self._stale = False  # the keying changed since `take_stale`
        self._last_parts: tuple = ((), ())  # the last call's global and state keys
        self._last_leaf_keys: tuple | None = None  # ... and its tree spec and static leaf keys
        self._walks: dict[int, list] = {}  # ... and the walks of its object arguments
        self._set_sources()
        self._state_memo = TensorKeyMemo(_state_key)  # parameters and buffers
        # a jitted bound method reads its object, a wrapper the objects it closes over (found
        # again on every call: closure cells change)
        inner = getattr(fn, "__func__", fn)
        reads_objects = getattr(fn, "__self__", None) is not None or bool(
            getattr(inner, "__closure__", None))
        self.fn = fn if fn is not None and not modules and reads_objects else None
        self.fn_roots: list = []
        # positions of the floats read at run time (`DynamicDims.float_positions`, the same
        # set): keyed by their type, not their value
        self.float_positions: set = set()
        # flattened-argument positions whose storage offsets a compiled program read (-1: the
        # module's parameters and buffers); `guard_offsets` adds them as traces reveal them
        self.offset_positions: frozenset[int] = frozenset()

    def guard_offsets(self, positions: frozenset[int]) -> bool:
        """Key the storage offsets at `positions` from now on; whether that is new."""
        if positions <= self.offset_positions:
            return False
        self.offset_positions |= positions
        return True

    def _set_sources(self) -> None:
        """(Re)collect the values read besides the arguments (`scalar_sources`); the modules'
        attribute counts tell when one was added (`global_key`)."""
        self.scalar_sources = scalar_sources(self._source_fn, self.modules,
                                             self._argument_functions)
        for module, name in self._watched:
            self.scalar_sources.append((f"{type(module).__name__}.{name}",
                                        functools.partial(getattr, module, name, None)))
        values = [read() for _, read in self.scalar_sources]
        # per source, the type of the plain object it held (keyed by its attributes), or None
        self._object_types = [type(value) if is_plain_object(value) else None
                              for value in values]
        # the functions held (`layer.forward = patched`, `self.act = my_act`): another one
        # reads other globals and closure cells (`functions_swapped`)
        self._functions = [(read, value) for (_, read), value in zip(self.scalar_sources, values)
                           if isinstance(value, FUNCTIONS)]
        self._sources_memo = KeyMemo()
        # module attributes among the sources: (id(module), name) -> source index
        self._attributes = {(id(read.args[0]), read.args[1]): index for index, (_, read)
                            in enumerate(self.scalar_sources)
                            if isinstance(getattr(read, "args", (None,))[0], torch.nn.Module)}
        self.written = frozenset(index for attribute, index in self._attributes.items()
                                 if attribute in self._written)
        self._class_sources = frozenset(index for index, (_, read) in
                                        enumerate(self.scalar_sources)
                                        if is_user_class(read()))
        self._module_dicts = [vars(module) for module in self.modules]
        self._attribute_counts = tuple(map(len, self._module_dicts))
        self._read_sources = source_reader(self.modules, self.scalar_sources)

    def note_module_writes(self, writes: frozenset, captured: tuple, fresh: bool) -> None:
        """After a trace: `writes` are the `(id(module), attribute)` it stored traced tensors
        into, `captured` the real tensors it read; `fresh`: its program reads a module's tensor
        attribute afresh on each call (`captured_attributes`), else it keeps the tensor it
        captured. Attributes only written or read afresh are keyed by metadata; one whose
        tensor a program keeps, by identity from then on. When that changes the keying, keys
        computed before are stale (`take_stale`)."""
        if not self._attributes:
            return
        ids = {id(t) for t in captured}
        for attribute, index in self._attributes.items():
            value = self.scalar_sources[index][1]()
            if ids and type(value) is Tensor and fresh and id(value) in ids:
                self._fresh.add(attribute)
            elif ids and any(id(t) in ids for t in _tensors_in(value)):
                self._read.add(attribute)
        written = (self._written | self._fresh | writes) - self._read
        if written != self._written:
            self._written = written
            self._set_sources()
            self._stale = True

    def add_modules(self, modules: tuple[torch.nn.Module, ...]) -> None:
        """Key the `training` flags and attributes of `modules` and their submodules from now
        on (modules a trace reached besides the jitted one: `step(model, batch)`'s `model`, a
        global; `model.eval()` or `model.temperature = 0.5` between calls then retraces);
        keys computed before are stale. At most `_MAX_HELD_MODULES` are added."""
        known = {id(module) for module in self.modules}
        new = [sub for module in modules for sub in module.modules() if id(sub) not in known]
        new = list({id(sub): sub for sub in new}.values())
        if not new or len(self.modules) >= _MAX_HELD_MODULES:
            return
        self.modules = (*self.modules, *new[:_MAX_HELD_MODULES - len(self.modules)])
        self._set_sources()
        self._stale = True

    def add_functions(self, leaves: list) -> None:
        """Key, from now on, the globals read by the functions among a traced call's argument
        leaves (`apply(x, act_fn)`: the function is keyed by identity, and `act_fn` reading a
        global `ALPHA` baked its value into the trace) and by the methods of its object
        arguments, and the class attributes of those objects' user classes (`opts.SCALE` from
        `class Opts`); keys computed before are stale."""
        known = {id(function) for function in self._argument_functions}
        new = [function for leaf in leaves if not isinstance(leaf, (Tensor, *SCALARS))
               for function in functions_of(leaf) if id(function) not in known]
        new += [type(leaf) for leaf in leaves if is_plain_object(leaf)
                and is_user_class(type(leaf)) and id(type(leaf)) not in known]
        if new and len(self._argument_functions) < _MAX_ARGUMENT_CODE:
            self._argument_functions += list({id(f): f for f in new}.values())
            self._set_sources()
            self._stale = True

    def functions_swapped(self) -> None:
        """Collect the sources again where a function a source held was replaced by another
        (`layer.forward = patched` twice, `self.act = my_act`): the new one's globals and
        closure cells become sources (called on a cache miss, before tracing)."""
        if any(read() is not value for read, value in self._functions):
            self._set_sources()
            self._stale = True

    def hooks_changed(self) -> None:
        """Collect the sources again: the modules' forward hooks changed, and what the hooks
        read (their globals and closure cells, `scalar_sources`) is read by the programs."""
        self._set_sources()
        self._stale = True

    def watch_attributes(self, pairs: list[tuple[torch.nn.Module, str]]) -> None:
        """Key the module attributes `(module, name)` from now on (ones a call stored, which
        may not have existed when the key was set up); keys computed before are stale."""
        self._watched += [(module, name) for module, name in pairs
                          if (id(module), name) not in self._attributes]
        self._set_sources()
        self._stale = True

    def global_snapshots(self) -> list[tuple[Any, Any]]:
        """`(holder, snapshot)` of the globals and closure variables the code reads (as
        `(namespace, name)` and `(cell, None)` with their values) and of the lists, dicts and
        plain objects they hold (and those nested in them, `_NESTED_DEPTH` levels): a trace that
        stores a traced tensor into one (`STATS["loss"] = loss`, `LOG.append(y)`) would leave a
        proxy there (`stored_proxies`)."""
        found: dict[int, Any] = {}
        bindings = []  # `global LAST; LAST = y` rebinds the name itself
        for name, read in self.scalar_sources:
            # `global LAST; LAST = y`; `nonlocal last; last = y`, `holder["y"] = y`
            cell = reads_cell(read)
            binding = (cell, None) if cell is not None else reads_global(read)
            if binding is not None:
                value = read()
                bindings.append((binding, value))
                _collect_holders(value, found, _NESTED_DEPTH)
            elif name.startswith(HOOK_LABEL):  # a hook's object or default arguments
                value = read()
                for item in value if type(value) is tuple else (value,):
                    _collect_holders(item, found, _NESTED_DEPTH)
        return bindings + [(holder, snapshot(holder)) for holder in found.values()]

    def class_snapshots(self) -> list[tuple[type, dict]]:
        """The user classes the code may read, with their attributes (`changed_classes`)."""
        classes = {id(value): value for value in (self.scalar_sources[index][1]()
                                                  for index in self._class_sources)
                   if isinstance(value, type)}
        return [(cls, dict(vars(cls))) for cls in classes.values()]

    def take_stale(self) -> bool:
        """Whether keys computed before the last trace are stale (`note_module_writes`)."""
        stale, self._stale = self._stale, False
        return stale

    def global_key(self) -> tuple:
        """Grad mode, default dtype, autocast state, module training flags, and the Python
        scalars the code can read besides its arguments (see `scalar_sources`)."""
        return (
            _is_grad_enabled(),
            _get_default_dtype(),
            _any_autocast() and autocast_key(),  # devices and dtypes: bf16 != f16 regions
            self._sources_key(),
            self._fn_roots_key(),
        )

    def _source_values(self) -> list:
        """`[m.training for m in self.modules]` and the value of each source, read by one
        generated function (`source_reader`). A module that gained, lost or swapped attributes
        (`model.temperature = 0.5` after jitting, read by `getattr(self, "temperature", 1.0)`):
        the sources are collected again first. (A module whose `__dict__` is replaced as a
        whole is not followed, here or by `state_slots`.)"""
        if tuple(map(len, self._module_dicts)) == self._attribute_counts:
            values = self._read_sources()
            if values is not None:
                return values
        self._set_sources()
        values = self._read_sources()
        if values is None:  # (cannot be: the reader was made from these very dicts)
            values = [*map(_training, self.modules), *[read() for _, read in
                                                       self.scalar_sources]]
        return values

    def _sources_key(self) -> HashedKey:
        """The key of the modules' training flags and of the sources' values, reused while
        nothing it was computed from changed (`KeyMemo`)."""
        values = self._source_values()
        memo = self._sources_memo.lookup(values)  # nothing they hold changed: the same key
        if memo is not None:
            return memo
        count = len(self.modules)
        flags = tuple(values[:count])
        keys, objects = [], {}  # a config object many modules hold is keyed once
        snapshots: list[tuple] | None = []  # what the key read, for the memo (None: more)
        written = self.written
        for index, (value, object_type) in enumerate(zip(values[count:],
                                                         self._object_types)):
            kind = type(value)
            if index in self._class_sources and isinstance(value, type):
                keys.append(class_source_key(value))
                if snapshots is not None:
                    snapshots.append(holder_snapshot(value))
            elif written and index in written:
                keys.append(_written_key(value))
                if kind in CONTAINERS and snapshots is not None:
                    snapshots.append(holder_snapshot(value))
            elif kind in _EXACT_SCALARS:
                keys.append((kind, value))
            elif kind is object_type:  # (isinstance on an HF config is slow: type is exact)
                key = objects.get(id(value))
                if key is None:
                    key = objects[id(value)] = object_source_key(value)
                    if snapshots is not None:
                        snapshots += _container_snapshots(
                            value, _NESTED_DEPTH if _is_data_object(value) else 0)
                keys.append(key)
            elif object_type is not None:  # an object attribute rebound to something else
                keys.append((kind, id(value)))
                if snapshots is not None:
                    snapshots.append(typed_snapshot(value))
            else:
                keys.append(source_key(value))
                if kind in CONTAINERS:
                    if snapshots is not None:
                        snapshots += _container_snapshots(value)
                elif kind is not float and not isinstance(value, (Tensor, *FUNCTIONS, *ATOMS)):
                    snapshots = None  # keyed by `_leaf_key`, which may look deeper
        key = HashedKey((flags, tuple(keys)))
        self._sources_memo.store(values, key, snapshots)
        return key

    def forget_walks(self) -> None:
        """Let go of the last call's object walks (they hold its tensors alive): called once
        no symbolic lookup of the same call (`key(same_call=True)`) follows."""
        self._walks = {}

    def _fn_roots_key(self) -> tuple:
        if self.fn is None:
            return ()
        self.fn_roots = function_roots(self.fn)
        masks = _float_masks(self.float_positions) if self.float_positions else {}
        return tuple([object_key(root, _leaf_key, masks.get(-1 - i))
                      for i, root in enumerate(self.fn_roots)])

    def key(self, args: tuple, kwargs: dict, state: list[Tensor] | tuple = (),
            symbolic: dict[int, tuple[int, ...]] | None = None,
            same_call: bool = False, leaves: list | None = None) -> tuple[tuple, list]:
        """The key of a call; with `symbolic` (argument position -> dimensions with symbolic
        sizes), those sizes are left out (the entry's shape guard checks them) and those
        tensors are keyed by contiguity, not strides (an integer traced as a symbol, `INT`,
        by its type). `same_call`: the previous `key` was of
        this very call, so its global and state parts are reused, and (given the `leaves` it
        returned) the keys of the leaves whose sizes are all static."""
        offsets = self.offset_positions
        if same_call:
            global_key, state_key = self._last_parts
        else:
            global_key = self.global_key()
            # parameters and buffers by their metadata: `model.half()` or a parameter assigned
            # in place of another changes dtypes/shapes behind the same slots
            state_key = self._state_memo.key(state) if state else ()
            if offsets and -1 in offsets:
                state_key = (state_key, tuple([t.storage_offset() for t in state]))
            self._last_parts = (global_key, state_key)
            self._last_leaf_keys = None
        if not kwargs and not offsets:
            tensor_keys = [_argument_tensor_key(a) for a in args if type(a) is Tensor]
            if len(tensor_keys) == len(args):  # fast path: positional plain tensors
                if symbolic:
                    if not all(type(p) is int and p < len(args) for p in symbolic):
                        return (), args
                    for position, dims in symbolic.items():
                        tensor_keys[position] = _masked_key(args[position], dims)
                return (len(args), global_key, state_key, *tensor_keys), args
        if same_call and leaves is not None and self._last_leaf_keys is not None:
            # the static key of this very call flattened it and keyed every leaf: only the
            # symbolic positions below are keyed anew (an object argument's walk is the cost)
            spec, leaf_keys = self._last_leaf_keys
            leaf_keys = list(leaf_keys)
        else:
            if all([type(value) in _FLAT_LEAVES or _pytree_leaf(value)
                    for value in (*args, *kwargs.values())]):
                # no containers among the arguments: the leaves are the arguments, in
                # pytree's order (positional, then keywords in call order), unflattened
                leaves, spec = [*args, *kwargs.values()], ("flat", len(args), tuple(kwargs))
            else:
                leaves, spec = pytree.tree_flatten((args, kwargs))
            self._walks = walks = {}  # object argument position -> its walk (`forget_walks`)
            leaf_keys = [_object_leaf_key(leaf) if i in offsets else
                         _walked_key(leaf, walks, i) if _is_object_leaf(leaf) else
                         _leaf_key(leaf) for i, leaf in enumerate(leaves)]
            if self.float_positions:
                _mask_floats(leaves, leaf_keys, self.float_positions, self._walks)
            # (keys only: they name types, sizes and ids, and hold no tensor alive)
            self._last_leaf_keys = None if symbolic else (spec, tuple(leaf_keys))
        # object arguments: tensor path -> its masked key (and floats read at run time)
        masks: dict[int, dict] = {}
        floats = _float_masks(self.float_positions) if self.float_positions else {}
        for position, dims in (symbolic or {}).items():
            if isinstance(position, tuple):  # (object argument, path) of a tensor inside it
                root, path = position
                if root >= len(leaves) or not is_plain_object(leaves[root]):
                    return (), leaves
                masks.setdefault(root, dict(floats.get(root, {})))[path] = INT_KEY \
                    if dims == INT else \
                    functools.partial(_masked_key, dims=dims)
                continue
            leaf = leaves[position] if position < len(leaves) else None
            if dims == INT and type(leaf) is int:  # an integer argument traced as a symbol
                leaf_keys[position] = INT_KEY
                continue
            if not isinstance(leaf, Tensor) or dims == INT:
                return (), leaves  # a structure no symbolic entry was made for
            leaf_keys[position] = _masked_key(leaf, dims)
        for root, paths in masks.items():
            leaf_keys[root] = object_key(leaves[root], _object_leaf_key, paths,
                                         self._walks.get(root) if same_call else None)
        return (spec, global_key, state_key, tuple(leaf_keys)), leaves
