"""Eager results of PyTorch's inference fast paths that a trace cannot take.

`nn.TransformerEncoder` in eval mode, called with a key padding mask and without grad, runs
its layers on a nested tensor and pads the result back with zeros: every position the mask pads
holds 0 (the final norm, if any, then sees those zeros). Traced with proxies its `forward` takes
the regular path (a proxy has `__torch_function__`, which the fast path refuses), and that path
computes the padded positions like any other row, so the compiled result differed from eager
there (torch.compile differs the same way). While tracing, a forward hook on each encoder
replaces those positions as eager's fast path leaves them, under the conditions of PyTorch's own
`TransformerEncoder.forward` (its `why_not_sparsity_fast_path` checks). Elsewhere the fast paths
(`MultiheadAttention`, `TransformerEncoderLayer`, `TransformerDecoderLayer`) give the regular
path's values, and nothing is changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_KEY = "fulmen.nested_padding"  # the hooks' key in the module's hook dicts (no handle)
_DEVICES = ("cpu", "cuda", "xpu")


def _argument(args: tuple, kwargs: dict, position: int, name: str):
    return args[position] if len(args) > position else kwargs.get(name)


def _takes_nested_path(encoder: torch.nn.TransformerEncoder, src, mask, padded) -> bool:
    """Whether eager's `encoder.forward(src, mask, src_key_padding_mask=...)` converts `src` to
    a nested tensor, `padded` being the positions that mask pads (PyTorch 2.x's conditions, in
    its order; the left-alignment check reads the mask's values, a graph break with a guard
    when traced)."""
    first = encoder.layers[0]
    if not (torch.backends.mha.get_fastpath_enabled() and getattr(encoder, "use_nested_tensor",
                                                                  False)):
        return False
    if first.training or src.dim() != 3 or padded is None or mask is not None:
        return False
    if torch.is_autocast_enabled() or src.device.type not in _DEVICES:
        return False
    weights = (first.self_attn.in_proj_weight, first.self_attn.in_proj_bias,
               first.self_attn.out_proj.weight, first.self_attn.out_proj.bias,
               first.norm1.weight, first.norm1.bias, first.norm2.weight, first.norm2.bias,
               first.linear1.weight, first.linear1.bias, first.linear2.weight,
               first.linear2.bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (src, *weights)):
        return False
    if getattr(encoder, "mask_check", True):
        return bool(torch._nested_tensor_from_mask_left_aligned(src, padded.logical_not()))
    return True


def _padded(padding: torch.Tensor) -> torch.Tensor:
    """The positions a key padding mask pads (True, or a nonzero additive value)."""
    return padding if padding.dtype == torch.bool else padding != 0


def _zero_padded_positions(encoder, args, kwargs, output):
    src = _argument(args, kwargs, 0, "src")
    mask = _argument(args, kwargs, 1, "mask")
    padding = _argument(args, kwargs, 2, "src_key_padding_mask")
    padded = _padded(padding) if padding is not None else None
    if not isinstance(output, torch.Tensor) or not _takes_nested_path(encoder, src, mask,
                                                                       padded):
        return None
    filler = output.new_zeros(output.shape[-1])
    if encoder.norm is not None:
        filler = encoder.norm(filler)
    return torch.where(padded.unsqueeze(-1), filler, output)


@contextlib.contextmanager
def eager_fast_paths(module: torch.nn.Module | None) -> Iterator[None]:
    """While tracing `module`: each `nn.TransformerEncoder` inside it gives eager's fast-path
    result (zeros where the key padding mask pads). The hooks are put into the modules' hook
    dicts directly and taken out after, so hook watchers see no change."""
    encoders = [sub for sub in module.modules()
                if isinstance(sub, torch.nn.TransformerEncoder)] if module is not None else []
    for encoder in encoders:
        encoder._forward_hooks[_KEY] = _zero_padded_positions
        encoder._forward_hooks_with_kwargs[_KEY] = True
    try:
        yield
    finally:
        for encoder in encoders:
            encoder._forward_hooks.pop(_KEY, None)
            encoder._forward_hooks_with_kwargs.pop(_KEY, None)
