"""Helpers shared by meta functions: proxies <-> PyTorch meta tensors.

Where an op's output shape rules are intricate (matmul, convolution, pad, indexing, every opaque
op) the meta function runs PyTorch's own meta kernel on storage-less `device="meta"` tensors and
reads the result's metadata. PyTorch is the reference for shapes, so this is exact.
"""

from __future__ import annotations

from typing import Any

import torch
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


def run_meta(fn, *args, **kwargs) -> Any:
    """Run `fn` on meta versions of the arguments; return proxies for its tensor outputs.

    The outputs live on the device of the first tensor argument, or the `device=` argument, or
    (for a factory called with neither) the default device. Factories run with `device="meta"`,
    so nothing is allocated and no random number is drawn.
    """
    has_tensor = any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves((args, kwargs)))
    device = first_device(args, kwargs)
    if kwargs.get("device") is not None:
        device = torch.device(kwargs["device"])
        kwargs = {**kwargs, "device": "meta"}
    elif not has_tensor:
        device = torch.get_default_device()
        kwargs = {**kwargs, "device": "meta"}
    meta_args, meta_kwargs = to_meta((args, kwargs))
    with torch._C.DisableTorchFunction(), torch.no_grad():
        out = fn(*meta_args, **meta_kwargs)
    return from_meta(out, device)
