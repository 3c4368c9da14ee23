"""Cache keys: what a trace was specialised on.

A trace is valid for another call when the key of that call equals the key it was traced under.
The key covers the input tree's structure; for each tensor its shape, dtype, device,
requires_grad and strides (and its storage offset where a program read it); the values of Python scalars and other
constants; the process-wide state traced code may read (grad mode, autocast, default dtype and
device, matmul precision, ...: `process_state.PROCESS_STATES`) and the environment variables it
looked up (`environment.py`); the autograd flags of real tensors traced code read
(`flag_reads.py`); and, for modules, the `training` flag of every submodule.

Computing the key is the whole cost of a cache hit besides the call itself, so the common case
(positional tensor arguments, no kwargs) avoids pytree flattening.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen.tracer.environment import environment_source
from fulmen.tracer.flag_reads import FlagReads
from fulmen.tracer.key_memo import (
    ArgumentKeyMemo,
    HashedKey,
    KeyMemo,
    RootsMemo,
    TensorKeyMemo,
    holder_snapshot,
    reads_unbound_globals,
    typed_snapshot,
)
from fulmen.tracer.leaf_keys import (
    _FLAT_LEAVES,
    _argument_tensor_key,
    _float_masks,
    _is_object_leaf,
    _leaf_key,
    _mask_floats,
    _masked_key,
    _object_leaf_key,
    _pytree_leaf,
    _state_key,
    _walked_key,
    mark_repeated,
)
from fulmen.tracer.object_key_memo import ObjectKeyMemo
from fulmen.tracer.objects import (
    INT_KEY,
    function_roots,
    is_plain_object,
    object_key,
    snapshot,
)
from fulmen.tracer.process_state import process_state_key
from fulmen.tracer.source_keys import (
    _EXACT_SCALARS,
    _NESTED_DEPTH,
    _collect_holders,
    _container_snapshots,
    _is_data_object,
    _tensors_in,
    _written_key,
    class_source_key,
    object_source_key,
    source_key,
)
from fulmen.tracer.source_reads import source_reader, training_of
from fulmen.tracer.sources import (
    ATOMS,
    CONTAINERS,
    DEFAULTS_LABEL,
    FUNCTIONS,
    HOOK_LABEL,
    SCALARS,
    functions_of,
    is_user_class,
    reads_cell,
    reads_global,
    scalar_sources,
)
from fulmen.tracer.symbolic import INT

Tensor = torch.Tensor


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
        self._environment: set[str] = set()  # variables programs read (`watch_environment`)
        self._written: set[tuple[int, str]] = set()
        self._read: set[tuple[int, str]] = set()
        self._fresh: set[tuple[int, str]] = set()  # tensor attributes programs read afresh
        self._stale = False  # the keying changed since `take_stale`
        self._last_parts: tuple = ((), ())  # the last call's global and state keys
        self._last_leaf_keys: tuple | None = None  # ... and its tree spec and static leaf keys
        self._walks: dict[int, list] = {}  # ... and the walks of its object arguments
        self._set_sources()
        self._state_memo = TensorKeyMemo(_state_key)  # parameters and buffers
        self._argument_memo = ArgumentKeyMemo(_argument_tensor_key)  # positional tensors
        self._root_memos: list[ObjectKeyMemo] = []  # `_fn_roots_key`, one per root
        self._root_hashed: list[HashedKey | None] = []  # ... and its last key, hashed
        self._roots_memo = RootsMemo()  # `function_roots(self.fn)`, found on every call
        self.flag_reads = FlagReads()  # autograd flags of real tensors programs read
        # a jitted bound method reads its object, a wrapper the objects it closes over or reads
        # as globals (found again on every call: closure cells change)
        inner = getattr(fn, "__func__", fn)
        reads_objects = getattr(fn, "__self__", None) is not None or bool(
            getattr(inner, "__closure__", None)) or bool(function_roots(fn)) \
            or reads_unbound_globals(inner)
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
        for name in sorted(self._environment):
            self.scalar_sources.append(environment_source(name))
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

    def watch_environment(self, names: frozenset[str]) -> None:
        """Key the values of the environment variables `names` from now on (ones a traced
        program looked up, NOTE [environment reads]); keys computed before are stale."""
        if names <= self._environment:
            return
        self._environment |= names
        self._set_sources()
        self._stale = True

    def watch_flags(self, reads: tuple) -> None:
        """Key the autograd flags `reads` from now on; if that is new, older keys are stale."""
        if reads and self.flag_reads.watch(reads):
            self._stale = True

    def global_snapshots(self) -> list[tuple[Any, Any]]:
        """`(holder, snapshot)` of the globals and closure variables the code reads (as
        `(namespace, name)` and `(cell, None)` with their values) and of the lists, dicts and
        plain objects they hold (and those nested in them, `_NESTED_DEPTH` levels): a trace that
        stores a traced tensor into one (`STATS["loss"] = loss`, `LOG.append(y)`) would leave a
        proxy there, and stores of Python values would not be repeated by a compiled call
        (`stored_proxies`)."""
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
            elif name.startswith(HOOK_LABEL) or name.endswith(DEFAULTS_LABEL):
                # a hook's object or default arguments; the function's own defaults (`acc=[]`)
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
        """The process-wide state traced code may read (grad, inference and deterministic
        mode, default dtype and device, autocast, matmul precision, threads, ...: the table
        `PROCESS_STATES`, NOTE [process state in the key]), module training flags, and the
        Python scalars the code can read besides its arguments (see `scalar_sources`)."""
        if self.fn is not None:  # (before the sources: they leave these objects to their key)
            self.fn_roots = self._roots_memo.roots(self.fn)
        return (
            process_state_key(),
            self._sources_key(),
            self.flag_reads.key() if self.flag_reads else (),
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
            values = [*map(training_of, self.modules), *[read() for _, read in
                                                       self.scalar_sources]]
        return values

    def _sources_key(self) -> HashedKey:
        """The key of the modules' training flags and of the sources' values, reused while
        nothing it was computed from changed (`KeyMemo`)."""
        if self._read_sources.unchanged():  # NOTE [unchanged sources]: the values read last
            memo = self._sources_memo.held_key()
            if memo is not None:
                return memo
        values = self._source_values()
        memo = self._sources_memo.lookup(values)  # nothing they hold changed: the same key
        if memo is not None:
            self._read_sources.remember(values)
            return memo
        count = len(self.modules)
        flags = tuple(values[:count])
        keys, objects = [], {}  # a config object many modules hold is keyed once
        snapshots: list[tuple] | None = []  # what the key read, for the memo (None: more)
        written = self.written
        # the function's own objects: keyed by `_fn_roots_key` (by value here, a counter in
        # a closure's object missed its symbolic entry each call)
        own = {id(root) for root in self.fn_roots} if self.fn is not None else ()
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
            elif kind is object_type and own and id(value) in own:
                keys.append(("function's own object", kind))
                if snapshots is not None:
                    snapshots.append(typed_snapshot(value))
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
                elif kind is not float and not isinstance(
                        value, (Tensor, torch.nn.Module, *FUNCTIONS, *ATOMS)):
                    snapshots = None  # keyed by `_leaf_key`, which may look deeper
        key = HashedKey((flags, tuple(keys)))
        self._sources_memo.store(values, key, snapshots)
        self._read_sources.remember(values if snapshots is not None else None)
        return key

    def forget_walks(self) -> None:
        """Let go of the last call's object walks (they hold its tensors alive): called once
        no symbolic lookup of the same call (`key(same_call=True)`) follows."""
        self._walks = {}

    def _fn_roots_key(self, ints: dict | None = None) -> tuple:
        """The key of the function's own objects (`function_roots`): floats read at run time
        keyed by type, and the integers at `ints` (negative roots, traced as symbols) too."""
        if self.fn is None:
            return ()
        masks = _float_masks(self.float_positions) if self.float_positions else {}
        if not ints:  # (the common case: each root's key reused while nothing it read changed)
            memos, hashed = self._root_memos, self._root_hashed
            while len(memos) < len(self.fn_roots):
                memos.append(ObjectKeyMemo())
                hashed.append(None)
            keys = []
            for i, (memo, root) in enumerate(zip(memos, self.fn_roots)):
                key = memo.key(root, _leaf_key, masks.get(-1 - i))
                # NOTE [hashed root keys]: an optimizer's key has a part per walked slot (an
                # AdamW over 18 parameters: ~1,600), hashed again by every cache lookup; the
                # memo returns the very same tuple while nothing changed, so its `HashedKey`
                # is reused (a recomputed key, equal or not, is hashed anew)
                held = hashed[i]
                if held is None or held.key is not key:
                    held = hashed[i] = HashedKey(key)
                keys.append(held)
            return tuple(keys)
        for root, path in ints:
            masks.setdefault(root, {})[path] = INT_KEY
        return tuple([HashedKey(object_key(root, _leaf_key, masks.get(-1 - i)))
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
        own = {position: dims for position, dims in (symbolic or {}).items()
               if isinstance(position, tuple) and position[0] < 0}
        if own:  # integers of the function's own objects traced as symbols: keyed by type
            if any(dims != INT for dims in own.values()):
                return (), []  # (only integers there are traced with symbols)
            global_key = (*global_key[:-1], self._fn_roots_key(own))
            symbolic = {p: dims for p, dims in symbolic.items() if p not in own}
        if not kwargs and not offsets:
            tensor_keys = self._argument_memo.keys(args)
            if tensor_keys is not None and (len(args) < 2 or len(set(map(id, args)))
                                            == len(args)):
                # fast path: positional plain tensors, each a different one
                if symbolic:
                    if not all(type(p) is int and p < len(args) for p in symbolic):
                        return (), args
                    tensor_keys = list(tensor_keys)
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
        if len(leaves) > 1 or self._walks:
            mark_repeated(leaves, leaf_keys, self._walks)
        return (spec, global_key, state_key, tuple(leaf_keys)), leaves
