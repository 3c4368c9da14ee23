"""The opaque fallback: a torch op with no decomposition is still traced.

Its meta comes from PyTorch's meta kernels (the op runs on storage-less meta tensors), the torch
executor runs it, and it is never fused. A model never fails to trace because fulmen lacks a
decomposition; only when PyTorch itself cannot describe the op's output (no meta kernel, an
output shape that depends on values) does tracing raise, naming the op and the source line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch._prims_common import suggest_memory_format

from fulmen.core import FulmenError, Symbol
from fulmen.core.source import user_source_location
from fulmen.core.symbol import Namespace
from fulmen.ops.elementwise_layout import _row_major_strides, elementwise_strides
from fulmen.ops.kernel_layouts import (
    _ATTENTION_ARGUMENTS,
    attention_arguments,
    attention_strides,
    batch_norm_strides,
    convolution_strides,
    suggested_layout_strides,
)
from fulmen.ops.meta import run_meta, with_strides
from fulmen.ops.opaque_symbolic import SYMBOLIC_METAS
from fulmen.ops.torch.base import torch_qualname
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import known_same_shape, row_major

OPAQUE_NAMESPACE = Namespace("opaque", "fulmen.ops.opaque", "from fulmen.ops import opaque")
_OPAQUE: dict[Callable, Symbol] = {}
_BY_NAME: dict[str, Symbol] = {}


def opaque_name(fn: Callable) -> str:
    qualname = torch_qualname(fn)
    if qualname is not None:
        return qualname.removeprefix("torch.").replace(".", "_")
    # an OpOverload's name has a dot (`slice.Tensor`): keep printed names valid identifiers
    name = re.sub(r"\W", "_", getattr(fn, "__name__", "op")).strip("_") or "op"
    return f"op_{name}" if name[0].isdigit() else name


_RANDOM_NAMES = {
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
    "bernoulli", "multinomial", "poisson", "dropout", "alpha_dropout", "feature_alpha_dropout",
    "dropout1d", "dropout2d", "dropout3d", "rrelu", "gumbel_softmax", "fractional_max_pool2d",
    "fractional_max_pool3d", "feature_dropout",
}  # fmt: skip


def _is_random(fn: Callable) -> bool:
    """Whether `fn` draws from torch's global generator (so it must never be dropped or
    reordered: the stream would diverge from eager)."""
    return getattr(fn, "__name__", "") in _RANDOM_NAMES


def _grouped_mm_meta(fn, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """`torch._grouped_mm`: PyTorch's meta kernel states CUDA's rules (bfloat16 only), but the
    CPU kernel takes any floating dtype (HF's MoE layers call it on float32). On CPU the output
    is contiguous with the meta kernel's shape rule; the kernel checks alignment when it runs."""
    if mat_a.device.type != "cpu" or mat_a.dtype != mat_b.dtype or mat_a.dtype == torch.bfloat16:
        return run_meta(fn, mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if {mat_a.dim(), mat_b.dim()} - {2, 3} or (a_2d or b_2d) == (offs is None):
        raise ValueError("grouped_mm takes 2D or 3D operands, and offs exactly when one is 2D")
    if a_2d and b_2d:  # the groups split the shared inner dimension
        shape = (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
        inner = mat_a.shape[1], mat_b.shape[0]
    elif a_2d:  # the groups split mat_a's rows
        shape = (mat_a.shape[0], mat_b.shape[2])
        inner = mat_a.shape[1], mat_b.shape[1]
    elif b_2d:  # the groups split mat_b's columns
        shape = (mat_a.shape[1], mat_b.shape[1])
        inner = mat_a.shape[2], mat_b.shape[0]
    else:  # a batched matmul
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[2])
        inner = mat_a.shape[2], mat_b.shape[1]
    if inner[0] != inner[1]:
        raise ValueError(f"grouped_mm: contraction sizes differ ({inner[0]} and {inner[1]})")
    return TensorProxy(None, shape, out_dtype or mat_a.dtype, mat_a.device)


def _contiguous_meta(fn, self, memory_format=torch.contiguous_format):
    """NOTE [contiguous of a batch of 1]: with a batch of 1 traced as a symbol `s0`
    (`fulmen.tracer.symbolic`), `labels[..., 1:]` of a `(s0, s1 + 1)` tensor is contiguous
    exactly when `s0 == 1`, and eager's `.contiguous()` returns it itself then, a copy
    otherwise. PyTorch's meta kernel would guard `s0 == 1` and the entry would serve no other
    batch. Instead the op runs eager's `Tensor.contiguous` (which decides at run time) and
    the trace sees the copy: a contiguous result (values are the same either way). The
    result is marked (`_fulmen_layout_undecided`); the tracer keeps the alias from being
    hidden (mutating either tensor raises, as does reading the result's strides or offset
    from user code: the strides of its size-1 dimensions and its offset differ), and the
    symbolic trace is then retraced with the 1 specialised.

    Its strides are eager's on every dimension of size other than 1 (those of the copy, and of
    the tensor itself when it is returned), so the result is marked exact for the steps that
    read only those (`torchex.as_layout`, NOTE [output layout] in `fulmen.executors.claim`): a
    fused `shifted.permute(2, 0, 1).exp()` went back to the user row-major, where eager's
    output keeps the permutation."""
    if memory_format is torch.contiguous_format and isinstance(self, TensorProxy) \
            and row_major(self) is None:
        strides, acc = [], 1
        for size in reversed(self.shape):
            strides.append(acc)
            acc = acc * size
        result = TensorProxy(None, self.shape, self.dtype, self.device,
                             strides=tuple(reversed(strides)))
        result._fulmen_layout_undecided = True
        result._fulmen_exact_strides = True  # on the dimensions of size other than 1
        return result
    if memory_format is torch.contiguous_format and isinstance(self, TensorProxy) and any(
            isinstance(v, torch.SymInt) for v in (*self.shape, *self.stride())):
        # the meta kernel's answer, known without fake tensors (milliseconds each with
        # symbolic sizes): `self` where it is row-major, else a row-major copy
        layout = row_major(self)
        if layout is not None:
            strides = self.stride() if layout else _row_major_strides(self.shape)
            result = TensorProxy(None, self.shape, self.dtype, self.device,
                                 strides=tuple(strides))
            result._fulmen_exact_strides = True  # as `run_meta` marks its outputs
            return result
    return run_meta(fn, self, memory_format=memory_format)


def in_layout_of(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`tensor` itself where it already has the memory format `like` suggests
    (`suggest_memory_format`: row-major or channels-last), else a copy in it (eager's
    `contiguous`), decided when it runs: for a cotangent handed to a kernel that reads it in
    its input's layout (the CPU group norm backward). Neither layout need be its traced one
    then: `y.sum().backward()` hands an expanded cotangent (stride 0), and a fusion's kernel
    writes a row-major result where eager's is channels-last. `Tensor.contiguous` traced on a
    proxy that looks contiguous records nothing."""
    return tensor.contiguous(memory_format=suggest_memory_format(like))


def _in_layout_of_meta(fn, tensor, like):
    """A new proxy in the memory format the traced `like` suggests (never `tensor` itself, so
    the call is recorded)."""
    strides = suggested_layout_strides(like, tuple(tensor.shape))
    return TensorProxy(None, tensor.shape, tensor.dtype, tensor.device, strides=strides)


def _attention_meta(fn, *args, **kwargs):
    """`F.scaled_dot_product_attention` run whole (dropout, symbolic head counts): PyTorch's
    meta kernel describes the math backend; where eager runs the CPU flash kernel, its output
    is laid out like the query (`attention_strides`)."""
    out = attention_like_query(args, kwargs)
    if out is not None:
        return out
    out = run_meta(fn, *args, **kwargs)
    strides = attention_strides(args, kwargs, out) if isinstance(out, TensorProxy) else None
    return out if strides is None else with_strides(out, strides)


def attention_like_query(args, kwargs) -> TensorProxy | None:
    """With symbolic sizes, the output described without PyTorch's meta kernel, which runs the
    math backend op by op on fake tensors (0.4 s per call for GPT-2's training attention,
    dropout and all): the query's shape and dtype, laid out as the flash kernel lays it out where
    eager runs that (`attention_strides`), else row-major as the meta kernel's math backend does.
    Only for calls whose result has the query's shape without a guard:
    4-d query, key and value of one floating dtype, static head counts (equal, or grouped with
    `enable_gqa`), head sizes, batch sizes and key/value lengths known equal, and a mask (bool or
    the query's dtype) that broadcasts to (batch, heads, L, S) without enlarging it. Else None:
    the meta kernel describes and checks the call."""
    names = set(_ATTENTION_ARGUMENTS)
    if len(args) > len(_ATTENTION_ARGUMENTS) or not set(kwargs) <= names:
        return None
    bound = attention_arguments(args, kwargs)
    query, key, value, mask = (bound.get(name) for name in ("query", "key", "value",
                                                              "attn_mask"))
    qkv = (query, key, value)
    if not all(isinstance(t, TensorProxy) and t.ndim == 4 for t in qkv) \
            or not (mask is None or isinstance(mask, TensorProxy) and mask.ndim <= 4):
        return None
    tensors = [t for t in (*qkv, mask) if t is not None]
    if not any(isinstance(size, torch.SymInt) for t in tensors for size in (*t.shape, *t.stride())):
        return None  # static sizes: the meta kernel is cheap, and checks the call
    if not (query.dtype == key.dtype == value.dtype and query.dtype.is_floating_point) \
            or (mask is not None and mask.dtype not in (torch.bool, query.dtype)):
        return None
    heads = [_static_size(t.shape[1]) for t in qkv]
    if not all(h is not None and h > 0 for h in heads):
        return None
    if bound.get("enable_gqa", False) is True:
        grouped = heads[1] == heads[2] and heads[0] % heads[1] == 0
    else:
        grouped = heads[0] == heads[1] == heads[2]
    batch, length, width = query.shape[0], query.shape[2], query.shape[3]
    span = key.shape[2]
    if not grouped or not known_same_shape(
            (key.shape[0], value.shape[0], key.shape[3], value.shape[3], value.shape[2]),
            (batch, batch, width, width, span)):
        return None
    if mask is not None:
        target = (batch, heads[0], length, span)[4 - mask.ndim:]
        for size, want in zip(mask.shape, target):
            if not (type(size) is int and size == 1 or known_same_shape((size,), (want,))):
                return None
    # the flash kernel's layout where eager runs it, else the meta kernel's answer: the math
    # backend's result, a batched product of 4-d operands, is row-major
    strides = attention_strides(args, kwargs, SimpleNamespace(shape=query.shape))
    out = TensorProxy(None, query.shape, query.dtype, query.device, strides=strides)
    out._fulmen_exact_strides = True  # as `run_meta` and `with_strides` mark them
    return out


def _static_size(size) -> int | None:
    """`size` as an int where it is one (a SymInt of a constant included), else None."""
    if isinstance(size, torch.SymInt):
        return size.node.maybe_as_int()
    return size if type(size) is int else None


_POLAR_DTYPES = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def _polar_meta(fn, abs, angle, **kwargs):
    """`torch.polar`: PyTorch's meta runs `torch.complex`, whose `.to(complex)` reads the
    strides as ints, so a symbolic size (a length, the positions of a rotary embedding: HF
    Llama4) became a constant and the entry served one length. Eager's kernel is an elementwise
    TensorIterator map, so its output is the broadcast shape laid out by the elementwise rule
    (`elementwise_strides`); other calls (`out=`, mixed dtypes or devices) go to the meta kernel,
    which checks them."""
    if kwargs or not (isinstance(abs, TensorProxy) and isinstance(angle, TensorProxy)) \
            or abs.dtype != angle.dtype or abs.dtype not in _POLAR_DTYPES \
            or abs.device != angle.device:
        return run_meta(fn, abs, angle, **kwargs)
    shape = torch.broadcast_shapes(abs.shape, angle.shape)
    return TensorProxy(None, shape, _POLAR_DTYPES[abs.dtype], abs.device,
                       strides=elementwise_strides([abs, angle], shape))


BATCH_NORM_FUNCTIONAL = torch.ops.aten._native_batch_norm_legit_functional.default


def _batch_norm_functional_meta(fn, input, weight, bias, running_mean, running_var, *args,
                                **kwargs):
    """`aten._native_batch_norm_legit_functional`: PyTorch's meta kernel gives its four
    statistics (saved mean and inverse std, new running mean and variance) in float32 for a
    float16/bfloat16 input, as the cuda kernel does; the CPU kernel returns them in the running
    statistics' dtype (a bfloat16 model's are bfloat16). NOTE [batch norm running statistics]
    in `tracer/batch_norm.py`."""
    out = _batch_norm_meta(fn, input, weight, bias, running_mean, running_var, *args, **kwargs)
    if input.device.type != "cpu":
        return out
    return (out[0], *(TensorProxy.like(stat, dtype=running_mean.dtype) for stat in out[1:]))


def _batch_norm_meta(fn, *args, **kwargs):
    """A batch norm (`F.batch_norm`, `torch.batch_norm`, `torch.native_batch_norm`): PyTorch's
    meta kernel, with the normalised output laid out as the CPU kernel lays it out
    (`batch_norm_strides`)."""
    out = run_meta(fn, *args, **kwargs)
    first = out[0] if isinstance(out, tuple) else out
    input = args[0] if args else kwargs.get("input")
    strides = batch_norm_strides(input, first.shape) if isinstance(first, TensorProxy) else None
    relaid = _relaid(first, strides)
    if relaid is first:
        return out
    return (relaid, *out[1:]) if isinstance(out, tuple) else relaid


def _relaid(out: TensorProxy, strides) -> TensorProxy:
    """`out`, or where its strides are not `strides` (eager's; None: unknown), a proxy of the
    same value reporting them (`with_strides`)."""
    if strides is None or tuple(out.stride()) == tuple(strides):
        return out
    return with_strides(out, strides)


_CONVOLUTION_ARGUMENTS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_TRANSPOSED_ARGUMENTS = ("input", "weight", "bias", "stride", "padding", "output_padding",
                         "groups", "dilation")
_TRANSPOSED = {torch.nn.functional.conv_transpose1d, torch.nn.functional.conv_transpose2d,
               torch.nn.functional.conv_transpose3d}


def _convolution_meta(fn, *args, **kwargs):
    """A convolution recorded whole (`F.conv3d`, `F.conv_transpose{1,2,3}d`): PyTorch's meta
    kernel, with the output laid out in the memory format eager's CPU backend picks (NOTE
    [convolution layout] in `kernel_layouts.py`: the meta kernel answers row-major where the
    CPU kernel keeps a channels-last input's format). A transposed convolution or a 3-d one
    of a channels-last tensor was traced row-major, and one of a fused tensor was then put
    back row-major where eager returns channels-last."""
    out = run_meta(fn, *args, **kwargs)
    transposed = fn in _TRANSPOSED
    bound = dict(zip(_TRANSPOSED_ARGUMENTS if transposed else _CONVOLUTION_ARGUMENTS,
                     args)) | kwargs
    input, weight = bound.get("input"), bound.get("weight")
    if not (isinstance(out, TensorProxy) and isinstance(input, TensorProxy)
            and isinstance(weight, TensorProxy)) or isinstance(bound.get("padding"), str):
        return out
    spatial = weight.dim() - 2

    def expand(name, default):
        value = bound.get(name)
        value = default if value is None else value
        return [value] * spatial if isinstance(value, int) else list(value)

    strides = convolution_strides(input, weight, tuple(out.shape), expand("stride", 1),
                                  expand("padding", 0), expand("dilation", 1),
                                  bound.get("groups") or 1, transposed,
                                  expand("output_padding", 0))
    return _relaid(out, strides)


def _in_suggested_layout(out: TensorProxy, input: TensorProxy) -> TensorProxy:
    """`out` laid out densely in the memory format `input` suggests (as CPU kernels allocating
    `empty(..., memory_format=input.suggest_memory_format())` lay out their outputs)."""
    return _relaid(out, suggested_layout_strides(input, tuple(out.shape)))


def _channel_shuffle_meta(fn, input, groups, *args, **kwargs):
    """`F.channel_shuffle` (`torch.native_channel_shuffle`): PyTorch's meta kernel, its output
    laid out as the CPU kernel allocates it, in the input's suggested memory format
    (channels-last for a channels-last input; the meta kernel answers row-major)."""
    out = run_meta(fn, input, groups, *args, **kwargs)
    if not (isinstance(out, TensorProxy) and isinstance(input, TensorProxy)
            and input.device.type == "cpu" and input.dim() in (4, 5)):
        return out
    return _in_suggested_layout(out, input)


def _pad_meta(fn, input, pad, mode="constant", value=None):
    """`F.pad` run whole (a reflect or replicate pad): PyTorch's meta kernel, with a 3-d pad's
    output laid out as the CPU kernel allocates it, in the input's suggested memory format (the
    meta kernel answers row-major for a channels_last_3d input; its 2-d answer is eager's)."""
    out = run_meta(fn, input, pad, mode=mode, value=value)
    if not (isinstance(out, TensorProxy) and isinstance(input, TensorProxy)
            and input.device.type == "cpu" and input.dim() == 5
            and mode in ("reflect", "replicate")):
        return out
    return _in_suggested_layout(out, input)


_PACKED_RNNS = (torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu)


def _packed_rnn_meta(fn, *args, **kwargs):
    """`torch.lstm` / `gru` / `rnn_tanh` / `rnn_relu`: the packed-sequence overloads (`data,
    batch_sizes, hx, params, ...`, whose fourth argument is the weight list) read the values of
    `batch_sizes`, which a meta tensor does not have: with plain meta tensors PyTorch raises,
    but with the fake tensors of a symbolic trace (`dynamic=True`) the kernel crashed the
    process (a segmentation fault). Refused here, so the call runs on the real values and its
    shapes are guarded (a graph break); the padded overloads go to the meta kernel."""
    if len(args) > 3 and isinstance(args[3], (list, tuple)):
        raise RuntimeError("a packed-sequence RNN reads the values of its batch_sizes")
    return run_meta(fn, *args, **kwargs)


# Ops whose kernel reads a tensor argument's values for some calls: refused before the meta
# kernel (not `_META_OVERRIDES`, whose ops autocast runs on fake tensors expecting failures)
_VALUE_READERS: dict[Callable, Callable] = dict.fromkeys(_PACKED_RNNS, _packed_rnn_meta)


# Ops whose PyTorch meta kernel does not describe every call eager accepts.
_META_OVERRIDES: dict[Callable, Callable] = {torch._grouped_mm: _grouped_mm_meta,
                                             torch.polar: _polar_meta,
                                             BATCH_NORM_FUNCTIONAL: _batch_norm_functional_meta,
                                             torch.nn.functional.batch_norm: _batch_norm_meta,
                                             torch.batch_norm: _batch_norm_meta,
                                             torch.native_batch_norm: _batch_norm_meta,
                                             torch.Tensor.contiguous: _contiguous_meta,
                                             torch.nn.functional.conv3d: _convolution_meta,
                                             **dict.fromkeys(_TRANSPOSED, _convolution_meta),
                                             in_layout_of: _in_layout_of_meta,
                                             torch.nn.functional.scaled_dot_product_attention:
                                                 _attention_meta,
                                             torch.channel_shuffle: _channel_shuffle_meta,
                                             torch.nn.functional.pad: _pad_meta,
                                             torch.native_channel_shuffle: _channel_shuffle_meta,
                                             **SYMBOLIC_METAS}


# Ops that draw from the global generator for some arguments only: fn -> whether a call does.
# Such a call is recorded with the op's random symbol (`opaque_symbol(fn, random=True)`), so
# no pass reorders it among the other draws (HF UMT5's attention dropout drew after the
# dropouts that follow it in eager, and every mask differed).
_DRAWS_WHEN: dict[Callable, Callable[[tuple, dict], bool]] = {
    torch.nn.functional.scaled_dot_product_attention:
        lambda args, kwargs: attention_arguments(args, kwargs).get("dropout_p", 0.0) != 0.0,
}


def meta_overridden(fn: Callable) -> bool:
    """Whether fulmen describes `fn`'s output itself because PyTorch's meta kernel does not
    describe every call eager accepts (`_META_OVERRIDES`: `torch._grouped_mm` on float32 CPU
    tensors, which its meta kernel refuses)."""
    return fn in _META_OVERRIDES


def draws_random(fn: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether the call `fn(*args, **kwargs)` draws from torch's global generator."""
    return _is_random(fn) or (fn in _DRAWS_WHEN and bool(_DRAWS_WHEN[fn](args, kwargs)))


def opaque_symbol(fn: Callable, random: bool = False) -> Symbol:
    """The (cached) opaque symbol for torch callable `fn`; with `random`, the one tagged as
    drawing from the global generator (for a call `draws_random` says draws)."""
    if random and not _is_random(fn):
        return _random_variant(opaque_symbol(fn))
    sym = _OPAQUE.get(fn)
    if sym is not None:
        return sym
    name = opaque_name(fn)
    while name in _BY_NAME:
        name += "_"
    label = torch_qualname(fn) or getattr(fn, "__qualname__", repr(fn))

    def meta(*args, **kwargs):
        try:
            describe = _META_OVERRIDES.get(fn) or _VALUE_READERS.get(fn, run_meta)
            return describe(fn, *args, **kwargs)
        except FulmenError:
            raise
        except Exception as error:
            raise FulmenError(
                f"PyTorch cannot describe this op's output without running it: {error}",
                op=label,
                where=user_source_location(),
                hint="the op may have a value-dependent output shape or no meta kernel",
            ) from error

    tags = {"opaque", "random"} if _is_random(fn) else {"opaque"}
    sym = Symbol(name, meta, namespace=OPAQUE_NAMESPACE, impl=fn, torch_fn=fn, tags=tags)
    _OPAQUE[fn] = sym
    _BY_NAME[name] = sym
    return sym


_RANDOM_VARIANTS: dict[str, Symbol] = {}


def _random_variant(sym: Symbol) -> Symbol:
    """`sym` (an opaque symbol) tagged "random": same meta and implementation."""
    variant = _RANDOM_VARIANTS.get(sym.name)
    if variant is None:
        name = f"{sym.name}_random"
        variant = Symbol(name, sym.fn, namespace=OPAQUE_NAMESPACE, impl=sym.impl,
                         torch_fn=sym.torch_fn, tags=set(sym.tags) | {"random"})
        _RANDOM_VARIANTS[sym.name] = _BY_NAME[name] = variant
    return variant


def __getattr__(name: str) -> Symbol:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise AttributeError(name) from None
