"""A backward's join of head-split gradients as one cat before one reshape (issue 21: `make
demo`'s training step).

The forward of attention splits a projection into heads: `qkv.split(...)`, then each part
`view(B, T, heads, hs).transpose(1, 2)`. Its backward joins the three gradients back:
`cat([reshape(permute(g_q), (B, T, C)), reshape(permute(g_k), ...), ...], 2)`. Each reshape
of a permuted tensor is a copy, and the cat copies again: four passes over the gradient.
Concatenating the permuted gradients along their head dimension first (`cat([permute(g_q),
...], 2)`: (B, T, 3 * heads, hs)) and reshaping the contiguous result (a view) computes the same
tensor, element for element the same copies, in one pass.

`cat_before_reshape` rewrites a `cat` whose every operand is a `reshape`, read by that cat
alone, of a `permute`'s (or `transpose`'s) output, where all permuted tensors have one shape `X` and each reshape
merges the dimensions `X[d:m]` (at least two) into the cat's dimension `d`, the others kept:
then `cat(x_i, d)` followed by the reshape to the joined shape is the same tensor, contiguous
as the cat's output was. Static shapes only; the unread reshapes are dropped.
"""

from __future__ import annotations

import math

from fulmen.core import BoundSymbol, FulmenError, Trace, TraceCtx, tracing
from fulmen.core.proxy import Proxy
from fulmen.core.trace import reserved_names
from fulmen.ops import ltorch, prims
from fulmen.proxies.tensor import TensorProxy
from fulmen.transforms.autodiff.registry import bound_arguments
from fulmen.transforms.base import transform
from fulmen.transforms.grouped_attention import standing_in_for

__all__ = ["cat_before_reshape"]

_CATS = (prims.cat, ltorch.cat)  # the backward's statements are mostly prims
_RESHAPES = (prims.reshape, ltorch.reshape)
_PERMUTATIONS = (prims.permute, ltorch.permute, ltorch.transpose)  # reshaping these copies


def _static(proxy) -> bool:
    return isinstance(proxy, TensorProxy) and all(type(s) is int for s in proxy.shape)


def _merged_at(source: tuple, target: tuple, dim: int) -> bool:
    """Whether `target` is `source` with dimensions `dim` up to some `m` (at least two) merged
    into one at `dim`, the others kept."""
    if target[:dim] != source[:dim]:
        return False
    tail = len(target) - dim - 1  # dimensions after the merged one
    end = len(source) - tail
    return end - dim >= 2 and target[dim + 1:] == source[end:] \
        and target[dim] == math.prod(source[dim:end])


def _permuted_parts(bsym: BoundSymbol, producers: dict, reads: dict) -> tuple | None:
    """`(permuted tensors, dim)` of a cat of reshaped permutations (module docstring), or
    None."""
    tensors, dim = bound_arguments(bsym.sym, bsym.args, bsym.kwargs)
    if not isinstance(tensors, (list, tuple)) or len(tensors) < 2 or type(dim) is not int \
            or not all(map(_static, tensors)):
        return None
    dim %= tensors[0].ndim
    parts = []
    for tensor in tensors:
        reshape = producers.get(tensor.name)
        if reshape is None or reshape.sym not in _RESHAPES or reads.get(tensor.name) != 1:
            return None
        source = reshape.args[0]
        permute = producers.get(getattr(source, "name", None))
        if permute is None or permute.sym not in _PERMUTATIONS or not _static(source):
            return None
        parts.append((source, reshape))
    first = parts[0][0]
    if any(tuple(x.shape) != tuple(first.shape) or x.dtype != first.dtype
           or x.device != first.device for x, _ in parts):
        return None
    if not _merged_at(tuple(first.shape), tuple(tensors[0].shape), dim):
        return None
    return [x for x, _ in parts], dim, [r for _, r in parts]


def _joined(bsym: BoundSymbol, permuted: list, dim: int, names) -> list[BoundSymbol] | None:
    """The cat of `permuted` along `dim` and the reshape to `bsym`'s output, standing where
    `bsym` stood."""
    ctx = TraceCtx("cat before reshape")
    ctx.names = names
    try:
        with tracing(ctx):
            joined = prims.cat(permuted, dim)
            output = ltorch.reshape(joined, tuple(bsym.output.shape))
    except FulmenError:
        return None
    cat, reshape = ctx.bsyms
    return [cat.replace(source=bsym.source), standing_in_for(reshape, output, bsym)]


@transform("cat before reshape")
def cat_before_reshape(trace: Trace) -> Trace:
    """`trace` with each cat of reshaped permutations written as one cat of the permuted
    tensors and one reshape (module docstring); `trace` itself when there is none."""
    cats = [b for b in trace.bsyms if b.sym in _CATS]
    if not cats:
        return trace
    producers = {p.name: b for b in trace.bsyms for p in b.proxy_outputs if isinstance(p, Proxy)}
    reads: dict[str, int] = {}
    for bsym in trace.bsyms:
        if not bsym.is_del:
            for name in {p.name for p in bsym.proxy_inputs}:
                reads[name] = reads.get(name, 0) + 1
    for name in trace.output_names:
        reads[name] = reads.get(name, 0) + 1
    names = reserved_names(trace.args, trace.bsyms)
    replaced: dict[int, list[BoundSymbol]] = {}
    dropped: set[int] = set()
    for bsym in cats:
        found = _permuted_parts(bsym, producers, reads)
        if found is None:
            continue
        permuted, dim, reshapes = found
        joined = _joined(bsym, permuted, dim, names)
        if joined is not None:
            replaced[id(bsym)] = joined
            dropped |= {id(r) for r in reshapes}
    if not replaced:
        return trace
    bsyms = []
    for bsym in trace.bsyms:
        if id(bsym) not in dropped:
            bsyms.extend(replaced.get(id(bsym), [bsym]))
    return trace.replace(bsyms=tuple(bsyms))
