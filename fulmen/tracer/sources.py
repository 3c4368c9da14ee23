"""The values a traced program may read besides its arguments: closure cells, globals, module
attributes (`scalar_sources`). Their keys are part of a call's cache key
(`fulmen.tracer.guards.CacheKeyBuilder`), so changing one retraces instead of reusing a stale
constant or tensor.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import operator
import os
import sys
import sysconfig
import types
from typing import Any

import torch

from fulmen.tracer.objects import global_names, is_plain_object

try:  # NumPy scalars (`SCALE = np.float32(2.0)`) are values too
    import numpy

    NUMPY_SCALARS: tuple[type, ...] = (numpy.generic,)
    NUMPY_ARRAYS: tuple[type, ...] = (numpy.ndarray,)
except ImportError:  # pragma: no cover - torch runs without NumPy
    NUMPY_SCALARS = NUMPY_ARRAYS = ()


class _Held:
    """An object in a cache key by identity, kept alive by the key (so its id is not reused)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Held) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)

    def __repr__(self) -> str:
        return f"<{type(self.value).__name__} at {id(self.value):#x}>"


_ARRAY_BYTES_KEPT = 256  # larger arrays are keyed by a digest of their bytes


def array_key(value: Any) -> tuple:
    """The key of a NumPy array (an argument, a global, a closure cell): by identity and by
    value. A program bakes in what it computes from an array (`float(a.sum())`,
    `torch.from_numpy(a * 2)`), and a tensor made by `torch.from_numpy(a)` is captured with
    that array's memory: another array, or this one changed in place, retraces."""
    if value.dtype.hasobject:
        return ("ndarray", _Held(value))
    data = value.tobytes()
    if len(data) > _ARRAY_BYTES_KEPT:
        data = hashlib.blake2b(data, digest_size=16).digest()
    return ("ndarray", _Held(value), value.dtype.str, value.shape, value.strides, data)

Tensor = torch.Tensor
SCALARS = (bool, int, float, str, type(None))
CONTAINERS = (list, tuple, dict)
# functions held in module attributes (`self.act = F.relu`): keyed by identity
FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)


def code_names(code) -> set[str]:
    """The global (and attribute) names `code` and the code objects nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= code_names(const)
    return names




def _is_source(value: Any) -> bool:
    """Values a traced program may read as constants (scalars, small containers of them) or
    capture by reference (tensors)."""
    return isinstance(value, (*SCALARS, Tensor)) or type(value) in CONTAINERS


# immutable values keyed by value (`DTYPE = torch.bfloat16`, `MODE = Mode.EVAL`, a
# `torch.Size`), besides scalars
ATOMS = (torch.dtype, torch.device, torch.Size, enum.Enum, torch.memory_format, torch.layout,
         complex, slice, range, *NUMPY_SCALARS)


def _is_keyed(value: Any) -> bool:
    """Whether a value read from a closure cell, a global or a module attribute is part of the
    cache key: a source (`source_key`), an atom (`ATOMS`), a function (`ACT = F.relu`, keyed
    by identity), a plain object (`object_source_key`), a user class (`class_source_key`) or an
    `nn.Module` (by identity: `model = build()` rebinding the global a jitted function calls)."""
    return _is_source(value) or isinstance(value, (*ATOMS, *FUNCTIONS, *NUMPY_ARRAYS)) \
        or is_plain_object(value) or is_user_class(value) or isinstance(value, torch.nn.Module)


_LIBRARY_DIRS = tuple({path for key in ("stdlib", "platstdlib", "purelib", "platlib")
                       if (path := sysconfig.get_paths().get(key))})


def is_user_class(value: Any) -> bool:
    """Whether `value` is a class of the user's own code (a `class CFG: lr = 1e-3` used as a
    namespace, a module class with class attributes), not of Python, PyTorch or another
    installed library: its attributes may be changed between calls, so they are keyed."""
    try:
        return isinstance(value, type) and _user_class(value)
    except TypeError:  # a metaclass making its classes unhashable
        return False


@functools.lru_cache(maxsize=4096)
def _user_class(cls: type) -> bool:
    if issubclass(cls, enum.Enum):
        return False
    if cls.__module__ == "__main__":
        return True
    return is_user_module(sys.modules.get(cls.__module__))


def is_user_module(value: Any) -> bool:
    """Whether `value` is a Python module of the user's own code (`import config` read as
    `config.SCALE`), not of Python, PyTorch, fulmen or another installed library: its
    attributes may be changed between calls, so those the code names are keyed."""
    if not isinstance(value, types.ModuleType) or value.__name__.split(".")[0] in (
            "torch", "fulmen"):
        return False
    path = getattr(value, "__file__", None)
    return bool(path) and not os.path.abspath(path).startswith(_LIBRARY_DIRS)


# module attributes keyed elsewhere, and nn.Module's own bookkeeping (`_parameters`, the hook
# dicts: watched by `module_hooks`); the user's private attributes (`self._scale`) are keyed
_NOT_KEYED = frozenset(["training", "forward", *vars(torch.nn.Module()),
                        "_compiled_call_impl", "_state_dict_hooks"])
_SCAN_DEPTH = 3  # helper functions followed from the traced function, levels deep
_MAX_CONTAINER_ITEMS = 64  # containers scanned for the functions they hold
_MAX_SOURCES = 512  # a bound on the per-call cost of the key


_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
HOOK_LABEL = "hook "  # how the names of the sources a hook (or a replaced forward) reads start
DEFAULTS_LABEL = "__defaults__"  # how the name of a function's default arguments' source ends
# set on the forward `JittedModule.generate` puts on the wrapped module meanwhile (not keyed)
COMPILED_FORWARD = "_fulmen_compiled_forward"
_GLOBAL_FORWARD_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks")


def forward_hooks(modules) -> list:
    """The forward hooks and pre-hooks registered on `modules` and globally, except PyTorch's
    and fulmen's own: they run inside the trace, so what they read (a global `SCALE`, a
    closure's `factor`) is read by the program, and what they store into (`feats.append(o)`)
    is a store of the program."""
    hooks = [hook for name in _GLOBAL_FORWARD_HOOK_DICTS
             for hook in getattr(torch.nn.modules.module, name, {}).values()]
    hooks += [hook for module in modules for name in _FORWARD_HOOK_DICTS
              for hook in getattr(module, name, {}).values()]
    return [hook for hook in hooks if not _library_code(getattr(hook, "__func__", hook))]


def _library_code(function) -> bool:
    """Whether `function` is PyTorch's or fulmen's (never keyed nor scanned)."""
    module_name = getattr(function, "__globals__", {}).get("__name__") \
        or getattr(function, "__module__", None) or ""
    return module_name.split(".")[0] in ("torch", "fulmen")


def _closure_sources(fn, label: str = "") -> list[tuple[str, object]]:
    """A source for each keyed value in the closure cells of `fn` (a function or a bound
    method), for its default arguments, and for the object of a bound method
    (`self.activations = out` in a hook method)."""
    sources = []
    bound = getattr(fn, "__self__", None)
    if bound is not None and is_plain_object(bound):
        sources.append((f"{label}self", functools.partial(getattr, fn, "__self__")))
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return sources
    if getattr(fn, "__defaults__", None):  # `lambda m, i, out, feats=feats: ...`
        sources.append((label + DEFAULTS_LABEL, functools.partial(getattr, fn, "__defaults__")))
    for cell_name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            if _is_keyed(cell.cell_contents):
                sources.append((label + cell_name, _cell_reader(cell)))
        except ValueError:  # an empty cell
            continue
    return sources


def _own_functions(fn, modules, functions=()) -> list:
    """The traced function and the functions whose globals its program may read: the
    forward and other methods of each module's own class, the methods of the user's objects
    the modules hold (`self.helper.apply`), and (up to `_SCAN_DEPTH` levels) the functions,
    user classes' methods and user modules' functions they name or close over. PyTorch's and
    fulmen's own are left out."""
    found: dict[int, object] = {}
    frontier = [fn] + [value for module in modules for value in vars(type(module)).values()
                       if isinstance(value, types.FunctionType)]
    frontier += [function for module in modules for value in vars(module).values()
                 for function in functions_of(getattr(value, "__func__", value))]
    frontier += [function for value in functions for function in functions_of(value)]
    frontier += [function for hook in forward_hooks(modules)
                 for function in functions_of(getattr(hook, "__func__", hook))]
    for _ in range(_SCAN_DEPTH + 1):
        next_frontier = []
        for candidate in frontier:
            candidate = getattr(candidate, "__func__", candidate)
            code = getattr(candidate, "__code__", None)
            # the module whose globals the code reads: `__module__` is copied by
            # `functools.wraps` (fulmen's own wrapper of a forward says `transformers...`)
            if code is None or id(candidate) in found or _library_code(candidate):
                continue
            found[id(candidate)] = candidate
            namespace = getattr(candidate, "__globals__", {})
            names = code_names(code)
            reachable = [namespace[name] for name in names if name in namespace]
            reachable += [value for module in _user_modules(candidate)  # `cfg.f(x)`
                          for value in map(vars(module).get, names) if value is not None]
            reachable += _closure_values(candidate)
            next_frontier += [function for value in reachable
                              for function in functions_of(value)]
        frontier = next_frontier
    return list(found.values())


def _closure_values(function) -> list:
    values = []
    for cell in getattr(function, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return values


def functions_of(value: Any) -> list:
    """The functions whose globals code reaching `value` (held, named, or an argument:
    `apply(x, act_fn)`) may read: a function itself (also behind `functools.partial` and
    `__wrapped__`), the function-like items of a small container, the methods of a user class
    (`Scaler.apply`, its user base classes' too) and of an instance of one."""
    if isinstance(value, types.FunctionType):
        return [value]
    wrapped = getattr(value, "__wrapped__", None)  # `functools.lru_cache`, `functools.wraps`
    if isinstance(wrapped, types.FunctionType) and not isinstance(value, type):
        return [wrapped]
    if isinstance(value, functools.partial):
        return functions_of(value.func)
    if type(value) in CONTAINERS:  # `ACTS = {"gelu": lambda t: ...}` (not objects held there)
        if len(value) > _MAX_CONTAINER_ITEMS:
            return []
        items = value.values() if type(value) is dict else value
        return [function for item in items if _is_function_like(item)
                for function in functions_of(item)]
    if not isinstance(value, type):
        if not is_plain_object(value):
            return []
        value = type(value)
    if not is_user_class(value):
        return []
    return [getattr(member, "__func__", member) for cls in value.__mro__ if is_user_class(cls)
            for member in vars(cls).values()
            if isinstance(member, (types.FunctionType, staticmethod, classmethod))]


def _is_function_like(value: Any) -> bool:
    return isinstance(value, (types.FunctionType, functools.partial)) \
        or hasattr(value, "__wrapped__")


def _user_modules(function) -> list[types.ModuleType]:
    """The user modules (`is_user_module`) `function` reads from a global or a closure cell."""
    namespace = getattr(function, "__globals__", {})
    found = [namespace[name] for name in code_names(function.__code__)
             if is_user_module(namespace.get(name))]
    return found + [value for value in _closure_values(function) if is_user_module(value)]


def _unwrap_partial(fn) -> tuple[Any, list[tuple[str, object]]]:
    """`fn` without its `functools.partial` layers, and a source for each layer's bound
    arguments (`partial(f, k=2)` whose `keywords` are changed between calls)."""
    sources = []
    while isinstance(fn, functools.partial):
        sources += [("partial.args", functools.partial(getattr, fn, "args")),
                    ("partial.keywords", functools.partial(getattr, fn, "keywords"))]
        fn = fn.func
    return fn, sources


def _callable_sources(fn, label: str) -> list[tuple[str, object]]:
    """The sources of a callable that runs beside the traced program (a hook, a forward
    replaced on the instance), each name prefixed by `label`: its `functools.partial` layers'
    bound arguments, then its closure cells, defaults and bound object (`_closure_sources`)."""
    fn, partial_sources = _unwrap_partial(fn)
    return [(label + name, read) for name, read in partial_sources] + _closure_sources(fn, label)


# The readers of globals (a module's namespace or a user module's attributes) and of closure
# cells; `GlobalStore` finds them among the sources by their shape (`reads_global`,
# `reads_cell`).
def _global_reader(namespace: dict, name: str):
    return functools.partial(namespace.get, name)


def _cell_reader(cell: types.CellType):
    return functools.partial(getattr, cell, "cell_contents")


def reads_global(read) -> tuple[dict, str] | None:
    """`(namespace, name)` if the source reader `read` reads a global (`_global_reader`)."""
    func = getattr(read, "func", None)
    if getattr(func, "__name__", None) == "get" and type(getattr(func, "__self__", None)) \
            is dict:
        return func.__self__, read.args[0]
    return None


def reads_cell(read) -> types.CellType | None:
    """The cell if the source reader `read` reads a closure cell (`_cell_reader`)."""
    if getattr(read, "func", None) is getattr and read.args \
            and type(read.args[0]) is types.CellType:
        return read.args[0]
    return None


def _class_forward(cls: type):
    """`cls.forward` as the class holds it: a TorchScript class's `forward` is a descriptor
    that raises when read from the class (`torch.jit.script(module)`)."""
    return inspect.getattr_static(cls, "forward", None)


def _class_sources(cls: type, seen: set[type], read=None) -> list[tuple[str, object]]:
    """A source for `cls` (read by `read` when given: a module's `__class__`) and for each user
    base class of it, those not in `seen` (added to it); they are keyed by their data
    attributes (`class_source_key`)."""
    sources = []
    for base in cls.__mro__:
        if is_user_class(base) and base not in seen:
            seen.add(base)
            reader = read if base is cls and read is not None \
                else functools.partial(operator.getitem, (base,), 0)
            sources.append((f"{base.__name__} (class)", reader))
    return sources


def scalar_sources(fn, modules=(), functions=()) -> list[tuple[str, object]]:
    """(name, reader) for each value a traced program may bake in as a constant or capture
    without it being an argument: the function's closure cells, the globals named by it and
    by the functions it may call (`_own_functions`; `functions` are the functions and user
    classes the call's arguments hold, `CacheKeyBuilder.add_functions`), the class attributes
    of user classes, and the plain attributes of every module
    (`dropout.p`, `attn.scale`, `self.table`, `self.act = F.relu`): scalars, tensors, functions
    and small containers (`source_key`), and plain objects by their attributes (`args.temperature` of a global
    argparse namespace, a config dataclass: `object_source_key`). Their current keys are part
    of the cache key, so changing one retraces instead of reusing a stale constant or
    tensor."""
    fn, sources = _unwrap_partial(fn)
    if getattr(fn, "__code__", None) is not None:
        sources += _closure_sources(getattr(fn, "__func__", fn))
    seen: set[tuple[int, str]] = set()
    for function in _own_functions(fn, modules, functions):
        # its globals (read as globals: `ctx.n` reads no global `n`), and the attributes of
        # the user modules it reads (`config.SCALE`: co_names holds attributes too)
        attributes = sorted(code_names(function.__code__))
        namespaces = [(function.__globals__, "", sorted(global_names(function.__code__))),
                      *((vars(module), f"{module.__name__}.", attributes)
                        for module in _user_modules(function))]
        for namespace, prefix, names in namespaces:
            for name in names:
                if (id(namespace), name) in seen or name.startswith("__"):
                    continue
                seen.add((id(namespace), name))
                if name in namespace and _is_keyed(namespace[name]):
                    sources.append((prefix + name, _global_reader(namespace, name)))
    classes: set[type] = set()
    for given in functions:  # an argument object's class: `o.SCALE` from `class Opts`
        if isinstance(given, type):
            sources += _class_sources(given, classes)
    forwards: set[type] = set()
    for module in modules:
        # `self.scale` read from `class Block: scale = 2.0` or `class Base(nn.Module): ...`
        sources += _class_sources(type(module), classes,
                                  functools.partial(getattr, module, "__class__"))
        if type(module) not in forwards:  # `LlamaRMSNorm.forward = patched` after jitting
            forwards.add(type(module))
            sources.append((f"{type(module).__name__}.forward (class)",
                            functools.partial(_class_forward, type(module))))
        # private attributes of the user's own modules (`self._scale`); a library's are its
        # bookkeeping (HF's `_is_hf_initialized`), except tensors, read afresh by programs
        private = is_user_class(type(module))
        replaced = vars(module).get("forward")
        if replaced is not None and not getattr(replaced, COMPILED_FORWARD, False):
            # a forward replaced on the instance (`layer.forward = patched`, accelerate's
            # wrappers): keyed by identity, what it reads as a hook's reads are
            label = f"{HOOK_LABEL}{type(module).__name__}.forward."
            sources.append((label[:-1], functools.partial(getattr, module, "forward")))
            sources += _callable_sources(replaced, label)
        for attr, value in vars(module).items():  # `self.config.scale` too (`object_source_key`)
            # (`forward`: `JittedModule.generate` points it at the compiled forward meanwhile)
            if _is_keyed(value) and attr not in _NOT_KEYED and (
                    private or not attr.startswith("_") or type(value) is Tensor):
                label = f"{type(module).__name__}.{attr}"
                sources.append((label, functools.partial(getattr, module, attr)))
    # last, so that the cap drops these before the forward's own reads
    for hook in forward_hooks(modules):  # `feats[name] = out` in a closure, `SCALE` read
        inner = _unwrap_partial(hook)[0]
        label = f"{HOOK_LABEL}{getattr(inner, '__qualname__', type(inner).__name__)}."
        sources += _callable_sources(hook, label)
        hook = inner
        if not isinstance(hook, (types.FunctionType, types.MethodType)) \
                and is_plain_object(hook):  # a callable object (`torch.nn.utils.prune`)
            sources.append((label + "self", functools.partial(operator.getitem, (hook,), 0)))
    return sources[:_MAX_SOURCES]
