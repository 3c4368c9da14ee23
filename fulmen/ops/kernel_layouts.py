"""Eager's output strides where a CPU kernel, not the meta kernel, decides them: a convolution's
memory format (`convolution_strides`, NOTE [convolution layout]) and the flash attention
kernel's query-like output (`attention_strides`); asked of PyTorch's own backend choice on
uninitialised stand-ins."""

from __future__ import annotations

import torch
from torch._prims_common import suggest_memory_format

from fulmen.ops.meta import _fake_mode
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import known_same_shape, size_hints


def convolution_strides(input, weight, shape, stride, padding, dilation, groups: int,
                        transposed: bool = False, output_padding=None):
    """Eager's strides for a convolution's output of `shape` on CPU, or None elsewhere
    (`transposed`: a transposed convolution, with its `output_padding`).

    NOTE [convolution layout]: PyTorch's meta kernel lays a convolution's output out
    contiguously, but eager picks a backend and the backend a memory format: on CPU
    channels_last when the input *or the weight* suggests it (a model converted with
    `.to(memory_format=...)` fed a contiguous batch). The same C++ functions eager calls
    answer here, on uninitialised CPU tensors of the arguments' layouts (no page is touched).
    """
    if input.device.type != "cpu" or weight.dim() not in (4, 5):
        return None
    # NOTE [convolution layout] with symbolic sizes: the stand-ins are fake CPU tensors of the
    # trace's ShapeEnv (PyTorch's backend choice reads the sizes it needs, each read a guard: a
    # batch of 16, the element count, sizes 1). Asked of fake *meta* tensors (`eager_layouts`)
    # the choice is the meta device's: row-major where eager keeps a channels-last input's
    # layout, so a pooling or norm after the convolution was relaid row-major.
    with _fake_mode((input, weight)), torch._C.DisableTorchFunction():
        real_input = torch.empty_strided(tuple(input.shape), tuple(input.stride()),
                                         dtype=input.dtype, device="cpu")
        real_weight = torch.empty_strided(tuple(weight.shape), tuple(weight.stride()),
                                          dtype=weight.dtype, device="cpu")
        if input.dim() == weight.dim() - 1:  # unbatched: eager adds the batch dim
            real_input = real_input.unsqueeze(0)
        extra = list(output_padding or [0] * (weight.dim() - 2))
        backend = torch._C._select_conv_backend(real_input, real_weight, None, list(stride),
                                                list(padding), list(dilation), transposed,
                                                extra, groups, None)
        memory_format = torch._C._conv_determine_backend_memory_format(real_input, real_weight,
                                                                       backend)
        batched = tuple(shape) if input.dim() == weight.dim() else (1, *shape)
        layout = torch.empty(batched, device="meta", memory_format=memory_format)
        return layout.stride() if input.dim() == weight.dim() else layout.squeeze(0).stride()


_ATTENTION_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                        "enable_gqa")


def attention_arguments(args: tuple, kwargs: dict) -> dict:
    """The arguments of a `F.scaled_dot_product_attention(*args, **kwargs)` call by name (those
    not given are absent)."""
    return dict(zip(_ATTENTION_ARGUMENTS, args)) | kwargs


def attention_strides(args, kwargs, out) -> tuple | None:
    """Eager's strides for the output `out` of `F.scaled_dot_product_attention(*args,
    **kwargs)` where it runs the CPU flash kernel: the output is allocated like the query (`empty_like`: the query's strides when it is
    non-overlapping and dense; checked against eager for every order of the batch, head and
    sequence dims, sizes of 1 and grouped-query attention). PyTorch's meta kernel describes
    the math backend instead (a contiguous result: wrong for a transposed query), and with
    symbolic sizes runs that backend op by op. Elsewhere None (the meta kernel's answer stands).

    The backend is PyTorch's own choice on stand-ins of the traced call's sizes, made with and
    without grad: it reads the ranks, head counts, head sizes, last strides and mask of the
    call and whether the batch sizes agree, never the sequence sizes (sizes 0 are
    specialised); symbolic head counts are specialised, and symbolic batch and head sizes are
    guarded equal (the flash kernel needs them equal)."""
    bound = attention_arguments(args, kwargs)
    query, key, value, mask = (bound.get(name) for name in ("query", "key", "value",
                                                              "attn_mask"))
    tensors = [t for t in (query, key, value, mask) if t is not None]
    if (not all(isinstance(t, TensorProxy) and t.device.type == "cpu" for t in tensors)
            or query.ndim != 4 or key.ndim != 4 or value.ndim != 4
            or not all(isinstance(t.stride(-1), int) for t in tensors)):
        return None
    for t in (query, key, value):
        int(t.shape[-3])  # a symbolic head count is specialised (guarded): the choice reads it
    if not (query.shape[0] == key.shape[0] == value.shape[0]
            and query.shape[-1] == key.shape[-1] == value.shape[-1]):  # guarded when symbolic
        return None
    if not known_same_shape(out.shape, query.shape) or not _dense(query):
        return None
    options = {"dropout_p": bound.get("dropout_p", 0.0), "is_causal": bound.get("is_causal",
                                                                                   False),
               "scale": bound.get("scale"), "enable_gqa": bound.get("enable_gqa", False)}
    flash = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    for grad in (False, True):
        stand_ins = [_stand_in(t, grad) for t in (query, key, value)]
        stand_mask = _stand_in(mask, grad) if mask is not None else None
        with torch._C.DisableTorchFunction():
            if torch._fused_sdp_choice(*stand_ins, stand_mask, **options) != flash:
                return None
    return tuple(query.stride())


def _stand_in(proxy: TensorProxy, grad: bool) -> torch.Tensor:
    """An uninitialised CPU tensor with `proxy`'s metadata at the traced call's sizes (no page
    is touched: the backend choice reads metadata only)."""
    tensor = torch.empty_strided(size_hints(proxy.shape), size_hints(proxy.stride()),
                                 dtype=proxy.dtype)
    return tensor.requires_grad_(grad and proxy.dtype.is_floating_point)


def _dense(tensor: TensorProxy) -> bool:
    """Whether `tensor` is non-overlapping and dense, decided without a guard (False when
    unknown): its dims of size other than 1, ordered by stride, have the strides of a row-major
    layout in that order."""
    dims = [d for d, size in enumerate(tensor.shape) if not (isinstance(size, int) and size == 1)]
    strides = tensor.stride()
    dims.sort(key=lambda d: size_hints((strides[d],))[0])
    expected = 1
    for d in dims:
        if not known_same_shape((strides[d],), (expected,)):
            return False
        expected = expected * tensor.shape[d]
    return True


def batch_norm_strides(input, shape) -> tuple | None:
    """Eager's strides for a batch norm's (or group norm's) output of `shape` on CPU, or None
    elsewhere (the meta kernel's answer stands).

    PyTorch's meta kernel allocates the output `empty_like` the input (a transposed input's
    strides), while the CPU kernel allocates it in the input's suggested memory format
    (row-major, or channels_last where the input suggests it): `x.t()` of a (4, 6) tensor
    normalises into strides (4, 1), not (1, 6). With symbolic sizes the format is read on a
    fake stand-in (`suggested_layout_strides`): a symbolic group norm of a channels-last input
    was traced row-major, and a pooling after it relaid row-major. `roll` and
    `channel_shuffle` take it too: their CPU kernels allocate alike."""
    if not isinstance(input, TensorProxy) or input.device.type != "cpu" \
            or not known_same_shape(tuple(input.shape), tuple(shape)):
        return None
    return suggested_layout_strides(input, tuple(shape))


def suggested_layout_strides(like, shape: tuple) -> tuple:
    """Dense strides of `shape` in the memory format `like`'s sizes and strides suggest
    (row-major, or channels_last / channels_last_3d), as CPU kernels allocating `empty(...,
    memory_format=input.suggest_memory_format())` lay out their outputs. With symbolic sizes
    the stand-in is a fake tensor of the trace's ShapeEnv (each size the format reads is
    guarded) and the strides are expressions of the symbols."""
    with _fake_mode((like, shape)):
        layout = torch.empty_strided(tuple(like.shape), tuple(like.stride()), device="meta")
        memory_format = suggest_memory_format(layout)  # C++'s `Tensor::suggest_memory_format`
        return torch.empty(shape, device="meta", memory_format=memory_format).stride()


__all__ = ["attention_arguments", "attention_strides", "batch_norm_strides",
           "convolution_strides", "suggested_layout_strides"]
