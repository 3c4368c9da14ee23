"""`TensorProxy`: a `torch.Tensor` wrapper subclass without storage.

Being a real `torch.Tensor` subclass matters: model code checks `isinstance(x, torch.Tensor)`
and reads `.shape`, `.dtype`, `.device`, `.dim()`, `.stride()`; all of these are answered by the
wrapper's own metadata, which PyTorch stores in C++. Every other torch call on a proxy arrives in
`__torch_function__` and is handed to the trace being recorded (`TraceCtx.torch_function`, set
by the tracer), which records it as a symbol. Nothing ever computes on a proxy: if a call slips
past `__torch_function__` into the dispatcher, `__torch_dispatch__` raises.
"""

from __future__ import annotations

import sys

import torch

from fulmen.core.errors import FulmenError, RunsEagerly
from fulmen.core.names import NameAllocator
from fulmen.core.printer import size_text
from fulmen.core.proxy import Proxy, strides_of
from fulmen.core.source import is_internal, user_source_location
from fulmen.core.trace import get_tracectx

_DTYPE_SHORT = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "f8e4m3", torch.float8_e5m2: "f8e5m2",
    torch.complex64: "c64", torch.complex128: "c128", torch.complex32: "c32",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.uint16: "u16", torch.uint32: "u32", torch.uint64: "u64",
    torch.bool: "b8",
}  # fmt: skip

_fallback_names = NameAllocator()

_T = torch.Tensor
_METADATA_PROPERTIES = (
    "shape", "dtype", "device", "ndim", "requires_grad", "layout", "is_leaf", "is_cuda", "is_cpu",
    "is_meta", "is_sparse", "is_quantized", "is_mps", "is_xpu", "is_nested", "itemsize", "nbytes",
    "grad_fn", "is_mkldnn", "is_sparse_csr", "output_nr", "_version", "grad",
)  # fmt: skip
_METADATA_METHODS = (
    "size", "dim", "ndimension", "stride", "numel", "nelement", "is_contiguous",
    "is_floating_point", "is_complex", "is_signed", "element_size", "get_device",
    "storage_offset", "__len__", "__hash__", "is_inference", "has_names", "is_shared",
    "is_pinned", "__sizeof__",
)  # fmt: skip
# Calls answered from the proxy's own metadata, with no tracing involved.
METADATA_FUNCTIONS = frozenset(
    [getattr(_T, name).__get__ for name in _METADATA_PROPERTIES if hasattr(_T, name)]
    + [getattr(_T, name) for name in _METADATA_METHODS if hasattr(_T, name)]
    + [torch.is_floating_point, torch.is_complex, torch.numel]
)


_STORAGE_OFFSET = _T.storage_offset
_IS_CONTIGUOUS = _T.is_contiguous
_REQUIRES_GRAD = _T.requires_grad.__get__
_DEVICE = _T.device.__get__


def requires_grad_of(tensor: torch.Tensor) -> bool:
    """`tensor.requires_grad` for fulmen's own reads, as `strides_of` (`fulmen.core.proxy`: no
    subclass round trip; read each time, since `requires_grad_()` changes it)."""
    with torch._C.DisableTorchFunctionSubclass():
        return _REQUIRES_GRAD(tensor)


def differentiable_value(value) -> bool:
    """Whether `value` is a tensor proxy whose dtype autograd differentiates (floating or
    complex): `differentiable_value(x)` for an f32 `x` is True, for an index tensor False."""
    return isinstance(value, TensorProxy) and (value.dtype.is_floating_point
                                               or value.dtype.is_complex)


def dtype_short_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `'f32'` (the notation of type comments)."""
    return _DTYPE_SHORT.get(dtype, str(dtype).removeprefix("torch."))


class AttributeOnTracedTensor(RunsEagerly):
    """The traced code stores an attribute on a tensor (see `TensorProxy.__setattr__`): the call
    runs eagerly."""


def contiguous_strides(shape) -> tuple[int, ...]:
    """Row-major strides (in elements) for `shape`."""
    shape = tuple(shape)
    memo, key = shape_env_memo(shape, "_fulmen_contiguous_strides")
    if key is not None and key in memo:
        return memo[key]
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    strides = tuple(reversed(strides))
    if key is not None:
        memo[key] = strides
    return strides


def shape_env_memo(sizes, name: str) -> tuple[dict | None, tuple | None]:
    """`(memo, key)` for an answer about `sizes` kept by their ShapeEnv (in its attribute
    `name`) and keyed by the sizes' expressions, or `(None, None)` when no size is symbolic or
    they come from several ShapeEnvs. NOTE [answers kept by the ShapeEnv]: a trace with symbolic
    sizes asks the same questions of the same sizes hundreds of times (every proxy made of a
    shape, every comparison of two shapes), and each asks sympy anew (SymInt arithmetic builds
    expressions, ~40 us an operation); what an answer depends on (the expressions, the guards
    recorded while computing it, which hold from then on) is the same for a later asking."""
    env = None
    for size in sizes:
        if isinstance(size, torch.SymInt):
            size_env = size.node.shape_env
            if env is None:
                env = size_env
            elif size_env is not env:
                return None, None
    if env is None:
        return None, None
    key = tuple(size.node.expr if isinstance(size, torch.SymInt) else size for size in sizes)
    return env.__dict__.setdefault(name, {}), key


def known_same_shape(a, b) -> bool:
    """Whether shapes `a` and `b` are equal for every value their symbolic sizes
    (`fulmen.tracer.symbolic`) may take, decided without recording a guard: False when they
    differ and when the answer depends on the sizes (`(s0*s1, 32)` against `(32, 32)`).

    For fast paths that skip an op which would be a no-op on equal shapes (the general path
    must be right for equal shapes too). Comparing the tuples directly would record a guard
    such as `s0*s1 != 32`, and Python compares tuples element by element even when their
    lengths differ.
    """
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is y:
            continue
        if type(x) is int and type(y) is int:
            if x != y:
                return False
            continue
        # known equalities are kept by the ShapeEnv (NOTE [answers kept by the ShapeEnv]: a
        # guard added later only adds facts); an unknown one is asked again
        known, key = shape_env_memo((x, y), "_fulmen_known_same")
        if key is not None and key in known:
            continue
        equal = x == y
        if isinstance(equal, bool):
            if not equal:
                return False
        elif not _statically_known_true(equal):
            return False
        if key is not None:
            known[key] = True
    return True


def row_major(tensor: torch.Tensor) -> bool | None:
    """Whether `tensor` is contiguous (row-major), decided without recording a guard where
    the sizes decide it; None when it is row-major exactly if its sizes that may be 1 are 1
    (a batch of 1 traced with a symbol, see `fulmen.tracer.symbolic`: `labels[..., 1:]` of
    a `(s0, s1 + 1)` tensor). Other questions (are two symbols equal?) are left to PyTorch's
    own check, which records its guard.

    PyTorch's rule: every dimension of size other than 1 has the stride of the row-major
    layout (the product of the sizes after it)."""
    undecided = False
    expected = 1
    for size, stride in zip(reversed(tensor.shape), reversed(tensor.stride())):
        if isinstance(size, int) and isinstance(stride, int) and isinstance(expected, int):
            if size != 1 and stride != expected:
                return False
        elif not (_known(size == 1) or _known(stride == expected)):
            if not _known(stride != expected):
                with torch._C.DisableTorchFunctionSubclass():
                    return _IS_CONTIGUOUS(tensor)  # a question about the sizes: guarded
            if _known(size != 1):
                return False
            undecided = True  # row-major only where this size is 1
        expected = expected * size
    return None if undecided else True


def _storage_size(shape, strides, storage_offset, dtype: torch.dtype) -> int | None:
    """The byte size of a proxy's (absent) storage where a size, stride or offset is symbolic:
    the one its sizes in the traced call span (`size_hints`), a plain int. NOTE [proxy storage
    size]: PyTorch computes a symbolic storage size for `_make_wrapper_subclass` when none is
    given, a sympy sum of products per proxy (about 0.4 ms each, most of the time of making a
    symbolic proxy; 9,000 SymInt operations in a Llama trace). A proxy has no storage and
    nothing reads its size (fake tensors for meta kernels are made from the proxy's shape and
    strides, `ops/meta.py`), so a hint is enough. None for static proxies (PyTorch's own)."""
    symbolic = (*shape, *strides, storage_offset)
    if not any(isinstance(size, torch.SymInt) for size in symbolic):
        return None
    sizes, steps = size_hints(shape), size_hints(strides)
    if 0 in sizes:
        return 0
    offset = storage_offset.node.hint if isinstance(storage_offset, torch.SymInt) else storage_offset
    span = 1 + sum((size - 1) * abs(step) for size, step in zip(sizes, steps))
    return (offset + span) * dtype.itemsize


def _known(condition) -> bool:
    return condition if isinstance(condition, bool) else _statically_known_true(condition)


def size_hints(sizes) -> tuple[int, ...]:
    """`sizes` (or strides) with each symbolic size replaced by its value in the traced call,
    without recording a guard: for questions whose answer must not depend on the sizes (which
    outputs need grad, which attention kernel eager picks)."""
    return tuple(size.node.hint if isinstance(size, torch.SymInt) else size for size in sizes)


def _statically_known_true(condition: torch.SymBool) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(condition)


def _read_by_user_code() -> bool:
    """Whether a trace records and the caller of the calling dunder (`__repr__`, `__format__`)
    is the user's code, not fulmen's or torch's."""
    ctx = get_tracectx()
    return ctx is not None and getattr(ctx, "torch_function", None) is not None and \
        not is_internal(sys._getframe(2).f_code.co_filename)


class TensorProxy(torch.Tensor, Proxy):
    """A tensor's metadata (shape, dtype, device, strides, requires_grad) and an SSA name.

    Example:
        >>> p = TensorProxy("x", (4, 4), torch.float32, torch.device("cpu"))
        >>> p.shape, p.type_string()
        (torch.Size([4, 4]), 'cpu f32[4, 4]')
    """

    @property
    def name(self) -> str:
        """The SSA name of this proxy in its trace."""
        return self._fulmen_name

    @staticmethod
    def __new__(
        cls,
        name: str | None,
        shape,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        requires_grad: bool = False,
        strides=None,
        storage_offset: int = 0,
    ):
        # symbolic sizes (`torch.SymInt`, fulmen.tracer.symbolic) stay symbolic
        shape = tuple(size if isinstance(size, torch.SymInt) else int(size) for size in shape)
        row_major = strides is None
        strides = contiguous_strides(shape) if row_major else tuple(strides)
        proxy = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=strides,
            dtype=dtype,
            device=torch.device(device),
            requires_grad=requires_grad,
            storage_offset=storage_offset,
            storage_size=_storage_size(shape, strides, storage_offset, dtype),
        )
        if name is None:
            ctx = get_tracectx()
            name = ctx.names.new() if ctx is not None else _fallback_names.new("p")
        proxy._fulmen_name = name
        # made with the row-major strides of its shape: contiguous (`is_contiguous`). Its own id,
        # not True: a copy of its attributes onto a proxy of other strides (`with_strides`)
        # must not carry the answer over
        proxy._fulmen_made_row_major = id(proxy) if row_major else None
        with torch._C.DisableTorchFunctionSubclass():  # no round trip: see `strides_of`
            proxy._fulmen_meta = (torch.Size(shape), dtype, _DEVICE(proxy))
        return proxy

    # shape, dtype and device are read constantly by decompositions and passes: answered from
    # Python attributes instead of a __torch_function__ round trip (the values never change)
    @property
    def shape(self) -> torch.Size:
        return self._fulmen_meta[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._fulmen_meta[1]

    @property
    def device(self) -> torch.device:
        return self._fulmen_meta[2]

    def __init__(self, *args, **kwargs):
        pass

    def __setattr__(self, name: str, value) -> None:
        """An attribute the user's code stores on a traced tensor (`w.last_input = y` on an
        argument, `out.meta = ...` on a result): eager keeps it on the real tensor, a compiled
        call would drop it, so the call runs eagerly (`AttributeOnTracedTensor`). Tensor
        properties (`grad`, `data`, `requires_grad`) and fulmen's own attributes pass."""
        if not name.startswith("_fulmen") and not hasattr(TensorProxy, name) \
                and get_tracectx() is not None \
                and not is_internal(sys._getframe(1).f_code.co_filename):
            raise AttributeOnTracedTensor(
                f"the function stores the attribute {name!r} on a traced tensor; a compiled "
                "call would not keep it on the real tensor", op="setattr",
                where=user_source_location(),
                hint="keep the value in a dict or an object attribute instead")
        super().__setattr__(name, value)

    @classmethod
    def like(cls, other: torch.Tensor, *, shape=None, dtype=None, device=None) -> TensorProxy:
        """A new proxy with `other`'s metadata, with shape/dtype/device overridden if given."""
        return cls(
            None,
            other.shape if shape is None else shape,
            other.dtype if dtype is None else dtype,
            other.device if device is None else device,
        )

    def type_string(self) -> str:
        dims = ", ".join(size_text(size) for size in self.shape)
        return f"{self.device} {dtype_short_name(self.dtype)}[{dims}]"

    def __repr__(self, *, tensor_contents=None) -> str:
        """User code reading a traced tensor's text (`str(t)`, `repr(t)`, `"%s" % t`, a log
        record's arguments) gets eager's text, a graph break as `__format__`'s; fulmen's and
        torch's own messages get the placeholder `<TensorProxy t0: "cpu f32[2]">`."""
        if _read_by_user_code():
            return get_tracectx().torch_function(torch.Tensor.__repr__, (type(self),), (self,),
                                                 {})
        return f'<TensorProxy {self.name}: "{self.type_string()}">'

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        """User code formatting a traced tensor (`f"expert_{idx}"` with a 0-d index: HF Switch
        Transformers) gets eager's text, a graph break (`Tensor.__format__` is value-dependent
        in `fulmen.tracer.dispatch`); fulmen's and torch's own messages get the proxy's repr."""
        if _read_by_user_code():
            return get_tracectx().torch_function(torch.Tensor.__format__, (type(self),),
                                                 (self, spec), {})
        return TensorProxy.__repr__(self)

    def __reduce_ex__(self, protocol):
        raise FulmenError("a traced tensor cannot be pickled or deep-copied", op="pickle")

    def __deepcopy__(self, memo):
        raise FulmenError("a traced tensor cannot be deep-copied while tracing", op="copy.deepcopy")

    def storage_offset(self) -> int:
        """The offset of the tensor's first element in its storage (elements). An input's offset
        is guarded only when the program reads it (the tracer's `offset_reads`): slices of one
        buffer at different offsets otherwise share a compilation."""
        ctx = get_tracectx()
        reads = getattr(ctx, "offset_reads", None)
        if reads is not None:
            reads.add(self.name)
        if ctx is not None and ctx.undecided_layouts:
            ctx.check_layout_read(self, "storage_offset()", sys._getframe(1))
        return _STORAGE_OFFSET(self)

    def is_contiguous(self, memory_format=torch.contiguous_format) -> bool:
        """Whether the tensor is laid out row-major (or in `memory_format`). With symbolic sizes,
        strides that equal the row-major strides of the shape for every size (`(32*s1, 32, 1)`
        for `[s0, s1, 32]`) answer True without a guard; PyTorch's own check would ask whether
        `s0 == 1` (its stride may be anything then) and specialise a batch of 1. A proxy made
        with its shape's row-major strides (no `strides=`) answers True at once."""
        if memory_format is torch.contiguous_format \
                and getattr(self, "_fulmen_made_row_major", None) == id(self):
            return True
        if memory_format is torch.contiguous_format and any(
                isinstance(size, torch.SymInt) for size in self.shape):
            # a known answer is kept by the ShapeEnv (NOTE [answers kept by the ShapeEnv])
            known, key = shape_env_memo((*self.shape, *strides_of(self)), "_fulmen_row_major")
            if key is not None and key in known:
                return True
            strides, acc = [], 1
            for size in reversed(self.shape):
                strides.append(acc)
                acc = acc * size if isinstance(size, torch.SymInt) else acc * max(size, 1)
            if known_same_shape(strides_of(self), tuple(reversed(strides))):
                if key is not None:
                    known[key] = True
                return True
        with torch._C.DisableTorchFunctionSubclass():
            return _IS_CONTIGUOUS(self, memory_format=memory_format)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in METADATA_FUNCTIONS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        ctx = get_tracectx()
        if ctx is None or ctx.torch_function is None:
            raise FulmenError(
                "a TensorProxy was used outside tracing; traced tensors cannot escape the trace",
                op=getattr(func, "__name__", str(func)),
            )
        return ctx.torch_function(func, types, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if torch._C._functorch.maybe_current_level() is not None or _in_functorch():
            raise RunsEagerly(  # functorch's wrappers live below __torch_function__
                "a torch.func transform (vmap, grad, jacrev) of traced tensors: fulmen traces "
                "no function transforms", op="torch.func", where=user_source_location(),
                hint="compile the function the transform is applied to instead")
        raise FulmenError(
            "reached the dispatcher with a traced tensor (an op escaped __torch_function__)",
            op=str(func),
            hint="please report this: the op needs routing in fulmen.tracer.dispatch",
        )


def _in_functorch() -> bool:
    """Whether torch.func's Python machinery (vmap's batch-dimension bookkeeping) is on the
    stack: its ops reach the dispatcher, never `__torch_function__`."""
    frame = sys._getframe(1)
    while frame is not None:
        if "torch/_functorch" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


def is_proxy(value) -> bool:
    return isinstance(value, TensorProxy)
