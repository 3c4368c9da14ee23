"""`torch.autocast` regions inside traced code: the casts are traced explicitly.

Inside an autocast region eager casts some ops' floating inputs (matmuls to the low-precision
dtype, some reductions to float32, mixed-dtype joins to the widest type). Rather than copy
PyTorch's per-device op lists, the tracer asks PyTorch: the call is run once on fake tensors
(no storage, no compute) with autocast on and once with it off, and the `_to_copy` casts of the
call's own arguments that happen only with autocast on are the casts autocast applies. They are
recorded as ordinary `Tensor.to(dtype)` statements before the op, so the trace is exact and
needs no autocast state to run.

An op autocast reaches inside (a composite op whose kernel calls `linear` or `bmm` on tensors
it makes: `torch.gru`, `F.multi_head_attention_forward`, `torch.einsum`) is told apart by a
third fake run: the op on its arguments cast as recorded, autocast off. Where that run raises,
or its kernels see other dtypes than with autocast on, the call is recorded whole, to run inside
`torch.autocast` (NOTE [autocast inside an op] in `fulmen.ops.opaque_autocast`); so is a call
PyTorch cannot run on fake tensors at all (a packed-sequence RNN), rather than guessing.

NOTE [autocast's cast cache]: eager casts a float32 leaf that requires grad (a parameter) to
the low-precision dtype once per autocast region (its cast cache, while
`torch.is_autocast_cache_enabled()`), so the gradients of the ops that read the weight are added
in that dtype before the cast's backward widens them once; cast per op, they were widened each
and added in float32 (a bfloat16 gradient apart). The tracer keeps such casts per region in
`TracerCtx.autocast_casts` (cleared by the first op traced outside autocast) and reuses them;
the leaves are the traced module's parameters and the captured leaf tensors requiring grad
(an argument's leafness is not in the cache key: its casts stay per op).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
from torch.utils._python_dispatch import TorchDispatchMode

from fulmen.core import FulmenError, NotYetSupportedError
from fulmen.core.source import user_source_location
from fulmen.ops.meta import fake_run
from fulmen.ops.opaque import meta_overridden
from fulmen.ops.opaque_autocast import under_autocast
from fulmen.proxies import TensorProxy

_TO_COPY = torch.ops.aten._to_copy.default
_get_dtype = torch.get_autocast_dtype


class _CastLog(TorchDispatchMode):
    """Records `_to_copy(arg, dtype=...)` calls made on the watched tensors.

    Autocast casts an op's arguments to one dtype (the low-precision one, float32, or the
    widest), before the op's kernel runs; a cast to another dtype comes from the kernel itself
    and is not recorded (CPU attention with dropout runs its math backend, which upcasts a
    bfloat16 value to float32 internally: taken for autocast's, it cast the value of an
    attention whose query and key autocast casts to bfloat16 back to float32)."""

    def __init__(self, watched: dict[int, str]) -> None:
        super().__init__()
        self.watched = watched
        self.casts: dict[str, torch.dtype] = {}
        self.late_copies = 0  # `_to_copy` calls after the first kernel, on any tensor
        self.unfinished = False  # the run stopped at a kernel that needs values
        # every other call that makes tensors, with the dtypes of its tensor arguments and
        # results (not the queries autocast itself makes: `prim.device`)
        self.kernels: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _TO_COPY:
            self.late_copies += bool(self.kernels)
            if args and id(args[0]) in self.watched:
                dtype = kwargs.get("dtype")
                first = next(iter(self.casts.values()), dtype)
                if dtype is not None and dtype != args[0].dtype and dtype == first:
                    self.casts.setdefault(self.watched[id(args[0])], dtype)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        made = _dtypes(out)
        if made:
            self.kernels.append((func, _dtypes((args, kwargs)), made))
        return out


def _dtypes(tree) -> tuple:
    return tuple(t.dtype for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


# fake tensors' answer for a kernel whose output shape depends on values
_SHAPE_FROM_VALUES = (DynamicOutputShapeException, DataDependentOutputException)


def _run(func, args, kwargs, device_type: str, enabled: bool, kernel_may_fail: bool = False,
         casts: dict[str, torch.dtype] | None = None) -> _CastLog:
    """The log of the call run on fake tensors, with autocast `enabled` or not, on the arguments
    cast to `casts` (by name) first. With `kernel_may_fail` (an op whose meta kernel refuses
    calls eager accepts), a failure of the call gives the casts logged before it: autocast casts
    the arguments before the call reaches the (meta) kernel.

    In `fake_run` (`fulmen.ops.meta`), outside inference mode: there the fake mode gets a
    composite op whole (`aten.gru.input`: autograd's keys, where it decomposes, are skipped),
    where eager's CPU kernel decomposes it and autocast casts inside; the run saw no cast and
    the GRU ran in float32."""
    with fake_run():
        fakes: dict[str, torch.Tensor] = {}

        def fake(leaf):
            if not isinstance(leaf, TensorProxy):
                return leaf
            if leaf.name not in fakes:
                fakes[leaf.name] = torch.empty_strided(tuple(leaf.shape), tuple(leaf.stride()),
                                                       dtype=leaf.dtype, device=leaf.device)
                if casts and leaf.name in casts:
                    fakes[leaf.name] = fakes[leaf.name].to(casts[leaf.name])
            return fakes[leaf.name]

        fake_args, fake_kwargs = pytree.tree_map(fake, (args, kwargs))
        log = _CastLog({id(t): name for name, t in fakes.items()})
        with torch.autocast(device_type, enabled=enabled), log:
            try:
                func(*fake_args, **fake_kwargs)
            except _SHAPE_FROM_VALUES:
                # the first kernel needs values (`_ctc_loss`): autocast, which casts before any
                # kernel, has logged its casts; later kernels are not known (`unfinished`)
                if log.kernels and not kernel_may_fail:
                    raise
                log.unfinished = True
            except Exception:
                if not kernel_may_fail:
                    raise
    return log


@contextlib.contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """The fake tensor module's error log off: it logs each meta kernel failure, which here
    is an expected answer."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def _own_casts(func, args, kwargs, device_type: str) -> dict[str, torch.dtype]:
    """The casts `func` makes without autocast; none when it cannot run without autocast's
    casts (mixed dtypes such as a float32 bias with bfloat16 operands: eager runs it only
    because autocast casts them alike)."""
    with _quiet_fake_tensors():
        try:
            return _run(func, args, kwargs, device_type, False).casts
        except Exception:
            return {}


# Ops whose kernel calls an op autocast casts below the Python dispatch key, where a fake run
# does not see it: `torch.bilinear`'s `_trilinear` kernel calls `bmm`, which autocast runs in
# bfloat16, and returns float32 (values off by ~3e-2 when its arguments were only cast).
_KERNELS_AUTOCAST_REACHES = frozenset({torch.bilinear, torch._trilinear})


def _reaches_inside(func, args, kwargs, device_type: str, on: _CastLog,
                    casts: dict[str, torch.dtype]) -> bool:
    """Whether autocast acts inside the call, not only on its arguments: run on the arguments
    cast as recorded with autocast off, it raises, or its kernels see other dtypes than in
    `on` (the run with autocast on). Autocast acts only by casting (`_to_copy`), and casts
    made before the first kernel are of the arguments (recorded), so a run with no cast after
    a kernel cannot have been changed inside (linear, matmul: no third run)."""
    if func in _KERNELS_AUTOCAST_REACHES:
        return True
    if not on.late_copies or on.unfinished:
        return False
    try:
        with _quiet_fake_tensors():
            off = _run(func, args, kwargs, device_type, False, casts=casts)
    except Exception:
        return True
    return off.kernels != on.kernels


def _cached_leaves(ctx) -> frozenset[str]:
    """The proxies whose autocast casts eager caches (NOTE [autocast's cast cache]): the traced
    module's parameters and the captured leaf tensors, where they require grad."""
    names = [proxy.name for proxy in ctx.state_proxies.values() if proxy.requires_grad]
    names += [proxy.name for tensor, proxy in ctx.captured.values()
              if tensor.is_leaf and tensor.requires_grad]
    return frozenset(names)


def autocast_call(func, args: tuple, kwargs: dict, ctx=None) -> tuple[object, tuple, dict]:
    """`(func, args, kwargs)` with the casts autocast would apply to `func`'s tensor arguments
    recorded as `Tensor.to` statements (unchanged outside autocast or for unaffected ops); for
    an op autocast reaches inside, `func` made to run inside autocast instead (`under_autocast`),
    with the arguments unchanged.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):  # while tracing, on proxies
        ...     autocast_call(F.linear, (x, w), {})  # (F.linear, (x.to(bf16), w.to(bf16)), {})
        ...     autocast_call(torch.gru, gru_args, {})  # (under_autocast(torch.gru, ...), ...)

    An op PyTorch cannot run on fake tensors is run whole inside autocast too (its meta then
    fails alike, and the tracer takes a graph break or raises, as for any op it cannot describe).
    With `ctx` (the `TracerCtx`), casts of leaves eager caches are reused within the region
    (NOTE [autocast's cast cache]).

    Raises:
        NotYetSupportedError: an op inside autocast on tensors of several devices, or one whose
            fake run with autocast succeeds and whose later fake runs fail.
    """
    proxies = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, TensorProxy)]
    devices = {p.device.type for p in proxies if p.dtype.is_floating_point}
    active = [d for d in devices if torch.is_autocast_enabled(d)]
    if not active:
        return func, args, kwargs
    if len(devices) > 1:
        raise NotYetSupportedError("an op inside torch.autocast with tensors on several devices",
                                   op=getattr(func, "__name__", str(func)),
                                   where=user_source_location())
    device_type = active[0]
    overridden = meta_overridden(func)
    cache_enabled = torch.is_autocast_cache_enabled()
    try:
        if overridden:
            with _quiet_fake_tensors():
                on = _run(func, args, kwargs, device_type, True, kernel_may_fail=True)
        else:
            try:
                with _quiet_fake_tensors():
                    on = _run(func, args, kwargs, device_type, True)
            except Exception:
                # fake tensors cannot run it (a packed-sequence RNN reads values): the call
                # runs whole inside autocast, described by a graph break where need be
                return under_autocast(func, device_type, _get_dtype(device_type),
                                      cache_enabled), args, kwargs
        with_autocast = on.casts
        without = _own_casts(func, args, kwargs, device_type) if with_autocast else {}
        casts = {name: dtype for name, dtype in with_autocast.items() if without.get(name) != dtype}
        if not overridden and _reaches_inside(func, args, kwargs, device_type, on, casts):
            run = under_autocast(func, device_type, _get_dtype(device_type), cache_enabled)
            return run, args, kwargs
    except FulmenError:
        raise
    except Exception as error:
        raise NotYetSupportedError(
            f"cannot tell which casts torch.autocast applies to this op: {error}",
            op=getattr(func, "__name__", str(func)), where=user_source_location(),
            hint="move the op out of the autocast region, or cast its inputs explicitly",
        ) from error
    if not casts:
        return func, args, kwargs
    converted: dict[str, TensorProxy] = {}
    cached = ctx.autocast_casts if ctx is not None and cache_enabled else None
    leaves = _cached_leaves(ctx) if cached is not None else frozenset()
    low = _get_dtype(device_type)

    def cast(leaf):
        if isinstance(leaf, TensorProxy) and leaf.name in casts:
            if leaf.name not in converted:
                dtype = casts[leaf.name]
                if leaf.name in leaves and dtype == low and leaf.dtype == torch.float32:
                    key = (leaf.name, dtype, torch.is_grad_enabled())  # (a no_grad cast: its own)
                    if key not in cached:
                        cached[key] = leaf.to(dtype)
                    converted[leaf.name] = cached[key]
                else:
                    converted[leaf.name] = leaf.to(dtype)
            return converted[leaf.name]
        return leaf

    args, kwargs = pytree.tree_map(cast, (args, kwargs))
    return func, args, kwargs


__all__ = ["autocast_call"]
