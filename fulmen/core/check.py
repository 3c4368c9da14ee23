"""`check_trace`: the structural invariants every trace keeps.

- SSA: every name is assigned once (inputs count as assignments), also counting the names a
  statement's decomposition assigns (a later pass may replace the statement by it).
- Def-before-use: every proxy a statement reads is an input or an earlier output, not deleted.
- Metadata: every mention of a name has the same type (shape, dtype, device).
- The trace's outputs are defined, and its printed source compiles.
"""

from __future__ import annotations

from fulmen.core.errors import FulmenError
from fulmen.core.proxy import iter_proxies


def _fail(trace, message: str, bsym=None) -> FulmenError:
    where = bsym.source if bsym is not None else None
    return FulmenError(f"invalid trace {trace.name!r} ({trace.provenance}): {message}", where=where)


def _nested_outputs(bsym, names: list[str]) -> None:
    for sub in bsym.subsymbols:
        names.extend(sub.output_names)  # kept by the statement
        _nested_outputs(sub, names)


def _check_nested_names(trace) -> None:
    """Names assigned inside decompositions must not collide with other statements' names."""
    owner: dict[str, int] = {proxy.name: -1 for proxy in trace.args}
    for index, bsym in enumerate(trace.bsyms):
        for name in bsym.output_names:
            owner.setdefault(name, index)
    for index, bsym in enumerate(trace.bsyms):
        nested: list[str] = []
        _nested_outputs(bsym, nested)
        for name in set(nested):
            if owner.setdefault(name, index) != index:
                raise _fail(trace, f"{name} is assigned twice (once inside the decomposition of "
                                   f"{bsym.sym.python_name})", bsym)


def check_trace(trace, compile_source: bool = True) -> None:
    """Raise `FulmenError` describing the first broken invariant of `trace`: SSA (each name
    assigned once, also inside decompositions), def-before-use, use-after-del, metadata agreeing
    between definition and uses, and (with `compile_source`) that the printed trace compiles."""
    defined: dict[str, object] = {}  # name -> the proxy object that defined it
    live: set[str] = set()

    def define(proxy, bsym=None):
        if proxy.name in defined:
            raise _fail(trace, f"{proxy.name} is assigned twice", bsym)
        defined[proxy.name] = proxy
        live.add(proxy.name)

    def use(proxy, bsym=None):
        if proxy.name not in live:
            state = "deleted" if proxy.name in defined else "undefined"
            raise _fail(trace, f"{proxy.name} is used but {state}", bsym)
        first = defined[proxy.name]
        # the very object agrees with itself (formatting symbolic sizes costs)
        if first is not proxy and first.type_string() != proxy.type_string():
            raise _fail(
                trace,
                f"{proxy.name} is {proxy.type_string()} here but {first.type_string()} where "
                "defined", bsym,
            )

    for proxy in trace.args:
        define(proxy)
    _check_nested_names(trace)
    for bsym in trace.bsyms:
        for proxy in bsym.read_proxies:
            use(proxy, bsym)
        if bsym.is_del:
            live.difference_update(proxy.name for proxy in iter_proxies(bsym.args))
            continue
        for proxy in bsym.proxy_outputs:
            define(proxy, bsym)
    for proxy in iter_proxies(trace.output):
        use(proxy)
    if not compile_source:
        return
    try:
        compile(trace.source(), f"<check {trace.name}>", "exec")
    except SyntaxError as error:
        raise _fail(trace, f"printed source does not compile: {error}") from error
