"""`torch.autocast` regions inside traced code: the casts are traced explicitly.

Inside an autocast region eager casts some ops' floating inputs (matmuls to the low-precision
dtype, some reductions to float32, mixed-dtype joins to the widest type). Rather than copy
PyTorch's per-device op lists, the tracer asks PyTorch: the call is run once on fake tensors
(no storage, no compute) with autocast on and once with it off, and the `_to_copy` casts of the
call's own arguments that happen only with autocast on are the casts autocast applies. They are
recorded as ordinary `Tensor.to(dtype)` statements before the op, so the trace is exact and
needs no autocast state to run. An op PyTorch cannot run on fake tensors raises
`NotYetSupportedError` inside an autocast region instead of guessing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fulmen.core import FulmenError, NotYetSupportedError
from fulmen.core.source import user_source_location
from fulmen.ops.opaque import meta_overridden
from fulmen.proxies import TensorProxy

_TO_COPY = torch.ops.aten._to_copy.default


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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _TO_COPY and args and id(args[0]) in self.watched:
            dtype = kwargs.get("dtype")
            first = next(iter(self.casts.values()), dtype)
            if dtype is not None and dtype != args[0].dtype and dtype == first:
                self.casts.setdefault(self.watched[id(args[0])], dtype)
        return func(*args, **kwargs)


def _casts(func, args, kwargs, device_type: str, enabled: bool,
           kernel_may_fail: bool = False) -> dict[str, torch.dtype]:
    """The casts of the call's arguments logged while it runs on fake tensors, with autocast
    `enabled` or not. With `kernel_may_fail` (an op whose meta kernel refuses calls eager
    accepts), a failure of the call gives the casts logged before it: autocast casts the
    arguments before the call reaches the (meta) kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch._C.DisableTorchFunction(), FakeTensorMode():
        fakes: dict[str, torch.Tensor] = {}

        def fake(leaf):
            if not isinstance(leaf, TensorProxy):
                return leaf
            if leaf.name not in fakes:
                fakes[leaf.name] = torch.empty_strided(tuple(leaf.shape), tuple(leaf.stride()),
                                                       dtype=leaf.dtype, device=leaf.device)
            return fakes[leaf.name]

        fake_args, fake_kwargs = pytree.tree_map(fake, (args, kwargs))
        log = _CastLog({id(t): name for name, t in fakes.items()})
        with torch.autocast(device_type, enabled=enabled), log:
            try:
                func(*fake_args, **fake_kwargs)
            except Exception:
                if not kernel_may_fail:
                    raise
    return log.casts


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
            return _casts(func, args, kwargs, device_type, False)
        except Exception:
            return {}


def autocast_arguments(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`(args, kwargs)` with the casts autocast would apply to `func`'s tensor arguments
    recorded as `Tensor.to` statements (unchanged outside autocast or for unaffected ops).

    Raises:
        NotYetSupportedError: inside an autocast region, for an op PyTorch cannot run on fake
            tensors (so its autocast behaviour cannot be determined).
    """
    proxies = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, TensorProxy)]
    devices = {p.device.type for p in proxies if p.dtype.is_floating_point}
    active = [d for d in devices if torch.is_autocast_enabled(d)]
    if not active:
        return args, kwargs
    if len(devices) > 1:
        raise NotYetSupportedError("an op inside torch.autocast with tensors on several devices",
                                   op=getattr(func, "__name__", str(func)),
                                   where=user_source_location())
    try:
        if meta_overridden(func):
            with _quiet_fake_tensors():
                with_autocast = _casts(func, args, kwargs, active[0], True, kernel_may_fail=True)
        else:
            with_autocast = _casts(func, args, kwargs, active[0], True)
        without = _own_casts(func, args, kwargs, active[0]) if with_autocast else {}
    except FulmenError:
        raise
    except Exception as error:
        raise NotYetSupportedError(
            f"cannot tell which casts torch.autocast applies to this op: {error}",
            op=getattr(func, "__name__", str(func)), where=user_source_location(),
            hint="move the op out of the autocast region, or cast its inputs explicitly",
        ) from error
    casts = {name: dtype for name, dtype in with_autocast.items() if without.get(name) != dtype}
    if not casts:
        return args, kwargs
    converted: dict[str, TensorProxy] = {}

    def cast(leaf):
        if isinstance(leaf, TensorProxy) and leaf.name in casts:
            if leaf.name not in converted:
                converted[leaf.name] = leaf.to(casts[leaf.name])
            return converted[leaf.name]
        return leaf

    return pytree.tree_map(cast, (args, kwargs))


__all__ = ["autocast_arguments"]
