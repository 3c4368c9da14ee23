"""A backward for the calls in which some outputs received no gradient (issue 21).

A model called with `labels=` returns its loss and its logits; `loss.backward()` uses the
loss alone. Autograd would hand the compiled backward a zero-filled cotangent for the logits
(and for every other unused output: hidden states, key/value caches), which the backward trace
then adds into the logits' gradient: a full-size allocation and addition per step. Eager never
runs the backward of an output nobody used.

`fold_unused_cotangents` rewrites a backward trace for one pattern of unused cotangents: they
leave the signature and are known zeros, propagated forward through the statements:

    add(x, zeros) -> x            (same shape, dtype and strides; `sub(x, zeros)` too)
    mul(zeros, y), div(zeros, y)  -> zeros, as eager never computes them (no 0 * inf = nan)
    reshape, permute, squeeze, broadcast_in_dim, slice, convert_element_type, neg, sum,
    matmul with a zero operand, where(c, zeros, 0)   -> zeros

A zero that reaches any other statement is materialized there (`prims.full`, contiguous, as
autograd's zeros are); a statement whose zero output would not be contiguous is kept whole, its
zero inputs materialized. An input gradient that is all known zeros becomes None: eager does
not reach that input from the outputs used (a VJP is linear in its cotangent, so a gradient
from a used output never folds to zero). So does one that, folded or not, reads none of the
used cotangents (`_reached`): a zero materialized on its way (a zero sliced along the last
dimension, an opaque op's VJP) leaves it all zeros, and eager leaves it None, which an
optimizer then skips (AdamW's weight decay included). One that reads no cotangent at all,
used or not, stays: its path to a used output crosses an empty tensor (`h[:, 0:-1]` of one
row: the VJP pads nothing into zeros), and eager, which reaches the input, gives zeros. Dead statements then go. Where folding or compiling a
pattern fails, the pipeline builds it with `fold=False`: zeros materialized first, as before.
"""

from __future__ import annotations

import torch

from fulmen.core import BoundSymbol, Trace, TraceCtx, tracing
from fulmen.core.proxy import Proxy, map_proxies
from fulmen.ops import prims
from fulmen.proxies.tensor import contiguous_strides
from fulmen.transforms.dce import live_bsyms

# prims whose output is zeros when their (only) tensor operand is zeros
_LINEAR_UNARY = frozenset(("reshape", "permute", "squeeze", "broadcast_in_dim", "slice_prim",
                           "convert_element_type", "neg", "sum"))


def _same(a, b) -> bool:
    """Equal sizes (or strides), symbolic ones compared by their expressions."""
    return len(a) == len(b) and all(x is y or str(x) == str(y) for x, y in zip(a, b))


def _like(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether proxy `a` can stand for proxy `b`: same shape, dtype, device and strides."""
    return (a.dtype == b.dtype and a.device == b.device and _same(a.shape, b.shape)
            and _same(a.stride(), b.stride()))


def _contiguous(proxy: torch.Tensor) -> bool:
    return _same(proxy.stride(), contiguous_strides(proxy.shape))


def _folds_to_zero(bsym: BoundSymbol, zero: set[str]) -> bool:
    """Whether `bsym`, reading known zeros, outputs zeros."""
    name = bsym.sym.name
    tensors = [a for a in bsym.args if isinstance(a, torch.Tensor)]
    if name in _LINEAR_UNARY:
        return len(tensors) == 1 and bsym.args[0] is tensors[0] and tensors[0].name in zero
    if name in ("mul", "matmul"):
        return any(t.name in zero for t in tensors)
    if name == "div":
        return isinstance(bsym.args[0], torch.Tensor) and bsym.args[0].name in zero
    if name in ("add", "sub"):
        return all(isinstance(a, torch.Tensor) and a.name in zero for a in bsym.args[:2])
    if name == "where" and len(bsym.args) == 3:
        branches = bsym.args[1:]
        return all((isinstance(b, torch.Tensor) and b.name in zero)
                   or (type(b) in (int, float, bool) and b == 0) for b in branches)
    return False


def _passes_through(bsym: BoundSymbol, zero: set[str]) -> Proxy | None:
    """For `x + zeros`, `zeros + x`, `x - zeros`: the `x` that can replace the output."""
    if bsym.sym.name not in ("add", "sub") or len(bsym.args) != 2 or bsym.kwargs:
        return None
    a, b = bsym.args
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    if b.name in zero:
        other = a
    elif a.name in zero and bsym.sym.name == "add":
        other = b
    else:
        return None
    return other if _like(other, bsym.output) else None


def _reached(bsyms: list[BoundSymbol], used: set[str]) -> set[str]:
    """The names computed from the cotangents named in `used` (and those names)."""
    reached = set(used)
    for bsym in bsyms:
        if any(p.name in reached for p in bsym.proxy_inputs):
            reached.update(p.name for p in bsym.proxy_outputs)
    return reached


def fold_unused_cotangents(trace: Trace, unused: tuple[bool, ...], *, fold: bool = True) -> Trace:
    """`trace` (a backward taking `(*residuals, *cotangents)`) for calls in which the
    cotangents flagged in `unused` are zeros: those leave its arguments (module docstring).
    With `fold=False` they are only materialized first thing, as autograd would have."""
    count = len(unused)
    cotangents = trace.args[len(trace.args) - count:]
    zero = {c.name for c, flag in zip(cotangents, unused) if flag}
    known: dict[str, torch.Tensor] = {c.name: c for c in cotangents if c.name in zero}
    replaced: dict[str, Proxy] = {}
    materialized: set[str] = set()
    kept: list[BoundSymbol] = []

    def rename(proxy: Proxy) -> Proxy:
        return replaced.get(proxy.name, proxy)

    def materialize(name: str) -> None:
        if name in materialized:
            return
        proxy = known[name]
        scratch = TraceCtx("zeros")
        with tracing(scratch):
            prims.full(tuple(proxy.shape), 0, proxy.dtype, proxy.device)
        kept.append(scratch.bsyms[-1].replace(output=proxy))
        materialized.add(name)

    if not fold:
        for name in list(zero):
            materialize(name)
        zero.clear()
    for bsym in trace.bsyms:
        if replaced:
            bsym = bsym.renamed(rename)
        reads = [p.name for p in bsym.proxy_inputs if p.name in zero]
        if not reads:
            kept.append(bsym)
            continue
        outputs = bsym.proxy_outputs
        through = _passes_through(bsym, zero)
        if through is not None:
            replaced[bsym.output.name] = through
            continue
        if (len(outputs) == 1 and isinstance(outputs[0], torch.Tensor) and not bsym.kwargs
                and _contiguous(outputs[0]) and _folds_to_zero(bsym, zero)):
            zero.add(outputs[0].name)
            known[outputs[0].name] = outputs[0]
            continue
        for name in reads:
            materialize(name)
        kept.append(bsym)

    output = map_proxies(rename, trace.output)
    reached = _reached(kept, {c.name for c, flag in zip(cotangents, unused) if not flag})
    from_unused = _reached(kept, set(known))
    output = tuple(None if isinstance(g, Proxy) and (
        g.name in zero or (g.name not in reached and g.name in from_unused)) else g
        for g in output)
    args = tuple(a for a in trace.args[:len(trace.args) - count]) + tuple(
        c for c, flag in zip(cotangents, unused) if not flag)
    bsyms = live_bsyms(kept, output)
    return trace.replace(args=args, bsyms=bsyms, output=output,
                         provenance="after folding unused cotangents")


def unreached_gradients(trace: Trace, unused: tuple[bool, ...]) -> frozenset[int]:
    """Positions of the input gradients of backward `trace` computed from the cotangents
    flagged in `unused` and from none of the others: run on autograd's zeros for the unused,
    the trace gives zeros there, where eager does not reach the input (None). For a backward
    with symbolic cotangent sizes, whose unused cotangents are not folded."""
    cotangents = trace.args[len(trace.args) - len(unused):]
    reached = _reached(list(trace.bsyms), {c.name for c, f in zip(cotangents, unused) if not f})
    from_unused = _reached(list(trace.bsyms), {c.name for c, f in zip(cotangents, unused) if f})
    return frozenset(i for i, g in enumerate(trace.output) if isinstance(g, Proxy)
                     and g.name not in reached and g.name in from_unused)


__all__ = ["fold_unused_cotangents", "unreached_gradients"]
