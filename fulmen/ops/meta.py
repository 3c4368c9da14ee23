"""Helpers shared by meta functions: proxies <-> PyTorch meta tensors.

Where an op's output shape rules are intricate (matmul, convolution, pad, indexing, every opaque
op) the meta function runs PyTorch's own meta kernel on storage-less `device="meta"` tensors and
reads the result's metadata. PyTorch is the reference for shapes, so this is exact.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import warnings
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from fulmen.core.ambient import without_cast_cache
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import requires_grad_of, strides_of


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
    with _fake_mode((args, kwargs)), _fake_tensor_log_off(), _meta_device(device):
        meta_args, meta_kwargs = to_meta((args, kwargs))
        with torch._C.DisableTorchFunction(), torch.no_grad():
            return fn(*meta_args, **meta_kwargs), device


# PyTorch's fake tensor mode logs a meta kernel's failure at ERROR (with a traceback) before
# raising it; here a failure is an answer (no layout, or a graph break), not the user's error
_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")


@contextlib.contextmanager
def fake_run(allow_non_fake_inputs: bool = False):
    """The context of a run on fake tensors that describes a call (its casts under autocast, a
    custom `autograd.Function`'s outputs): torch functions off, a `FakeTensorMode` entered
    (yielded), and the user's ambient state kept from reaching the fakes. Outside inference
    mode: there the fake mode gets a composite op whole (`aten.gru.input`, so autocast's casts
    inside it are not seen), and fakes made inside it are inference tensors, without the
    version counter an in-place check reads. Autocast's cast cache off: a fake cast of a real
    leaf cached there (a module's weight) was what the compiled call's own casts of that
    weight returned."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch._C.DisableTorchFunction(), torch.inference_mode(False), without_cast_cache(), \
            FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs) as mode:
        yield mode


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
            sizes = (*leaf.shape, *strides_of(leaf))
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
        sizes = (*value.shape, *strides_of(value))
        if any(isinstance(size, torch.SymInt) for size in sizes):
            return (torch.Tensor, tuple(_layout_key(v, envs) for v in sizes), value.ndim,
                    value.dtype, value.device)
        return (value.shape, strides_of(value), value.dtype, value.device)
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


# NOTE [meta kernels see the device]: some of PyTorch's Python meta kernels lay their outputs
# out by the device the call runs on (`linalg_svd`'s Vh and `linalg_eig`'s vectors are
# column-major on the CPU, row-major for cuSOLVER), asking `device_hint`, which answers "cuda"
# for a tensor on the meta device. While `call_on_meta` runs, it answers the device the meta
# tensors stand for instead (a thread-local, so another thread's meta calls are untouched).
_META_DEVICE = threading.local()


def _device_hint_hook(original):
    def device_hint(tensor) -> str:
        device = getattr(_META_DEVICE, "type", None)
        if device is not None and getattr(getattr(tensor, "device", None), "type", None) == "meta":
            return device
        return original(tensor)

    device_hint._fulmen_original = original
    return device_hint


@contextlib.contextmanager
def _meta_device(device: torch.device):
    """PyTorch's meta kernels take `device` for the device of meta tensors while this runs."""
    registrations = sys.modules.get("torch._meta_registrations")
    original = getattr(registrations, "device_hint", None)
    if original is not None and not hasattr(original, "_fulmen_original"):
        registrations.device_hint = _device_hint_hook(original)
    previous = getattr(_META_DEVICE, "type", None)
    _META_DEVICE.type = device.type
    try:
        yield
    finally:
        _META_DEVICE.type = previous


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


def with_strides(proxy: TensorProxy, strides, exact: bool = True) -> TensorProxy:
    """A proxy for the same value as `proxy` (same name and metadata) that reports `strides`,
    marked `exact` (eager's). Proxies keep their strides in C++ and cannot be restrided in
    place beyond their storage, hence a new object."""
    new = TensorProxy(proxy.name, proxy.shape, proxy.dtype, proxy.device, strides=strides,
                      requires_grad=requires_grad_of(proxy))
    new.__dict__.update(proxy.__dict__)
    new._fulmen_exact_strides = exact
    return new


