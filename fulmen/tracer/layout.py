"""Eager's output layouts of torch-level ops by rule, without a meta kernel.

NOTE [layout queries stay cheap]: the tracer gives each output proxy of a decomposed op eager's
strides (NOTE [layout truth] in `fulmen.tracer.layout_truth`). Asking PyTorch's meta kernel costs a
Python call per op, and many meta kernels are Python references whose first call imports
`torch._dynamo` (seconds); the common ops need neither: `rule_layouts` answers for elementwise
maps, ops on contiguous tensors, lone permutes, basic indexing, low-rank cats, layer norm and
convolutions, and the tracer asks the meta kernel only for the rest (`fulmen.ops.meta.eager_layouts`).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from fulmen.core.proxy import iter_proxies
from fulmen.ops.elementwise_layout import elementwise_strides
from fulmen.ops.kernel_layouts import attention_strides, batch_norm_strides, convolution_strides
from fulmen.ops.opaque import attention_like_query
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import contiguous_strides, known_same_shape, strides_of
from fulmen.tracer.objects import PLAIN_NUMBER

T = torch.Tensor

# the op itself, as imported (during a symbolic trace `F.scaled_dot_product_attention` is a wrapper
# deciding symbolic bools: `fulmen.tracer.bool_args`)
_ATTENTION = F.scaled_dot_product_attention

_MAPS = frozenset({"elementwise", "reduction"})


def _producer(bsym, name: str):
    """The prim inside `bsym`'s decomposition that computed `name` (None if not found)."""
    for sub in reversed(bsym.subsymbols):
        if name in sub.output_names:
            return sub if sub.sym.is_prim else _producer(sub, name)
    return None


def is_elementwise_map(bsym) -> bool:
    """Whether a decomposition is an elementwise map: elementwise prims and broadcasts of
    trailing dimensions (numpy's rule, as TensorIterator broadcasts) only."""
    for sub in bsym.subsymbols:
        if sub.sym.is_prim:
            if sub.sym.name == "broadcast_in_dim":
                rank, dims = len(sub.args[1]), tuple(sub.args[2])
                if dims != tuple(range(rank - len(dims), rank)):
                    return False
            elif "elementwise" not in sub.sym.tags:
                return False
        elif not is_elementwise_map(sub):
            return False
    return bool(bsym.subsymbols)


_CONVOLUTIONS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_ROLLS = frozenset({torch.roll, T.roll})
_ROW_MAJOR_RESULTS = frozenset({F.layer_norm, torch.masked_fill, T.masked_fill, F.one_hot,
                                F.nll_loss, F.cross_entropy, F.embedding})
# softmax and log_softmax on CPU normalise a contiguous copy into a new contiguous result
# (checked for transposed, channels_last, permuted, sliced and expanded inputs, any dim)
_ROW_MAJOR_ON_CPU = frozenset({F.softmax, torch.softmax, T.softmax, F.log_softmax,
                               torch.log_softmax, T.log_softmax})


# eager's CPU dropout in training, 0 < p < 1 (`at::native::_dropout`): `input * noise`, with
# `noise = empty_like(input).bernoulli_(1 - p)`; the other cases return the input itself (no
# new proxy) or multiply it by a 0-dim zero (an elementwise map)
_DROPOUTS = frozenset({F.dropout, torch.dropout})


def _dropout_strides(args, kwargs, output: TensorProxy):
    """The strides of eager's training dropout of `input` (the decomposition's new `output`
    proxy): TensorIterator's over `input` and its `empty_like` mask, which follows `input`'s
    stride order (dense where `input` has gaps), so the rule of a map of `input` alone; None
    (the meta kernel answers) where a size-1 dim of `input` has an odd stride (NOTE [size-1
    strides]: TensorIterator's fast setup may then write row-major) or the shapes differ."""
    input = args[0] if args else kwargs.get("input")
    if not isinstance(input, TensorProxy) or not known_same_shape(tuple(input.shape),
                                                                  tuple(output.shape)):
        return None
    with torch._C.DisableTorchFunctionSubclass():
        if _odd_size_one_strides(input):
            return None
    return elementwise_strides([input], tuple(output.shape))


def _conv_layouts(func, args, kwargs, shape):
    """Eager's output layout of `F.conv{1,2,3}d` (NOTE [convolution layout]), or None."""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    bound = dict(zip(names, args)) | kwargs
    spatial = _CONVOLUTIONS[func]

    def expand(value, default):
        value = default if value is None else value
        return [value] * spatial if isinstance(value, int) else list(value)

    if isinstance(bound.get("padding"), str):
        return None
    strides = convolution_strides(bound["input"], bound["weight"], shape,
                                  expand(bound.get("stride"), 1), expand(bound.get("padding"), 0),
                                  expand(bound.get("dilation"), 1), bound.get("groups") or 1)
    return None if strides is None else [(shape, strides)]


def rule_layouts(func, bsym, args, kwargs, leaves):
    """Eager's (shape, strides) for each tensor output when a rule gives them without a meta
    kernel (NOTE [layout queries stay cheap]), else None:

    - an elementwise map (its decomposition is elementwise prims and broadcasts, as eager's
      kernel is one TensorIterator): the TensorIterator rule over the tensor arguments;
    - a lone permute (transpose, `.T`, `movedim`, ...): the input's strides permuted, which
      the prim reports already;
    - every tensor argument contiguous and every output computed by an elementwise or
      reduction prim, or a reshape or cat of the arguments: row-major (TensorIterator over
      contiguous operands; reductions and cat of contiguous tensors allocate contiguous
      results; a view of a contiguous tensor is contiguous);
    - `F.linear` of a contiguous input: row-major (eager multiplies the input flattened to
      2-d into a new matrix);
    - `F.layer_norm`, `masked_fill`, `F.one_hot`, `F.nll_loss`, `F.cross_entropy`,
      `F.embedding`, and on CPU `softmax`/`log_softmax`: row-major (eager normalises a
      contiguous copy into a contiguous result; masked_fill fills a copy made with
      `resize_as_`; one_hot scatters into new zeros; the losses allocate theirs; embedding
      views a new `index_select` result);
    - a reduction with `keepdim=True` of contiguous tensors: row-major, as without it;
    - 1-3-d convolutions on CPU: the memory format eager's backend picks;
    - basic indexing (`x[:, None, 1:]`): the view's strides (`basic_index_strides`);
    - `cat` with an input that suggests no channels-last format: row-major (NOTE [cat layout]);
    - a training dropout: the map rule over its input (`_dropout_strides`);
    - `F.group_norm` and `roll` on CPU: the input's suggested memory format, as the CPU kernel
      allocates it (channels_last for a channels-last input; PyTorch's meta kernel answers
      row-major).
    """
    outputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if bsym is None or not all(isinstance(leaf, TensorProxy) for leaf in outputs):
        return None
    inputs = [p for p in iter_proxies((args, kwargs)) if isinstance(p, TensorProxy)]
    if func in _CONVOLUTIONS and len(outputs) == 1:
        return _conv_layouts(func, args, kwargs, tuple(outputs[0].shape))
    if func is _ATTENTION and len(outputs) == 1:
        return _attention_layouts(args, kwargs, outputs[0])
    if func in _ROW_MAJOR_RESULTS or (func in _ROW_MAJOR_ON_CPU and all(
            leaf.device.type == "cpu" for leaf in outputs)):
        return [(leaf.shape, contiguous_strides(leaf.shape)) for leaf in outputs]
    if func is T.__getitem__ and len(outputs) == 1 and len(args) == 2 and not kwargs:
        strides = basic_index_strides(args[0], args[1])
        if strides is not None and len(strides) == outputs[0].ndim:
            return [(outputs[0].shape, strides)]
    if func in _CATS and len(outputs) == 1:
        strides = _cat_strides(args, kwargs, tuple(outputs[0].shape))
        if strides is not None:
            return [(outputs[0].shape, strides)]
    if func in _DROPOUTS and len(outputs) == 1:
        strides = _dropout_strides(args, kwargs, outputs[0])
        if strides is not None:
            return [(outputs[0].shape, strides)]
    if (func is F.group_norm or func in _ROLLS) and len(outputs) == 1:
        strides = batch_norm_strides(args[0] if args else kwargs.get("input"),
                                     tuple(outputs[0].shape))
        if strides is not None:
            return [(outputs[0].shape, strides)]
    if func is F.linear and len(outputs) == 1:
        input = args[0] if args else kwargs.get("input")
        with torch._C.DisableTorchFunctionSubclass():
            if isinstance(input, TensorProxy) and input.is_contiguous():  # an mm of it, flat
                return [(outputs[0].shape, contiguous_strides(outputs[0].shape))]
    producers = [_producer(bsym, leaf.name) for leaf in outputs]
    if any(p is None for p in producers):
        return None
    if len(outputs) == 1 and "elementwise" in producers[0].sym.tags and is_elementwise_map(bsym):
        # the operands are the tensors the map reads (`x.type_as(y)` reads only x)
        read = {proxy.name for sub in bsym.subsymbols for proxy in iter_proxies(
            (sub.args, sub.kwargs))}
        operands = [proxy for proxy in inputs if proxy.name in read]
        shape = tuple(outputs[0].shape)
        if any(_odd_size_one_strides(proxy) for proxy in operands) \
                and _fast_setup(func, args, kwargs, operands, shape):
            return [(outputs[0].shape, contiguous_strides(shape))]
        return [(outputs[0].shape, elementwise_strides(operands, shape))]
    if len(bsym.subsymbols) == 1 and producers[0].sym.name == "permute":
        return [(leaf.shape, leaf.stride()) for leaf in outputs]  # the input's, permuted
    with torch._C.DisableTorchFunctionSubclass():
        if not all(p.is_contiguous() for p in inputs):
            return None
    if len(outputs) == 1 and "elementwise" in producers[0].sym.tags \
            and any(_odd_size_one_strides(p) for p in inputs) \
            and _fast_setup(func, args, kwargs, inputs, tuple(outputs[0].shape)):
        return [(outputs[0].shape, contiguous_strides(outputs[0].shape))]  # `torch.where(c, x, y)`
    with torch._C.DisableTorchFunctionSubclass():
        if any(_odd_size_one_strides(p) for p in inputs):
            return None  # the meta kernel answers (`_odd_size_one_strides`)
    names = {p.name for p in inputs}
    if all(p.sym.tags & _MAPS or _reshapes_or_cats_inputs(bsym, p, names)
           or _keeps_reduced_dims(bsym, p) for p in producers):
        return [(leaf.shape, contiguous_strides(leaf.shape)) for leaf in outputs]
    return None


# NOTE [size-1 strides]: a tensor that is contiguous by `is_contiguous()` (which ignores the
# strides of size-1 dims) while a size-1 dim has another stride than the row-major one (`(4, 1)`
# with strides `(1, 4)`, a one-token `q.transpose(1, 2)` in decoding) gets eager outputs whose
# layout depends on how the kernel takes its operands: TensorIterator's fast setup (every operand
# a tensor of the output's shape, all contiguous: `neg`, `x + y`, `clamp(min=0)`) allocates
# row-major strides, while a Python number wrapped as an operand (`x * 2`, `where(c, x, 0.0)`)
# or an `empty_like` copy (`x.double()`, `clone`) keeps the size-1 dim's stride, as
# `compute_elementwise_output_strides` states. Meta kernels do not agree with the CPU kernels
# here (meta `relu` keeps the stride, meta `x * 2` drops it). So the op itself runs once on
# two-element stand-ins of its operands (same size-1 dims and their strides, contiguous): a
# row-major result means the fast setup.
def _odd_size_one_strides(t: TensorProxy) -> bool:
    """Whether a static size-1 dim of `t` has a stride not known to be its row-major one.
    A contiguous tensor may have others there (`x.transpose(1, 2)` of a `(2, 1, 8)` tensor has
    strides `(8, 1, 8)`), and eager keeps them through views and elementwise maps
    (`.reshape(2, -1, 1, 1)` gives `(8, 1, 8, 8)`, not `(8, 1, 1, 1)`), which decides the
    memory format a later op suggests (channels-last for `F.interpolate`, and so the order in
    which a dropout mask is drawn) and whether an elementwise kernel takes the fast setup.
    Decided without a guard: a symbolic stride there counts as odd (symbolic sizes are never
    1, so neither is such a stride)."""
    sizes, strides = tuple(t.shape), strides_of(t)
    return any(type(size) is int and size == 1 and not known_same_shape((stride,), (row,))
               for size, stride, row in zip(sizes, strides, contiguous_strides(sizes)))


def _contiguous_beside_size_one(sizes, strides, canonical) -> bool:
    keep = [d for d, size in enumerate(sizes) if not (type(size) is int and size == 1)]
    return known_same_shape(tuple(strides[d] for d in keep), tuple(canonical[d] for d in keep))


def _stand_in(t: TensorProxy) -> torch.Tensor:
    """A real CPU tensor with `t`'s rank, dtype and size-1 dims, 2 where `t`'s size is larger,
    contiguous, with `t`'s strides in its size-1 dims (never used to address memory)."""
    sizes = tuple(1 if type(size) is int and size == 1 else 2 for size in t.shape)
    strides = list(contiguous_strides(sizes))
    for d, size in enumerate(sizes):
        if size == 1:
            stride = t.stride()[d]
            strides[d] = stride if type(stride) is int else 7 * strides[d] + 5
    return torch.empty_strided(sizes, strides, dtype=t.dtype)


def _fast_setup(func, args, kwargs, operands, shape) -> bool:
    """Whether eager's kernel for `func` takes the fast setup with these operands (NOTE
    [size-1 strides]); False when it cannot be told (operands that broadcast or are not
    contiguous never take it) and for empty results (the meta kernel's rule answers)."""
    if any(type(size) is int and size == 0 for size in shape):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        if not all(p.dim() == 0 or (known_same_shape(tuple(p.shape), shape)
                                    and _contiguous_beside_size_one(
                                        tuple(p.shape), p.stride(), contiguous_strides(p.shape)))
                   for p in operands):
            return False
    call = _on_stand_ins(args, kwargs, operands)
    if call is None:
        return False
    try:
        out = _run_quietly(func, *call)
    except Exception:  # an op the stand-ins do not suit: PyTorch's rule answers
        return False
    return isinstance(out, torch.Tensor) and out.stride() == contiguous_strides(out.shape)


def _on_stand_ins(args, kwargs, operands, other=lambda leaf: leaf) -> tuple | None:
    """`(args, kwargs)` with each of the proxies `operands` replaced by its stand-in
    (`_stand_in`) and every other leaf by `other(leaf)`; None where a real tensor or a
    `torch.Generator` is among the arguments (an op never runs on the user's data, nor draws
    from the user's generator)."""
    with torch._C.DisableTorchFunctionSubclass():
        stand_ins = {p.name: _stand_in(p) for p in operands}
    call = pytree.tree_map(
        lambda leaf: stand_ins.get(leaf.name, leaf) if isinstance(leaf, TensorProxy)
        else other(leaf), (args, kwargs))
    mine = {id(t) for t in stand_ins.values()}
    if any(isinstance(leaf, torch.Generator)
           or (isinstance(leaf, torch.Tensor) and id(leaf) not in mine)
           for leaf in pytree.tree_leaves(call)):
        return None
    return call


def _run_quietly(func, args, kwargs):
    """`func(*args, **kwargs)` with torch function handling and warnings off, and torch's
    global CPU generator put back after it: a random op (a training dropout) asked about draws
    from it, which would shift the traced call's own draws from eager's (the stand-ins are CPU
    tensors; a call naming a generator of its own never runs, `_on_stand_ins`). Raises what
    `func` raises."""
    generator = torch.default_generator  # not `torch.set_rng_state`: refused while tracing
    state = generator.get_state()
    try:
        with torch._C.DisableTorchFunction(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return func(*args, **kwargs)
    finally:
        generator.set_state(state)


def _hinted(value):
    """A symbolic number's value in the traced call, read without a guard (the stand-in run of
    `stand_in_layouts` decides no value); other leaves as they are."""
    kind = PLAIN_NUMBER.get(type(value))
    return value if kind is None else kind(value.node.hint)


def stand_in_layouts(func, args, kwargs, leaves):
    """Eager's (shape, strides) for each tensor output of an op recorded whole (an opaque
    symbol: `x * (1.0 + s0)` with a symbolic number) whose operands have odd size-1 strides,
    where PyTorch's meta kernel, which described it, and the CPU kernel disagree (NOTE [size-1
    strides]): the op runs once on stand-ins of its operands (`_stand_in`) on the CPU and on
    the meta device; where the two lay the results out alike, the meta kernel's answer holds
    (None); else each output is laid out densely in the dim order of the CPU result
    (`_dense_strides_alike`), or, where that result has an operand's strides (an `empty_like`
    of it: `sort`, `frexp` of a `(4, 1)` tensor with strides `(1, 4)`), with that operand's.
    None too where an output cannot be told so, for random ops (the caller's check) and where
    a real tensor is among the arguments."""
    outputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    operands = [p for p in iter_proxies((args, kwargs)) if isinstance(p, TensorProxy)]
    with torch._C.DisableTorchFunctionSubclass():
        if not outputs or not all(isinstance(leaf, TensorProxy) and leaf.device.type == "cpu"
                                  for leaf in outputs) \
                or not any(_odd_size_one_strides(p) for p in operands) \
                or not all(p.dim() == 0 or _contiguous_beside_size_one(
                    tuple(p.shape), p.stride(), contiguous_strides(p.shape)) for p in operands):
            return None
    call = _on_stand_ins(args, kwargs, operands, _hinted)
    if call is None:
        return None
    on_meta = pytree.tree_map(
        lambda leaf: torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype,
                                         device="meta")
        if isinstance(leaf, torch.Tensor) else leaf, call)
    try:
        results, described = ([leaf for leaf in pytree.tree_leaves(_run_quietly(func, *each))
                               if isinstance(leaf, torch.Tensor)] for each in (call, on_meta))
    except Exception:  # an op the stand-ins do not suit
        return None
    if len(results) != len(outputs) or [r.stride() for r in results] == [
            d.stride() for d in described]:
        return None  # the meta kernel lays the stand-ins out as the CPU kernel: its answer holds
    layouts = []
    for out, result in zip(outputs, results):
        shape = tuple(out.shape)
        if result.shape != tuple(1 if type(size) is int and size == 1 else 2 for size in shape):
            return None
        strides = _dense_strides_alike(shape, result)
        if strides is None:  # eager's `empty_like` keeps an operand's strides, size-1 dims' too
            kept = [p.stride() for p in operands if known_same_shape(tuple(p.shape), shape)
                    and _stand_in(p).stride() == result.stride()]
            strides = tuple(kept[0]) if kept else None
        if strides is None:
            return None
        layouts.append((out.shape, strides))
    return layouts


def _dense_strides_alike(shape: tuple, result: torch.Tensor) -> tuple | None:
    """Strides for `shape` that lay it out densely in the dim order of `result`'s strides (a
    stand-in of the same rank), or None where `result` is not dense in any order (an expand, a
    gap). Equal strides order a size-1 dim inside the other dim (each size-1 dim's stride is the
    product of the sizes inside it, as eager allocates)."""
    sizes, got = tuple(result.shape), result.stride()
    order = sorted(range(len(sizes)), key=lambda d: (-got[d], sizes[d] == 1))
    expected, strides = [0] * len(sizes), [0] * len(sizes)
    inner_size, inner = 1, 1
    for d in reversed(order):
        expected[d], strides[d] = inner_size, inner
        inner_size, inner = inner_size * sizes[d], inner * shape[d]
    return tuple(strides) if tuple(expected) == tuple(got) else None


# NOTE [cat layout]: eager's `cat` allocates its result in a memory format its inputs suggest
# (`cat_compute_output_memory_format`, over every input, the skipped 1-d empty ones of a fresh
# KV cache included): contiguous as soon as one input suggests contiguous. A tensor suggests
# channels-last only at rank 4 and channels-last-3d only at rank 5, with strides of that order
# (`_channels_last_like`); any other input makes the result row-major, whatever the strides.
# Where every input suggests the channels-last format of its rank, the result is laid out densely
# in that order. Neither asks the meta kernel: a fake `cat` with symbolic sizes costs tens of
# milliseconds, and the rank-5 one imports `torch._dynamo` (NOTE [layout queries stay cheap]),
# so it failed and left the decomposition's row-major strides where eager's are channels-last-3d.
_CATS = frozenset({torch.cat, torch.concat, torch.concatenate})
_CHANNELS_LAST_ORDER = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}  # innermost dim first


def _cat_strides(args, kwargs, shape: tuple) -> tuple | None:
    """Eager's strides for the result (of `shape`) of a `cat` of `args` (NOTE [cat layout]);
    None where the tensors are not all proxies."""
    tensors = args[0] if args else kwargs.get("tensors")
    if not isinstance(tensors, (tuple, list)) or not tensors or not all(
            isinstance(t, TensorProxy) for t in tensors):
        return None
    if any(t.ndim not in _CHANNELS_LAST_ORDER or not _channels_last_like(t) for t in tensors):
        return contiguous_strides(shape)
    strides, inner = [0] * len(shape), 1
    for d in _CHANNELS_LAST_ORDER[len(shape)]:
        strides[d] = inner
        inner = inner * shape[d]
    return tuple(strides)


def _channels_last_like(t: TensorProxy) -> bool:
    """PyTorch's `is_channels_last_strides_2d` for a rank-4 tensor and
    `is_channels_last_strides_3d` for a rank-5 one (what makes `suggest_memory_format`
    channels-last), decision for decision: each comparison of a symbolic size is a guard, as
    in the fake kernel."""
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return False
    low = 0
    for d in _CHANNELS_LAST_ORDER[t.ndim]:
        if sizes[d] == 0 or strides[d] < low:
            return False
        if d == 0 and low == strides[1]:
            return False
        low = strides[d] * sizes[d] if sizes[d] > 1 else strides[d]
    return True


def _keeps_reduced_dims(bsym, producer) -> bool:
    """Whether `producer` only inserts size-1 dims (`broadcast_in_dim` expanding nothing, a
    reduction's `keepdim=True`) into a value a reduction or elementwise prim of `bsym`
    computed: with contiguous inputs that value is row-major, and so is the result."""
    if producer.sym.name != "broadcast_in_dim":
        return False
    source, shape, dims = producer.args[0], tuple(producer.args[1]), tuple(producer.args[2])
    if not isinstance(source, TensorProxy) or source.ndim != len(dims):
        return False
    if any(not (type(shape[d]) is int and shape[d] == 1) for d in range(len(shape))
           if d not in dims):
        return False
    if not known_same_shape(tuple(source.shape), tuple(shape[d] for d in dims)):
        return False
    made = _producer(bsym, source.name)
    return made is not None and bool(made.sym.tags & _MAPS)


_BASIC_INDEX = (int, torch.SymInt, slice, type(None), type(Ellipsis))


def basic_index_strides(tensor, index) -> tuple | None:
    """Eager's strides for `tensor[index]` when `index` is basic (ints, slices of positive
    step, None, Ellipsis), a view: each index applied in turn, as eager's indexing does (an int
    selects, a slice multiplies its dim's stride by the step, None inserts a dim whose stride
    is that of `unsqueeze` there: the size times the stride of the dim it precedes, or 1 at
    the end). None for any other index (a tensor, a bool, a list) and for a non-proxy."""
    if not isinstance(tensor, TensorProxy):
        return None
    items = index if type(index) is tuple else (index,)
    for item in items:
        if type(item) is bool or not isinstance(item, _BASIC_INDEX):
            return None
        if isinstance(item, slice) and not (item.step is None or (type(item.step) is int
                                                                     and item.step >= 1)):
            return None
    consumed = sum(1 for item in items if item is not None and item is not Ellipsis)
    if consumed > tensor.ndim or sum(1 for item in items if item is Ellipsis) > 1:
        return None  # eager raises: the decomposition says so
    sizes, strides = list(tensor.shape), list(tensor.stride())
    dim = 0
    for item in items:
        if item is None:
            stride = 1 if dim >= len(sizes) else sizes[dim] * strides[dim]
            sizes.insert(dim, 1)
            strides.insert(dim, stride)
            dim += 1
        elif item is Ellipsis:
            dim += tensor.ndim - consumed
        elif isinstance(item, slice):
            strides[dim] = strides[dim] * (1 if item.step is None else item.step)
            dim += 1
        else:  # an int selects: the dim goes
            del sizes[dim], strides[dim]
    return tuple(strides)


def _reshapes_or_cats_inputs(bsym, producer, names: set[str]) -> bool:
    """Whether `producer` is a reshape/squeeze of one of the op's (contiguous) inputs `names`,
    or a cat of those inputs or of such reshapes (`torch.stack`)."""
    if producer.sym.name in ("reshape", "squeeze"):
        source = producer.args[0]
        return isinstance(source, TensorProxy) and source.name in names
    if producer.sym.name != "cat":
        return False
    for part in iter_proxies(producer.args[0]):
        if part.name in names:
            continue
        made = _producer(bsym, part.name)
        if made is None or not _reshapes_or_cats_inputs(bsym, made, names) or made.sym.name == "cat":
            return False
    return True



def _attention_layouts(args, kwargs, out):
    """Eager's layout of `F.scaled_dot_product_attention`: the flash kernel's where eager runs
    it (`attention_strides`); else, with symbolic sizes, the math backend's as
    `opaque.attention_like_query` describes it without the meta kernel (which runs that backend
    op by op on fake tensors: 0.2-0.4 s per call for GPT-2's training attention, decomposed
    since its dropout is, NOTE [attention dropout]); else None (the meta kernel answers)."""
    strides = attention_strides(args, kwargs, out)
    if strides is None:
        described = attention_like_query(args, kwargs)
        if described is None or not known_same_shape(described.shape, out.shape):
            return None
        strides = tuple(described.stride())
    return [(out.shape, strides)]
