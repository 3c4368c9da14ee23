"""`torch.vmap` over traced tensors, emulated by broadcasting.

NOTE [vmap by broadcasting]: HF's attention masks with an `or`/`and` mask function (Gemma 3's
and Gemma 4's image and sliding masks, T5Gemma2, ESMC's packed sequences) are built with four
nested `torch.vmap`s of an index function `(b, h, q, kv) -> bool` over `arange`s. functorch's
batching runs below `__torch_function__` and knows no proxies, so such a call ran eagerly.
While tracing, `torch.vmap` (and `torch.func.vmap`) are replaced by `traced_vmap`, whose
functions, called on proxies, run the mapped function once on broadcast stand-ins instead:

- every value that depends on the active levels (a *batched* value) carries one leading axis
  per level, in level order (size 1 where it does not vary along that level), then its logical
  shape, the shape the mapped function sees under `vmap`;
- entering a level, the mapped argument's dim 0 becomes the new axis (after size-1 axes for the
  outer levels) and every batched argument not mapped there gains a size-1 axis for it;
- leaving it, the result's axis for the level is expanded to the level's size (`out_dims=0`:
  an unbatched result is broadcast, an expanded view as in eager).

Broadcasting computes what vmap computes only for some ops, so every torch call made inside
the mapped function is checked (`Emulation.call`): with a batched operand it must be an
elementwise map (its decomposition is elementwise prims and trailing broadcasts, as
`tracer.layout` tells) whose unbatched tensor operands have no more dims than the batched
operands' logical shapes (else they would align with the level axes), or an index of an
unbatched tensor by batched integer indices of logical shape `()`, one per dim (HF's
`padding_mask[b, kv]`), or a `Tensor.new_*` factory (unbatched); no op may draw random numbers
(vmap's default `randomness="error"` refuses them) and batched values' shape, size and strides
may not be read (their stand-ins' would answer). Anything else raises `VmapRefused`: the call
runs eagerly, as before.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys

import torch
import torch.utils._pytree as pytree

from fulmen.core import FulmenError, RunsEagerly, Tag, any_tagged, get_tracectx
from fulmen.core.proxy import iter_proxies
from fulmen.core.source import is_fulmens_own, user_source_location
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import known_same_shape
from fulmen.tracer.layout import is_elementwise_map
from fulmen.tracer.process_switch import ProcessSwitch

T = torch.Tensor

# metadata a batched value may answer: none of it depends on the shape
_SHAPE_FREE_METADATA = frozenset(
    [getattr(T, name).__get__ for name in (
        "dtype", "device", "requires_grad", "layout", "is_leaf", "is_cuda", "is_cpu", "is_meta",
        "is_sparse", "is_quantized", "itemsize", "grad_fn") if hasattr(T, name)]
    + [getattr(T, name) for name in (
        "is_floating_point", "is_complex", "is_signed", "element_size", "get_device",
        "__hash__") if hasattr(T, name)]
    + [torch.is_floating_point, torch.is_complex])
# factories on a tensor that read only its dtype and device: their results are unbatched
_NEW_FACTORIES = frozenset([T.new_ones, T.new_zeros, T.new_full, T.new_empty, T.new_tensor])


class MappedProxy(TensorProxy):
    """A proxy of a value an emulated vmap level maps (NOTE [vmap by broadcasting]): its
    `.shape` (a Python property of proxies, no torch call) is the stand-in's, so code other
    than fulmen's may not read it."""

    @property
    def shape(self) -> torch.Size:
        if get_tracectx() is not None and not is_fulmens_own(sys._getframe(1).f_code.co_filename):
            raise _refused("the mapped function reads a mapped tensor's shape", "Tensor.shape")
        return self._fulmen_meta[0]


class VmapRefused(RunsEagerly):
    """A `torch.vmap` over traced tensors that broadcasting does not emulate exactly (NOTE
    [vmap by broadcasting]): the call runs eagerly."""


def _refused(why: str, op: str = "torch.vmap") -> VmapRefused:
    return VmapRefused(f"torch.vmap over traced tensors: {why}", op=op,
                       where=user_source_location(),
                       hint="compile the function vmap maps instead, or build the values by "
                       "broadcasting")


class Emulation:
    """The vmap levels active in one trace: their sizes, and the depth of each batched proxy
    (by name)."""

    def __init__(self) -> None:
        self.sizes: list = []
        self.depth: dict[str, int] = {}
        self._internal = False
        self._indexing = False  # inside `apply`'s index (a mode that turns it back is refused)

    def checking(self) -> bool:
        """Whether torch calls are made inside a mapped function (and not by the emulation)."""
        return bool(self.sizes) and not self._internal

    @contextlib.contextmanager
    def internal(self):
        """The emulation's own calls (reshapes, expands) go unchecked."""
        before, self._internal = self._internal, True
        try:
            yield
        finally:
            self._internal = before

    def mark(self, proxy: TensorProxy, depth: int) -> TensorProxy:
        if depth:
            self.depth[proxy.name] = depth
            if type(proxy) is TensorProxy:
                proxy.__class__ = MappedProxy  # its `.shape` is refused to user code
        return proxy

    def metadata(self, func, args, caller) -> None:
        """Refuse a shape read of a batched value (its stand-in's shape is not vmap's) by code
        other than fulmen's (`caller`: the reading frame)."""
        if func not in _SHAPE_FREE_METADATA and args and isinstance(args[0], TensorProxy) \
                and args[0].name in self.depth and not is_fulmens_own(caller.f_code.co_filename):
            raise _refused("the mapped function reads a mapped tensor's shape",
                           op=getattr(func, "__name__", str(func)))

    def call(self, ctx, run, func, types, args, kwargs):
        """`run(func, types, args, kwargs)` (the tracer's route) for a torch call inside a
        mapped function, checked and its outputs marked (NOTE [vmap by broadcasting])."""
        op = getattr(func, "__name__", str(func))
        depth = len(self.sizes)
        batched = [p for p in iter_proxies((args, kwargs)) if p.name in self.depth]
        if any(self.depth[p.name] != depth for p in batched):
            raise _refused("a value mapped by an outer vmap is used inside an inner one", op)
        if func in _NEW_FACTORIES:
            return run(func, types, args, kwargs)
        if func is T.__getitem__ and batched:
            self._check_index(args, depth, op)
        elif batched:
            logical = max(p.ndim - depth for p in batched)
            if any(t.ndim > logical and not (isinstance(t, TensorProxy) and t.name in self.depth)
                   for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
                raise _refused("an unmapped tensor has more dims than the mapped values", op)
        scope = ctx.scopes[-1]
        start = len(scope)
        try:
            out = run(func, types, args, kwargs)
        except (FulmenError, RuntimeError, ValueError, TypeError, IndexError) as error:
            # the stand-ins may fail where vmap's values would not: eager decides
            raise _refused(f"the op fails on the broadcast stand-ins ({error})", op) from error
        recorded = scope[start:]
        if any_tagged(recorded, {Tag.RANDOM}):
            raise _refused("the mapped function draws random numbers", op)
        if not batched:
            return out
        if func is not T.__getitem__ and not all(is_elementwise_map(bsym) for bsym in recorded):
            raise _refused("the mapped function calls an op that is not elementwise", op)
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, TensorProxy):
                self.mark(leaf, depth)
        return out

    def apply(self, ctx, cls, args, kwargs):
        """An `autograd.Function` applied inside a mapped function: HF's `ModIndex` (what
        torch's `TransformGetItemToIndex` makes of `x[b, kv]`) as the index it computes; None
        for one without mapped arguments (recorded as usual); any other refused."""
        if not any(p.name in self.depth for p in iter_proxies((args, kwargs))):
            return None
        if cls.__name__ == "ModIndex" and cls.__module__.startswith("torch.") and not kwargs \
                and len(args) == 2 and isinstance(args[1], (list, tuple)) and not self._indexing:
            # as a torch call, so that the tracer's mode sees it and the calls it makes
            # internally do not (a torch function mode is off inside its own handler)
            self._indexing = True
            try:
                return args[0][tuple(args[1])]
            finally:
                self._indexing = False
        raise _refused(f"the mapped function applies the autograd.Function {cls.__name__}")

    def _check_index(self, args, depth: int, op: str) -> None:
        tensor, index = args[0], args[1] if len(args) > 1 else None
        items = index if type(index) is tuple else (index,)
        if not isinstance(tensor, TensorProxy) or tensor.name in self.depth \
                or len(items) != tensor.ndim or not all(
                    type(item) is int or _integer_index(item, self.depth, depth)
                    for item in items):
            raise _refused("the mapped function indexes other than an unmapped tensor by one "
                           "mapped integer index per dim", op)


def _integer_index(item, batched: dict, depth: int) -> bool:
    """A mapped integer tensor of logical shape `()`, or an unmapped 0-dim one."""
    return isinstance(item, TensorProxy) and not item.dtype.is_floating_point \
        and not item.dtype.is_complex and item.dtype is not torch.bool \
        and item.ndim == (depth if item.name in batched else 0)


def _emulation(ctx) -> Emulation:
    emulation = getattr(ctx, "vmap_emulation", None)
    if emulation is None:
        emulation = ctx.vmap_emulation = Emulation()
    return emulation


def _enter(emulation: Emulation, args: tuple, in_dims, depth: int):
    """The arguments of the mapped function at level `depth + 1`, and the level's size."""
    dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
    if len(dims) != len(args):
        raise _refused("in_dims does not match the arguments")
    size, entered = None, []
    for arg, dim in zip(args, dims):
        batched = isinstance(arg, TensorProxy) and arg.name in emulation.depth
        if batched and emulation.depth[arg.name] != depth:
            raise _refused("a value mapped by an outer vmap is passed to an inner one")
        if dim is None:
            entered.append(emulation.mark(arg.unsqueeze(depth), depth + 1) if batched else arg)
            continue
        if dim != 0 or not isinstance(arg, TensorProxy) or arg.ndim == (depth if batched else 0):
            raise _refused("only in_dims of 0 over a dim of a tensor, or None, are emulated")
        # a new proxy for the level (the argument itself keeps its meaning outside it)
        arg = arg.reshape((() if batched else (1,) * depth) + tuple(arg.shape))
        n = arg.shape[depth]
        if size is not None and not known_same_shape((n,), (size,)):
            raise _refused("the mapped dims differ in size (or may)")
        size = n if size is None else size
        entered.append(emulation.mark(arg, depth + 1))
    if size is None:
        raise _refused("no argument is mapped")
    return entered, size


def _leave(emulation: Emulation, leaf, depth: int, size):
    """The result of a level (`out_dims=0`), laid out for level `depth`."""
    if not isinstance(leaf, TensorProxy):
        raise _refused("the mapped function returns something other than tensors")
    if leaf.name not in emulation.depth:  # the same for every index: broadcast along the level
        leaf = leaf.reshape((1,) * (depth + 1) + tuple(leaf.shape))
    elif emulation.depth[leaf.name] != depth + 1:
        raise _refused("the mapped function returns a value of another vmap level")
    sizes = list(leaf.shape)
    sizes[depth] = size
    leaf = leaf.expand(sizes)
    return emulation.mark(leaf, depth)


def _emulate(ctx, func, in_dims, args):
    emulation = _emulation(ctx)
    depth = len(emulation.sizes)
    with emulation.internal():
        entered, size = _enter(emulation, args, in_dims, depth)
    emulation.sizes.append(size)
    try:
        out = func(*entered)
    finally:
        emulation.sizes.pop()
    with emulation.internal():
        return pytree.tree_map(lambda leaf: _leave(emulation, leaf, depth, size), out)


def _traced_vmap(original):
    """`torch.vmap` whose functions, called on proxies while tracing, are emulated."""

    @functools.wraps(original)
    def vmap(func, in_dims=0, out_dims=0, randomness="error", *, chunk_size=None):
        eager = original(func, in_dims, out_dims, randomness, chunk_size=chunk_size)

        @functools.wraps(func)
        def call(*args, **kwargs):
            ctx = get_tracectx()
            if ctx is None or not any(isinstance(leaf, TensorProxy)
                                      for leaf in pytree.tree_leaves((args, kwargs))):
                return eager(*args, **kwargs)
            if kwargs or out_dims != 0 or chunk_size is not None:
                raise _refused("only positional arguments, out_dims=0 and no chunk_size are "
                               "emulated")
            return _emulate(ctx, func, in_dims, args)

        return call

    vmap.fulmen_emulates = True
    return vmap


_PLACES = (("torch", "vmap"), ("torch.func", "vmap"))
_originals: dict[tuple[str, str], object] = {}


def _replace() -> None:
    for where in _PLACES:
        module = importlib.import_module(where[0])
        current = getattr(module, where[1])
        if not getattr(current, "fulmen_emulates", False):
            _originals[where] = current
            setattr(module, where[1], _traced_vmap(current))


def _restore() -> None:
    for where, original in _originals.items():
        module = importlib.import_module(where[0])
        if getattr(getattr(module, where[1]), "fulmen_emulates", False):
            setattr(module, where[1], original)
    _originals.clear()


_SWITCH = ProcessSwitch(_replace, _restore)


def vmap_emulated() -> ProcessSwitch:
    """The context manager replacing `torch.vmap` and `torch.func.vmap` by `_traced_vmap`
    around a trace (NOTE [vmap by broadcasting])."""
    return _SWITCH


__all__ = ["Emulation", "VmapRefused", "vmap_emulated"]
