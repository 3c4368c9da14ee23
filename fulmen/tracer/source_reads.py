"""One generated function that reads every value the module part of a cache key depends on.

The key of a call (`fulmen.tracer.guards.CacheKeyBuilder.global_key`) covers the `training` flag
of each module and the values a program may read besides its arguments (`scalar_sources`: module
attributes, globals, closure cells). Reading them one by one, each through its own reader
(`functools.partial(getattr, module, name)`), costs a Python-level call per value: about 10 µs
for the 112 sources and 33 modules of a tiny HF Llama. `source_reader` generates instead one
function that returns them all in a list, reading an attribute straight from the module's
`__dict__` where that is exactly what `getattr` returns (no data descriptor of that name on the
class, no `__getattribute__` override), and calling the reader otherwise:

    def read():
        return [d0['training'], d1['training'], d1['in_features'], g0.get('ACT2FN'), r7()]

A module attribute that is no longer in its `__dict__` (deleted, or another added in its place,
which keeps the counts `global_key` compares) raises `KeyError`; `read` then returns None and
the caller collects the sources again, as it does when a module gains an attribute.

NOTE [unchanged sources]: between two calls of a model nothing `read` returns changes, and the
key memo (`key_memo.KeyMemo.lookup`) then compares every value with the last by identity, after
the caller compared the modules' attribute counts: three passes over the values. The same
generated code has `read.unchanged()`, one expression doing all of it at once,

    len(d0) == 7 and len(d1) == 9 and d0['training'] is v[0] and d1['in_features'] is v[1] ...

against the values last given to `read.remember(values)` (`remember(None)`: none, and
`unchanged()` is False until the next), so a hit reads each source once.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_MISSING = object()


def _class_attribute(cls: type, name: str) -> Any:
    """`name` as the class (or a base) defines it, without running descriptors."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return _MISSING


def reads_dict_entry(obj: Any, name: Any) -> bool:
    """Whether `getattr(obj, name)` is `vars(obj)[name]` for `obj` as it is: the name is in its
    `__dict__`, its class keeps Python's attribute lookup, and no data descriptor (a property)
    of that name on the class takes precedence over the instance's entry."""
    cls = type(obj)
    if type(name) is not str or cls.__getattribute__ is not object.__getattribute__:
        return False
    try:
        if name not in vars(obj):
            return False
    except TypeError:  # no __dict__
        return False
    attribute = _class_attribute(cls, name)
    kind = type(attribute)
    return attribute is _MISSING or not (hasattr(kind, "__set__") or hasattr(kind, "__delete__"))


def _module_attribute(read) -> tuple[torch.nn.Module, str] | None:
    """`(module, name)` if `read` is `functools.partial(getattr, module, name[, default])`."""
    if type(read) is not functools.partial or read.func is not getattr or read.keywords:
        return None
    args = read.args
    if len(args) in (2, 3) and isinstance(args[0], torch.nn.Module):
        return args[0], args[1]
    return None


def _global_name(read) -> tuple[dict, str] | None:
    """`(namespace, name)` if `read` is `functools.partial(namespace.get, name)`."""
    if type(read) is not functools.partial or read.keywords or len(read.args) != 1:
        return None
    owner = getattr(read.func, "__self__", None)
    if type(owner) is dict and getattr(read.func, "__name__", None) == "get" \
            and type(read.args[0]) is str:
        return owner, read.args[0]
    return None


def training_of(module: torch.nn.Module) -> bool | None:
    """`module.training`, or None for a module without the flag (a `torch.jit.freeze`-d
    TorchScript module keeps no `training`: it is always in eval mode)."""
    return getattr(module, "training", None)


def source_reader(modules: tuple[torch.nn.Module, ...], sources: list[tuple[str, Any]]):
    """A function of no arguments returning `[m.training for m in modules] + [read() for _,
    read in sources]`, or None when a module attribute it reads from a `__dict__` is gone
    (see the module docstring); with `remember(values)` and `unchanged()`, whether it would
    return exactly (by identity) those values again, no module having gained or lost an
    attribute meanwhile (NOTE [unchanged sources])."""
    cells: dict[str, Any] = {}
    by_id: dict[int, str] = {}

    def bind(obj: Any, prefix: str) -> str:
        name = by_id.get(id(obj))
        if name is None:
            name = by_id[id(obj)] = f"{prefix}{len(cells)}"
            cells[name] = obj
        return name

    items = []
    # every module's `__dict__` and its attribute count now (`unchanged`: none added or gone)
    counts = [f"len({bind(vars(module), 'd')}) == {len(vars(module))}" for module in modules]
    for module in modules:
        if reads_dict_entry(module, "training"):
            items.append(f"{bind(vars(module), 'd')}['training']")
        else:
            items.append(f"{bind(functools.partial(training_of, module), 'r')}()")
    for _, read in sources:
        attribute = _module_attribute(read)
        glob = _global_name(read)
        if attribute is not None and reads_dict_entry(*attribute):
            module, name = attribute
            items.append(f"{bind(vars(module), 'd')}[{name!r}]")
        elif glob is not None:
            namespace, name = glob
            items.append(f"{bind(namespace, 'g')}.get({name!r})")
        else:
            items.append(f"{bind(read, 'r')}()")
    body = ", ".join(items)
    same = " and ".join(["ok", *counts, *[f"{item} is v[{index}]"
                                          for index, item in enumerate(items)]])
    source = (f"def make({', '.join(cells)}):\n"
              "    ok, v = False, ()\n"
              "    def read():\n"
              "        try:\n"
              f"            return [{body}]\n"
              "        except KeyError:\n"
              "            return None\n"
              "    def unchanged():\n"
              "        try:\n"
              f"            return {same}\n"
              "        except KeyError:\n"
              "            return False\n"
              "    def remember(values):\n"
              "        nonlocal ok, v\n"
              "        ok, v = values is not None, tuple(values or ())\n"
              "    read.unchanged, read.remember = unchanged, remember\n"
              "    return read\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, "<fulmen source reader>", "exec"), namespace)  # noqa: S102
    return namespace["make"](**cells)
