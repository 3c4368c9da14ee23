"""Helpers shared by meta functions: proxies <-> PyTorch meta tensors.

Where an op's output shape rules are intricate (matmul, convolution, pad, indexing, every opaque
op) the meta function runs PyTorch's own meta kernel on storage-less `device="meta"` tensors and
reads the result's metadata. PyTorch is the reference for shapes, so this is exact.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from fulmen.proxies import TensorProxy


def to_meta(value: Any) -> Any:
    """Replace every tensor (proxy or real) inside `value` by a meta tensor of the same metadata."""

    def convert(leaf):
        if isinstance(leaf, torch.Tensor):
            return torch.empty_strided(
                tuple(leaf.shape), tuple(leaf.stride()), dtype=leaf.dtype, device="meta"
            )
        return leaf

    return pytree.tree_map(convert, value)


def from_meta(value: Any, device: torch.device) -> Any:
    """Replace every meta tensor inside `value` by a new proxy on `device`."""

    def convert(leaf):
        if isinstance(leaf, torch.Tensor):
            proxy = TensorProxy(None, leaf.shape, leaf.dtype, device, strides=leaf.stride())
            proxy._fulmen_exact_strides = True  # PyTorch's own meta kernel chose them
            return proxy
        return leaf

    return pytree.tree_map(convert, value)


def first_device(*values: Any) -> torch.device:
    """The device of the first tensor in `values` (cpu when there is none)."""
    for leaf in pytree.tree_leaves(values):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def _call_on_meta(fn, args, kwargs) -> tuple[Any, torch.device]:
    """`fn` run on meta versions of the arguments, and the device its outputs stand for (see
    `run_meta`)."""
    has_tensor = any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves((args, kwargs)))
    device = first_device(args, kwargs)
    if kwargs.get("device") is not None:
        device = torch.device(kwargs["device"])
        kwargs = {**kwargs, "device": "meta"}
    elif not has_tensor:
        device = torch.get_default_device()
        kwargs = {**kwargs, "device": "meta"}
    with _fake_mode((args, kwargs)):
        meta_args, meta_kwargs = to_meta((args, kwargs))
        with torch._C.DisableTorchFunction(), torch.no_grad():
            return fn(*meta_args, **meta_kwargs), device


# Ops whose meta kernel does not give eager's layout but whose `FakeTensorMode` rule does.
_DEVICE_LAYOUT_OPS = frozenset({F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d,
                                F.conv_transpose2d, F.conv_transpose3d, torch.convolution, F.pad})
_device_fake_mode = None


def _call_on_fake(fn, args, kwargs) -> Any:
    """`fn` run on fake tensors of the arguments' own devices.

    NOTE [convolution layout]: PyTorch's meta kernel lays a convolution's output out
    contiguously, but eager's CPU kernels give a channels_last output when the input *or the
    weight* suggests channels_last (a model converted with `.to(memory_format=...)`), as CUDA's
    do; `FakeTensorMode` asks the same backend-selection code as eager, so its output strides
    are eager's. Likewise `F.pad`'s reflect and replicate modes keep a channels_last input's
    layout in eager and under `FakeTensorMode` (PyTorch's decomposition), not in the meta kernel.
    """
    global _device_fake_mode
    if _device_fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        _device_fake_mode = FakeTensorMode()

    def convert(leaf):
        if isinstance(leaf, torch.Tensor):
            return torch.empty_strided(tuple(leaf.shape), tuple(leaf.stride()),
                                       dtype=leaf.dtype, device=leaf.device)
        return leaf

    with torch._C.DisableTorchFunction(), torch.no_grad(), _device_fake_mode:
        fake_args, fake_kwargs = pytree.tree_map(convert, (args, kwargs))
        return fn(*fake_args, **fake_kwargs)
    batched = tuple(input.shape) if input.dim() == 4 else (1, *input.shape)
    moved = torch.empty(batched, dtype=input.dtype, device="meta",
                        memory_format=torch.channels_last)
    moved = moved if input.dim() == 4 else moved.squeeze(0)
    if args:
        args[0] = moved
    else:
        kwargs = {**kwargs, "input": moved}
    return tuple(args), kwargs


def _fake_mode(value: Any):
    """PyTorch's `FakeTensorMode` for the symbolic sizes inside `value` (plain meta tensors
    cannot hold them; see `fulmen.tracer.symbolic`), else a no-op context."""
    for leaf in pytree.tree_leaves(value):
        sizes = leaf.shape if isinstance(leaf, torch.Tensor) else (leaf,)
        for size in sizes:
            if isinstance(size, torch.SymInt):
                env = size.node.shape_env
                mode = getattr(env, "_fulmen_fake_mode", None)
                if mode is None:
                    from torch._subclasses.fake_tensor import FakeTensorMode

                    mode = env._fulmen_fake_mode = FakeTensorMode(shape_env=env)
                return mode
    return contextlib.nullcontext()


def run_meta(fn, *args, **kwargs) -> Any:
    """Run `fn` on meta versions of the arguments; return proxies for its tensor outputs.

    The outputs live on the device of the first tensor argument, or the `device=` argument, or
    (for a factory called with neither) the default device. Factories run with `device="meta"`,
    so nothing is allocated and no random number is drawn.
    """
    out, device = _call_on_meta(fn, args, kwargs)
    if fn in _DEVICE_LAYOUT_OPS and not _has_symbolic_sizes((args, kwargs)):
        out = _call_on_fake(fn, args, kwargs)  # NOTE [convolution layout]
    return from_meta(out, device)


class _Uncacheable(Exception):
    pass


_ATOMS = (int, float, bool, complex, str, type(None), type(Ellipsis), torch.dtype, torch.device,
          torch.memory_format, torch.layout)


def _layout_key(value: Any) -> Any:
    """A hashable description of an argument, as far as a meta kernel can see it."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.stride(), value.dtype, value.device)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_layout_key(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _layout_key(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return (slice, _layout_key(value.start), _layout_key(value.stop), _layout_key(value.step))
    if type(value) in _ATOMS:
        return (type(value), value)
    raise _Uncacheable


# (callable, arguments' key) -> eager_layouts' answer; repeated layers hit it
_LAYOUTS: dict[Any, Any] = {}
_LAYOUTS_LIMIT = 8192


def eager_layouts(fn, args, kwargs) -> list[tuple[torch.Size, tuple[int, ...]]] | None:
    """(shape, strides) of each tensor `fn(*args, **kwargs)` returns in eager, in pytree leaf
    order, from PyTorch's meta kernel; None when the meta kernel cannot describe the call.

    Used where fulmen's decomposition gives the shape but PyTorch decides the layout (see
    NOTE [layout truth] in `fulmen.tracer.dispatch`). Answers are cached by the arguments'
    metadata and values (meta kernels see nothing else). Warnings are silenced: the op is
    described here, not run.
    """
    try:
        with torch._C.DisableTorchFunctionSubclass():
            key = (fn, _layout_key(args), _layout_key(kwargs))
        hash(key)
    except (_Uncacheable, TypeError):
        key = None
    if key is not None and key in _LAYOUTS:
        return _LAYOUTS[key]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if fn in _DEVICE_LAYOUT_OPS and not _has_symbolic_sizes((args, kwargs)):
                out = _call_on_fake(fn, args, kwargs)
            else:
                out, _ = _call_on_meta(fn, args, kwargs)
        layouts = [(leaf.shape, leaf.stride()) for leaf in pytree.tree_leaves(out)
                   if isinstance(leaf, torch.Tensor)]
    except Exception:  # no meta kernel, a value-dependent op, a device transfer, ...
        layouts = None
    if key is not None:
        if len(_LAYOUTS) >= _LAYOUTS_LIMIT:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layouts
    return layouts


def _has_symbolic_sizes(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) and not all(type(n) is int for n in leaf.shape)
               for leaf in pytree.tree_leaves(value))


def with_strides(proxy: TensorProxy, strides) -> TensorProxy:
    """A proxy for the same value as `proxy` (same name and metadata) that reports `strides`,
    marked exact (PyTorch chose them). Proxies keep their strides in C++ and cannot be
    restrided in place beyond their storage, hence a new object."""
    new = TensorProxy(proxy.name, proxy.shape, proxy.dtype, proxy.device, strides=strides,
                      requires_grad=proxy.requires_grad)
    new.__dict__.update(proxy.__dict__)
    new._fulmen_exact_strides = True
    return new
