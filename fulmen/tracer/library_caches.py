"""Caches a library keeps between calls are set aside while the tracer runs the user's code.

NOTE [library caches]: `torch.nn.utils.parametrize.cached()` keeps each parametrized tensor
(`module.weight` of a weight-normed or orthogonal layer) in a module-level dict for the length
of the block, so a forward called twice inside it computes the parametrization once. A trace
made inside such a block found the real tensor the cache held (computed before the trace, with
its own autograd graph) and captured it as a constant input: every later call read that first
tensor, whatever the parameters had become since (an optimizer step), and backpropagated into
its spent graph. The cache is keyed by no guard, so the tracer runs the code with parametrize's
cache empty and off: the parametrization is traced from its parameters (the same values: it is
a function of them), and a `cached()` block the traced code enters itself works on a dict of its
own. The library's dict and counter are put back afterwards, unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn.utils.parametrize as parametrize


@contextlib.contextmanager
def library_caches_set_aside() -> Iterator[None]:
    """While active, `torch.nn.utils.parametrize`'s cache is empty and off (NOTE [library
    caches]); on exit the caller's cache and `cached()` depth are back."""
    cache, depth = parametrize._cache, parametrize._cache_enabled
    parametrize._cache, parametrize._cache_enabled = {}, 0
    try:
        yield
    finally:
        parametrize._cache, parametrize._cache_enabled = cache, depth
