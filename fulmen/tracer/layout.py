"""Eager's output layouts of torch-level ops by rule, without a meta kernel.

NOTE [layout queries stay cheap]: the tracer gives each output proxy of a decomposed op eager's
strides (NOTE [layout truth] in `fulmen.tracer.layout_truth`). Asking PyTorch's meta kernel costs a
Python call per op, and many meta kernels are Python references whose first call imports
`torch._dynamo` (seconds); the common ops need neither: `rule_layouts` answers for elementwise
maps, ops on contiguous tensors, lone permutes, basic indexing, low-rank cats, layer norm and
convolutions, and the tracer asks the meta kernel only for the rest (`fulmen.ops.meta.eager_layouts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulmen.core.proxy import iter_proxies
from fulmen.ops.elementwise_layout import elementwise_strides
from fulmen.ops.kernel_layouts import attention_strides, batch_norm_strides, convolution_strides
from fulmen.ops.opaque import attention_like_query
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import contiguous_strides, known_same_shape
from fulmen.tracer.stand_in_layouts import fast_setup, odd_size_one_strides

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
        if odd_size_one_strides(input):
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
        if any(odd_size_one_strides(proxy) for proxy in operands) \
                and fast_setup(func, args, kwargs, operands, shape):
            return [(outputs[0].shape, contiguous_strides(shape))]
        return [(outputs[0].shape, elementwise_strides(operands, shape))]
    if len(bsym.subsymbols) == 1 and producers[0].sym.name == "permute":
        return [(leaf.shape, leaf.stride()) for leaf in outputs]  # the input's, permuted
    with torch._C.DisableTorchFunctionSubclass():
        if not all(p.is_contiguous() for p in inputs):
            return None
    if len(outputs) == 1 and "elementwise" in producers[0].sym.tags \
            and any(odd_size_one_strides(p) for p in inputs) \
            and fast_setup(func, args, kwargs, inputs, tuple(outputs[0].shape)):
        return [(outputs[0].shape, contiguous_strides(outputs[0].shape))]  # `torch.where(c, x, y)`
    with torch._C.DisableTorchFunctionSubclass():
        if any(odd_size_one_strides(p) for p in inputs):
            return None  # the meta kernel answers (`odd_size_one_strides`)
    names = {p.name for p in inputs}
    if all(p.sym.tags & _MAPS or _reshapes_or_cats_inputs(bsym, p, names)
           or _keeps_reduced_dims(bsym, p) for p in producers):
        return [(leaf.shape, contiguous_strides(leaf.shape)) for leaf in outputs]
    return None


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
