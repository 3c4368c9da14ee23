"""Helpers shared by meta functions: proxies <-> PyTorch meta tensors.

Where an op's output shape rules are intricate (matmul, convolution, pad, indexing, every opaque
op) the meta function runs PyTorch's own meta kernel on storage-less `device="meta"` tensors and
reads the result's metadata. PyTorch is the reference for shapes, so this is exact.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
import warnings
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._prims_common import compute_elementwise_output_strides

from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import contiguous_strides, known_same_shape, size_hints


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


def call_on_meta(fn, args, kwargs) -> tuple[Any, torch.device]:
    """`fn` run on meta versions of the arguments (fake tensors of the trace's ShapeEnv where a
    size or stride is symbolic), and the device its outputs stand for (see `run_meta`).
    Raises what the meta kernel raises."""
    has_tensor = any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves((args, kwargs)))
    device = first_device(args, kwargs)
    if kwargs.get("device") is not None:
        device = torch.device(kwargs["device"])
        kwargs = {**kwargs, "device": "meta"}
    elif not has_tensor:
        device = torch.get_default_device()
        kwargs = {**kwargs, "device": "meta"}
    with _fake_mode((args, kwargs)), _fake_tensor_log_off():
        meta_args, meta_kwargs = to_meta((args, kwargs))
        with torch._C.DisableTorchFunction(), torch.no_grad():
            return fn(*meta_args, **meta_kwargs), device


# PyTorch's fake tensor mode logs a meta kernel's failure at ERROR (with a traceback) before
# raising it; here a failure is an answer (no layout, or a graph break), not the user's error
_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")


@contextlib.contextmanager
def _fake_tensor_log_off():
    was = _FAKE_TENSOR_LOG.disabled
    _FAKE_TENSOR_LOG.disabled = True
    try:
        yield
    finally:
        _FAKE_TENSOR_LOG.disabled = was


def _fake_mode(value: Any):
    """PyTorch's `FakeTensorMode` for the symbolic sizes or strides inside `value` (plain meta
    tensors cannot hold them; see `fulmen.tracer.symbolic`), else a no-op context."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            sizes = (*leaf.shape, *leaf.stride())
        elif isinstance(leaf, slice):  # `buffer[:, :seq]` with a symbolic `seq`
            sizes = (leaf.start, leaf.stop, leaf.step)
        else:
            sizes = (leaf,)
        for size in sizes:
            if isinstance(size, torch.SymInt):
                env = size.node.shape_env
                mode = getattr(env, "_fulmen_fake_mode", None)
                if mode is None:
                    from torch._subclasses.fake_tensor import FakeTensorMode

                    # (an index list becomes a plain meta tensor inside `Tensor.__getitem__`)
                    mode = env._fulmen_fake_mode = FakeTensorMode(shape_env=env,
                                                                  allow_non_fake_inputs=True)
                    # fulmen keeps its own answers (`eager_layouts`, per ShapeEnv), and few
                    # questions repeat within one compilation: PyTorch's dispatch cache costs
                    # more than it saves (an entry checks every output's symbols: half of a
                    # meta kernel call's time in a symbolic compile of HF Llama or GPT-2)
                    mode.cache_enabled = False
                if getattr(env, "_fulmen_generalised_ones", False):
                    return _size_oblivious(mode)
                return mode
    return contextlib.nullcontext()


@contextlib.contextmanager
def _size_oblivious(mode):
    """`mode`, with PyTorch's size-oblivious reasoning for the kernels run in it: a trace holds
    a size 1 generalised to a symbol (`fulmen.tracer.symbolic`), and PyTorch's meta kernels
    ask `guard_or_false(s0 == 1)` where either answer gives the same result (broadcasting,
    contiguity); answered without a guard, they take the general path. A decision that does
    depend on the size is still a guard (`torch._check` on a backed size evaluates it at 1,
    and fails the trace when the general path does not hold there)."""
    from torch.fx.experimental import _config

    with mode, _config.patch(backed_size_oblivious=True):
        yield


def run_meta(fn, *args, **kwargs) -> Any:
    """Run `fn` on meta versions of the arguments; return proxies for its tensor outputs.

    The outputs live on the device of the first tensor argument, or the `device=` argument, or
    (for a factory called with neither) the default device. Factories run with `device="meta"`,
    so nothing is allocated and no random number is drawn.
    """
    out, device = call_on_meta(fn, args, kwargs)
    return from_meta(out, device)


class _Uncacheable(Exception):
    pass


_ATOMS = (int, float, bool, complex, str, type(None), type(Ellipsis), torch.dtype, torch.device,
          torch.memory_format, torch.layout)


def _layout_key(value: Any, envs: list) -> Any:
    """A hashable description of an argument, as far as a meta kernel can see it; the
    `ShapeEnv` of each symbolic size met is appended to `envs`."""
    if isinstance(value, torch.Tensor):
        sizes = (*value.shape, *value.stride())
        if any(isinstance(size, torch.SymInt) for size in sizes):
            return (torch.Tensor, tuple(_layout_key(v, envs) for v in sizes), value.ndim,
                    value.dtype, value.device)
        return (value.shape, value.stride(), value.dtype, value.device)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_layout_key(v, envs) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _layout_key(v, envs)) for k, v in value.items()))
    if isinstance(value, slice):
        return (slice, _layout_key(value.start, envs), _layout_key(value.stop, envs),
                _layout_key(value.step, envs))
    if type(value) in _ATOMS:
        return (type(value), value)
    if isinstance(value, torch.SymInt):
        envs.append(value.node.shape_env)
        return (torch.SymInt, value.node.expr)  # an expression of that env's symbols
    raise _Uncacheable


# (callable, arguments' key) -> eager_layouts' answer; repeated layers hit it
_LAYOUTS: dict[Any, Any] = {}
_LAYOUTS_LIMIT = 8192


def eager_layouts(fn, args, kwargs) -> list[tuple[torch.Size, tuple[int, ...]]] | None:
    """(shape, strides) of each tensor `fn(*args, **kwargs)` returns in eager, in pytree leaf
    order, from PyTorch's meta kernel; None when the meta kernel cannot describe the call.

    Used where fulmen's decomposition gives the shape but PyTorch decides the layout (see
    NOTE [layout truth] in `fulmen.tracer.layout_truth`). Answers are cached by the arguments'
    metadata and values (meta kernels see nothing else). Warnings are silenced: the op is
    described here, not run.
    """
    envs: list = []
    try:
        with torch._C.DisableTorchFunctionSubclass():
            key = (fn, _layout_key(args, envs), _layout_key(kwargs, envs))
        hash(key)
    except (_Uncacheable, TypeError):
        key = None
    # with symbolic sizes, answers are kept by the ShapeEnv (keyed by the sizes' expressions,
    # which name its symbols): the layers of a model ask the same questions, and the guards
    # the first answer recorded hold for the rest
    cache = _LAYOUTS
    if envs:
        if any(env is not envs[0] for env in envs):
            key = None
        else:
            cache = envs[0].__dict__.setdefault("_fulmen_layouts", {})
    if key is not None and key in cache:
        return cache[key]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn, args, kwargs = _LAYOUT_TWINS.get(fn, _same_call)(fn, args, kwargs)
            with _without_dynamo_import():
                out, _ = call_on_meta(fn, args, kwargs)
        layouts = [(leaf.shape, leaf.stride()) for leaf in pytree.tree_leaves(out)
                   if isinstance(leaf, torch.Tensor)]
    except Exception:  # no meta kernel, a value-dependent op, a device transfer, ...
        layouts = None
    if key is not None:
        if len(cache) >= _LAYOUTS_LIMIT:
            cache.clear()
        cache[key] = layouts
    return layouts


def _same_call(fn, args, kwargs):
    return fn, args, kwargs


def _linear_without_bias(fn, args, kwargs):
    """`F.linear`'s layout is that of the product alone (eager adds the bias into it), and the
    meta kernel of the product is C++ while that of `addmm` is Python (see below)."""
    args, kwargs = list(args), dict(kwargs)
    if len(args) > 2:
        args = args[:2]
    kwargs.pop("bias", None)
    return fn, tuple(args), kwargs


def _mean_as_sum(fn, args, kwargs):
    """A mean is laid out as the sum it divides (one TensorIterator reduction)."""
    return (torch.sum if fn is torch.mean else torch.Tensor.sum), args, kwargs


def _constant_pad_as_allocation(fn, args, kwargs):
    """With symbolic sizes, a constant pad is described by the allocation eager's kernel makes
    (the output's shape, in the input's suggested memory format): PyTorch's C++ pad reads the
    sizes as ints, which would specialise every symbolic size of the input (a padded `labels`
    of a causal LM loss pinned the sequence length)."""
    bound = _bind_pad(*args, **kwargs)
    if bound is None:
        return fn, args, kwargs
    a, pad = bound
    if not any(isinstance(size, torch.SymInt) for size in (*a.shape, *a.stride(), *pad)):
        return fn, args, kwargs
    shape = list(a.shape)
    for i in range(len(pad) // 2):
        shape[-1 - i] = shape[-1 - i] + pad[2 * i] + pad[2 * i + 1]
    fmt = torch.contiguous_format
    if a.ndim in (4, 5) and not a.is_contiguous():
        last = torch.channels_last if a.ndim == 4 else torch.channels_last_3d
        fmt = last if a.is_contiguous(memory_format=last) else fmt
    return torch.empty, (shape,), {"dtype": a.dtype, "device": a.device, "memory_format": fmt}


def _bind_pad(input, pad, mode="constant", value=None):
    """`(input, pad)` of an `F.pad` call in constant mode, else None."""
    if mode != "constant" or not isinstance(input, torch.Tensor):
        return None
    return input, tuple(pad)


_LAYOUT_TWINS = {F.linear: _linear_without_bias, torch.mean: _mean_as_sum,
                 torch.Tensor.mean: _mean_as_sum, F.pad: _constant_pad_as_allocation}


class _DynamoImportBlocker:
    """A `sys.meta_path` finder refusing `torch._dynamo` to the thread that installed it.

    NOTE [layout queries stay cheap]: many of PyTorch's meta kernels are Python references
    whose first call imports `torch._dynamo` (seconds). A layout query is not worth that: with
    the import refused, such a query fails and the decomposition's strides are kept (the
    common ops have rules that need no meta kernel: elementwise maps, linear, reductions).
    Once something else has imported dynamo, those meta kernels answer.
    """

    def __init__(self) -> None:
        self.thread = threading.get_ident()

    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo" and threading.get_ident() == self.thread:
            raise ImportError("fulmen layout query: not importing torch._dynamo")
        return None


@contextlib.contextmanager
def _without_dynamo_import():
    if "torch._dynamo" in sys.modules:
        yield
        return
    blocker = _DynamoImportBlocker()
    sys.meta_path.insert(0, blocker)
    try:
        yield
    finally:
        sys.meta_path.remove(blocker)


def elementwise_strides(tensors, shape) -> tuple[int, ...]:
    """Eager's output strides for an elementwise map of `tensors` broadcast to `shape`: the
    TensorIterator rule (operand layouts in order, broadcast dims ignored), as PyTorch's
    `compute_elementwise_output_strides` states it. 0-dim tensors take no part, as in eager."""
    shape = tuple(shape)
    canonical = _row_major_strides(shape)
    if all(known_same_shape(tuple(t.shape), shape) and known_same_shape(t.stride(), canonical)
           for t in tensors if t.dim() != 0):
        # TensorIterator's fast setup: operands of the output's shape, all contiguous, give a
        # contiguous output (decided here without the fake tensors symbolic sizes need)
        return canonical
    if _row_major_broadcasts(tensors, shape, canonical):
        return canonical
    envs: list = []
    try:
        key = ("elementwise", _layout_key(tuple(t for t in tensors if t.dim() != 0), envs),
               _layout_key(shape, envs))
    except _Uncacheable:
        envs = []
    if not envs or any(env is not envs[0] for env in envs):
        return _elementwise_strides(tensors, shape)
    cache = envs[0].__dict__.setdefault("_fulmen_layouts", {})  # as in `eager_layouts`
    if key not in cache:
        cache[key] = _elementwise_strides(tensors, shape)
    return cache[key]


def _row_major_broadcasts(tensors, shape: tuple, canonical: tuple) -> bool:
    """Whether every operand broadcast to `shape` (known without a guard: `_broadcast`) has,
    on each dim, stride 0 or the row-major stride of `shape`, and at least one has no stride
    0: the weight of `x * w` or the rotary table of `q * cos` beside a contiguous activation.
    TensorIterator's permutation then keeps every dim in place (a stride 0 never decides an
    order; every other pair is ordered as row-major), so the output is row-major, as the fake
    tensors of `_elementwise_strides` would say, without them. Only where every size inside
    the outermost is known not to be 1 (nor 0): row-major strides are then strictly ordered,
    with no tie for PyTorch's rule to break by sizes (a size-1 dim's stride)."""
    if not any(isinstance(v, torch.SymInt) for v in shape):
        return False  # static sizes: plain meta tensors are cheap, and their cache is shared
    for size in shape[1:]:
        if (size < 2) if type(size) is int else not _known_not_one(size):
            return False
    operands = _broadcast_operands(tensors, shape)
    if operands is None:
        return False
    full = False
    for operand in operands:
        zeros = 0
        for stride, expected in zip(operand.strides, canonical):
            if type(stride) is int and stride == 0:
                zeros += 1
            elif not known_same_shape((stride,), (expected,)):
                return False
        full |= zeros == 0
    return full


def _elementwise_strides(tensors, shape: tuple) -> tuple:
    symbolic = _symbolic_strides(tensors, shape)
    if symbolic is not None:
        return symbolic
    operands = []
    with _fake_mode((tensors, shape)), torch._C.DisableTorchFunction():
        for tensor in tensors:
            if tensor.dim() == 0:
                continue
            meta = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()),
                                       dtype=tensor.dtype, device="meta")
            operands.append(meta.expand(shape))
        if not operands:
            return contiguous_strides(shape)
        return tuple(compute_elementwise_output_strides(*operands))


class _Broadcast:
    """A tensor's layout broadcast to an elementwise op's shape: the metadata PyTorch's
    `compute_elementwise_output_logical_to_physical_perm` reads, without a fake tensor."""

    __slots__ = ("shape", "strides", "ndim")
    is_sparse = False

    def __init__(self, shape: tuple, strides: tuple) -> None:
        self.shape, self.strides, self.ndim = shape, strides, len(shape)

    def stride(self) -> tuple:
        return self.strides

    def dim(self) -> int:
        return self.ndim

    def numel(self):
        return math.prod(self.shape)


def _broadcast_operands(tensors, shape: tuple) -> list[_Broadcast] | None:
    """The layouts of `tensors` (0-dim ones take no part) broadcast to `shape`, or None where
    one is not known without a guard (`_broadcast`)."""
    operands = []
    for tensor in tensors:
        if tensor.dim() == 0:
            continue
        operand = _broadcast(tensor, shape)
        if operand is None:
            return None
        operands.append(operand)
    return operands


def _broadcast(tensor, shape: tuple) -> _Broadcast | None:
    """`tensor.expand(shape)`'s layout where it is known without a guard (each size equals the
    output's, or is 1 against a size known not to be 1, or against a generalised 1: stride 0),
    else None."""
    strides = [0] * (len(shape) - tensor.dim())
    for size, stride, target in zip(tensor.shape, tensor.stride(), shape[len(strides):]):
        if size is target or known_same_shape((size,), (target,)):
            strides.append(stride)
        elif isinstance(size, int) and size == 1 and (_known_not_one(target)
                                                      or _generalised_symbol(target)):
            strides.append(0)
        else:
            return None
    return _Broadcast(shape, tuple(strides))


def _generalised_symbol(size) -> bool:
    """Whether `size` is a lone symbol of a ShapeEnv that holds generalised 1s: a size 1
    expanded to it gets stride 0 with no guard, as the fake `expand` that `_elementwise_strides`
    would otherwise run (size-oblivious there, `_size_oblivious`) decides: the general path,
    which a size 1 shares (a size-1 dim's stride changes no element's address)."""
    if not isinstance(size, torch.SymInt):
        return False
    node = size.node
    return node.expr.is_Symbol and getattr(node.shape_env, "_fulmen_generalised_ones", False)


def _known_not_one(size) -> bool:
    if isinstance(size, int):
        return size != 1
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(size != 1)


def _symbolic_strides(tensors, shape: tuple):
    """`elementwise_strides` with symbolic sizes, by PyTorch's own rule on the broadcast
    layouts (`_Broadcast`) instead of fake tensors (a fake tensor with symbolic sizes costs
    milliseconds to make); None where a broadcast is not known without a guard, and for static
    sizes (plain meta tensors are cheap)."""
    env = None
    for size in (*shape, *(v for t in tensors for v in (*t.shape, *t.stride()))):
        if isinstance(size, torch.SymInt):
            env = size.node.shape_env
            break
    if env is None:
        return None
    operands = _broadcast_operands(tensors, shape)
    if not operands or len(shape) == 1:
        return None
    from torch._prims_common import (
        compute_elementwise_output_logical_to_physical_perm,
        is_non_overlapping_and_dense_or_false,
        make_contiguous_strides_for,
    )
    from torch.fx.experimental import _config

    oblivious = getattr(env, "_fulmen_generalised_ones", False)  # as `_size_oblivious`
    with _config.patch(backed_size_oblivious=True) if oblivious else contextlib.nullcontext():
        if len(operands) == 1 and is_non_overlapping_and_dense_or_false(operands[0]):
            return operands[0].strides
        # one operand with gaps or overlaps (a slice `x[..., :d]` negated): PyTorch's rule
        # takes `empty_like` of it, whose preserved layout is this same permutation laid out
        # densely (`torch._refs.empty_like`), as TensorIterator's for several operands
        perm, _ = compute_elementwise_output_logical_to_physical_perm(*operands,
                                                                      _skip_checks=True)
    physical = make_contiguous_strides_for([shape[d] for d in perm])
    strides = [0] * len(shape)
    for position, dim in enumerate(perm):
        strides[dim] = physical[position]
    return tuple(strides)


def _row_major_strides(shape) -> tuple:
    """Row-major strides of `shape`, symbolic sizes included (no comparison, so no guard; a
    size 0 or 1 multiplies the strides before it as PyTorch's do: `max(size, 1)`)."""
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc = acc * (size if isinstance(size, torch.SymInt) else max(size, 1))
    return tuple(reversed(strides))


def convolution_strides(input, weight, shape, stride, padding, dilation, groups: int):
    """Eager's strides for a convolution's output of `shape` on CPU, or None elsewhere.

    NOTE [convolution layout]: PyTorch's meta kernel lays a convolution's output out
    contiguously, but eager picks a backend and the backend a memory format: on CPU
    channels_last when the input *or the weight* suggests it (a model converted with
    `.to(memory_format=...)` fed a contiguous batch). The same C++ functions eager calls
    answer here, on uninitialised CPU tensors of the arguments' layouts (no page is touched).
    """
    if input.device.type != "cpu" or weight.dim() not in (4, 5):
        return None
    real_input = torch.empty_strided(tuple(input.shape), tuple(input.stride()), dtype=input.dtype)
    real_weight = torch.empty_strided(tuple(weight.shape), tuple(weight.stride()),
                                      dtype=weight.dtype)
    if input.dim() == weight.dim() - 1:  # unbatched: eager adds the batch dim
        real_input = real_input.unsqueeze(0)
    zeros = [0] * (weight.dim() - 2)
    with torch._C.DisableTorchFunction():
        backend = torch._C._select_conv_backend(real_input, real_weight, None, list(stride),
                                                list(padding), list(dilation), False, zeros,
                                                groups, None)
        memory_format = torch._C._conv_determine_backend_memory_format(real_input, real_weight,
                                                                       backend)
    batched = tuple(shape) if input.dim() == weight.dim() else (1, *shape)
    layout = torch.empty(batched, device="meta", memory_format=memory_format)
    return layout.stride() if input.dim() == weight.dim() else layout.squeeze(0).stride()


def with_strides(proxy: TensorProxy, strides, exact: bool = True) -> TensorProxy:
    """A proxy for the same value as `proxy` (same name and metadata) that reports `strides`,
    marked `exact` (eager's). Proxies keep their strides in C++ and cannot be restrided in
    place beyond their storage, hence a new object."""
    new = TensorProxy(proxy.name, proxy.shape, proxy.dtype, proxy.device, strides=strides,
                      requires_grad=proxy.requires_grad)
    new.__dict__.update(proxy.__dict__)
    new._fulmen_exact_strides = exact
    return new


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
