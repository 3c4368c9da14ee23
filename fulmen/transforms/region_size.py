"""The size policy of fusion regions: which CPU regions are too small to fuse (`TINY_REGION`,
`is_tiny_region`), asked by `fulmen.transforms.fusion` of every region it would emit."""

from __future__ import annotations

import math
from collections.abc import Sequence

from fulmen import config
from fulmen.core import BoundSymbol
from fulmen.core.proxy import iter_proxies
from fulmen.proxies.tensor import shape_env_memo

TINY_REGION = (4, 16384)
"""(torch ops, elements): a CPU region that would run as at most this many torch statements,
none of whose tensors has more than this many elements, stays on torch (`is_tiny_region`).
Chosen from `benchmarks/overhead.py --regions` (CPU time per call, 1 thread, chains of k
elementwise ops on n elements, codegen minus torch executor): a region call costs about 6.3 µs
more than one torch op (1.5 µs each), so up to 4 ops (+1.2 to +3.7 µs) are cheaper on torch
below 16384 elements, 6 ops win (-5 µs at 64 elements); at 65536 elements 2 ops already win
(-3.3 µs: the kernel saves memory traffic and allocations). `FULMEN_FUSE_TINY=1` fuses every
region (the codegen tests use it to check kernels on small tensors)."""


def is_tiny_region(region: Sequence[BoundSymbol], torch_ops: int) -> bool:
    """Whether a fusion region is too small to beat torch's dispatch of its `torch_ops`
    statements (see `TINY_REGION`): only CPU regions, since a CUDA kernel launch costs as much
    as a torch op's."""
    max_ops, max_numel = TINY_REGION
    if torch_ops > max_ops or config.get("FULMEN_FUSE_TINY") == 1:
        return False
    for bsym in region:
        for proxy in iter_proxies((bsym.args, bsym.output)):
            device = getattr(proxy, "device", None)
            if device is None:
                continue
            if device.type != "cpu" or not _numel_at_most(proxy.shape, max_numel):
                return False
    return True


def _numel_at_most(shape, limit: int) -> bool:
    """`_at_most` of the element count of `shape`; with symbolic sizes kept by the ShapeEnv
    (NOTE [answers kept by the ShapeEnv]: the partition asks it of every tensor of every
    candidate region, each a SymInt product and a sympy comparison)."""
    if all(type(size) is int for size in shape):
        return math.prod(shape) <= limit
    hints = [size if type(size) is int else size.node._hint for size in shape]
    if all(hint is not None for hint in hints):
        # what `_at_most` answers (an answer known for every size holds at the traced ones),
        # from the sizes' traced values: no SymInt product, no sympy
        return math.prod(hints) <= limit
    memo, key = shape_env_memo(shape, "_fulmen_numel_at_most")
    if key is not None and (key, limit) in memo:
        return memo[key, limit]
    answer = _at_most(math.prod(shape), limit)
    if key is not None:
        memo[key, limit] = answer
    return answer


def _at_most(numel, limit: int) -> bool:
    """`numel <= limit`. A symbolic `numel` is compared at the traced sizes
    (`optimization_hint`: no guard, so the trace stays valid for every size; only whether the
    region is fused follows the sizes it was traced with), unless the ShapeEnv knows the answer
    for every size."""
    if isinstance(numel, int):
        return numel <= limit
    from torch.fx.experimental.symbolic_shapes import optimization_hint, statically_known_true

    if statically_known_true(numel <= limit):
        return True
    return not statically_known_true(numel > limit) and optimization_hint(numel) <= limit
