"""Dead code elimination."""

from __future__ import annotations

import torch

from fulmen.core import BoundSymbol, Trace
from fulmen.core.printer import bindable_symbols
from fulmen.core.proxy import Proxy, iter_proxies, strides_of
from fulmen.transforms.base import transform


def live_bsyms(bsyms, outputs) -> tuple[BoundSymbol, ...]:
    """The statements of `bsyms` that `outputs` (or a side effect) need, in order."""
    live = {proxy.name for proxy in iter_proxies(outputs)}
    kept = []
    for bsym in reversed(bsyms):
        if bsym.has_side_effects or live & bsym.output_names:
            kept.append(bsym)
            live |= bsym.input_names
    return tuple(reversed(kept))


def _symbols(value, found: set, depth: int = 0, seen: set | None = None) -> None:
    """Add the symbols of the symbolic sizes in `value` (a SymInt, a proxy's shape and
    strides, nested tuples, lists, dicts and slices) to `found`. Proxies whose id is in `seen`
    are skipped, and those visited added to it (a value read by many statements is looked at
    once)."""
    if type(value) is int:
        return
    if isinstance(value, torch.SymInt):
        found |= _free_symbols(value.node.expr)
    elif isinstance(value, torch.Tensor):  # a TensorProxy
        if seen is not None:
            if id(value) in seen:
                return
            seen.add(id(value))
        for size in (*value.shape, *strides_of(value)):
            if type(size) is not int:
                found |= _free_symbols(size.node.expr)
    elif depth < 8 and isinstance(value, (tuple, list)):
        for item in value:
            if type(item) is not int:
                _symbols(item, found, depth + 1, seen)
    elif depth < 8 and isinstance(value, dict):
        for item in value.values():
            _symbols(item, found, depth + 1, seen)
    elif isinstance(value, slice):
        _symbols((value.start, value.stop, value.step), found, depth + 1, seen)


def _free_symbols(expr) -> frozenset:
    """`expr.free_symbols`, kept by the expression: sympy computes it anew at every asking (a
    union over the expression's tree), and `size_sources` asks it of every symbolic size of
    every proxy of a trace, the same few expressions each time. A sympy expression is
    immutable, and equal expressions have the same free symbols."""
    key = expr
    symbols = _FREE_SYMBOLS.get(key)
    if symbols is None:
        if len(_FREE_SYMBOLS) >= _FREE_SYMBOLS_LIMIT:
            _FREE_SYMBOLS.clear()
        symbols = _FREE_SYMBOLS[key] = frozenset(expr.free_symbols)
    return symbols


_FREE_SYMBOLS: dict = {}
_FREE_SYMBOLS_LIMIT = 4096


def _bare_sizes(proxy) -> set:
    """The symbols that are themselves a size of `proxy`."""
    return {size.node.expr for size in getattr(proxy, "shape", ())
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol}


def size_sources(bsyms, outputs, inputs: tuple, candidates) -> list[Proxy]:
    """The proxies among `candidates` that a function of `inputs` running `bsyms` and returning
    `outputs` needs besides them for the symbolic sizes it uses (printed traces bind a symbol
    from an input's size, `fulmen.core.printer.symbol_bindings`): the first holding each symbol
    no input's size holds. An integer traced as a symbol is read from its carrier
    (`fulmen.tracer.symbolic.carrier`), which no statement reads."""
    used: set = set()
    seen: set = set()  # the statements' proxies (alive while this runs: ids are theirs)
    for bsym in bsyms:
        for statement in (bsym, *bsym.subsymbols):
            _symbols((statement.args, statement.kwargs, statement.output), used, 0, seen)
    _symbols(tuple(iter_proxies(outputs)), used, 0, seen)
    if not used:
        return []
    held_by_inputs: set = set()
    _symbols(inputs, held_by_inputs)
    missing = used - held_by_inputs
    if used & held_by_inputs:  # held only inside a size no binding solves: `(s0 - 1) // 2`
        missing = used - bindable_symbols(inputs, used)
    needed = []
    for candidate in candidates:
        if not missing:
            break
        held: set = set()
        _symbols(candidate, held)
        if not held & missing:
            continue
        # what the candidate makes bindable: a size that is a symbol binds it; one such as
        # `s0*s1` (a flattened value) binds neither, so the printer's rule decides the rest
        gained = held & missing & _bare_sizes(candidate)
        if gained != held & missing:
            gained = missing & bindable_symbols((*inputs, *needed, candidate), missing)
        if gained:
            needed.append(candidate)
            missing -= gained
    return needed


def free_values(bsyms, outputs, given, sizes_from=()) -> tuple[Proxy, ...]:
    """The values `bsyms` and `outputs` read that no statement of `bsyms` defines and that are
    not among the proxies `given`, in order of first use: what a backward needs from its
    forward (its residuals), the cotangents being `given`; then those of `sizes_from` that
    bind the symbolic sizes used (`size_sources`)."""
    defined = {name for bsym in bsyms for name in bsym.output_names}
    defined |= {proxy.name for proxy in iter_proxies(given)}
    free: dict[str, Proxy] = {}
    for proxy in [p for bsym in bsyms for p in bsym.proxy_inputs] + list(iter_proxies(outputs)):
        if proxy.name not in defined:
            free.setdefault(proxy.name, proxy)
    if sizes_from:
        inputs = (*free.values(), *iter_proxies(given))
        for proxy in size_sources(bsyms, outputs, inputs, sizes_from):
            free.setdefault(proxy.name, proxy)
    return tuple(free.values())


@transform("dead code elimination")
def dce(trace: Trace) -> Trace:
    """Remove bound symbols whose outputs are never used (side-effecting ones are kept).

    Example: in `t0 = ltorch.exp(x); t1 = ltorch.sin(x); return t1`, the `exp` line goes.
    """
    kept = live_bsyms(trace.bsyms, trace.output)
    if len(kept) == len(trace.bsyms):
        return trace
    return trace.replace(bsyms=kept)
