"""Layout truth at run time: a fused region's kernel writes its outputs row-major whatever
eager's layout (channels-last, a permutation), so every layout-sensitive op torch runs on a
fused tensor must give eager's values, output strides and gradients all the same (NOTE
[output layout] in `fulmen/executors/claim.py`, `in_layout_of` in `fulmen/ops/opaque.py`).

The audit runs a fused prefix (an elementwise map, or a map reading a reduction) of inputs in
each layout (channels-last 4-d and 5-d, permuted, expanded, sliced with an offset and steps)
with the codegen kernels compiled (not their torch fallback), then every consumer of a group
in one jitted function; values, output strides and the input's `.grad` (values and strides,
autograd's layout contract) are compared with eager's. `make test` runs the 4-d groups on a
map; the rest of the matrix is marked slow.
"""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.executors.codegen import set_compile_policy
from tests.layouts import significant_strides


@pytest.fixture(autouse=True)
def _kernels_compiled_at_once():
    previous = set_compile_policy("eager")  # the kernel, not its (re-laid) torch fallback
    yield
    set_compile_policy(previous.mode, previous.hot_calls)


def _layouts_4d():
    return {
        "channels_last": torch.randn(2, 6, 5, 4).contiguous(memory_format=torch.channels_last),
        "permuted": torch.randn(5, 2, 4, 6).permute(1, 3, 0, 2),
        "expanded": torch.randn(2, 6, 1, 4).expand(2, 6, 5, 4),
        "sliced": torch.randn(3, 12, 7, 9)[1:, ::2, 1:6, 1::2],
    }


def _layouts_5d():
    return {
        "channels_last_3d": torch.randn(2, 4, 3, 4, 5).contiguous(
            memory_format=torch.channels_last_3d),
        "permuted_5d": torch.randn(3, 4, 2, 5, 4).permute(2, 1, 0, 4, 3),
    }


_PREFIXES = {
    "map": lambda x: torch.relu(x * 2 + 1),
    "reduction": lambda x: x - x.mean(1, keepdim=True),
}


def _params(seed: int, *shapes):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) for shape in shapes]


def _conv(h, w, b, wt):
    return (F.conv2d(h, w, b, padding=1), F.conv2d(h, w[:, :, :1, :1]),
            F.conv_transpose2d(h, wt, stride=2))


def _norms(h, g, b, ln):
    return (F.batch_norm(h, torch.zeros(6), torch.ones(6), g, b, training=True),
            F.batch_norm(h, torch.full((6,), 0.5), torch.full((6,), 2.0), g, b),
            F.group_norm(h, 3, g, b), F.layer_norm(h, (4,), ln), F.layer_norm(h, (6, 5, 4)),
            F.instance_norm(h, weight=g, bias=b))


def _pools(h):
    pooled, indices = F.max_pool2d(h, 2, return_indices=True, ceil_mode=True)
    adaptive, adaptive_indices = F.adaptive_max_pool2d(h, (3, 2), return_indices=True)
    return (pooled, indices, F.avg_pool2d(h, 2, ceil_mode=True),
            F.adaptive_avg_pool2d(h, (3, 2)), adaptive, adaptive_indices)


def _resampling(h):
    return (F.interpolate(h, scale_factor=2, mode="nearest"),
            F.interpolate(h, size=(7, 9), mode="bilinear", align_corners=False),
            F.interpolate(h, size=(7, 9), mode="bicubic", align_corners=True),
            F.pixel_shuffle(h[:, :4], 2), F.pixel_unshuffle(h[:, :, :4, :4], 2),
            F.unfold(h, 2), F.fold(h.reshape(2, 24, 5), (2, 6), 2),
            F.pad(h, (1, 1, 1, 1), mode="reflect"))


def _linear_algebra(h, m, lw, lb):
    return (h @ m, torch.matmul(h, h.transpose(-1, -2)), F.linear(h, lw, lb),
            F.scaled_dot_product_attention(h, h * 0.5, h))


def _scans_and_sorts(h):
    values, indices = torch.sort(h, 1)
    top, top_indices = torch.topk(h, 2, dim=1)
    return (torch.cumsum(h, 1), values, indices, top, top_indices, h.amax(1), h.argmax(1),
            torch.softmax(h, 1))


def _views_and_copies(h):
    read = h.stride(1) + (10 if h.is_contiguous() else 0) + (
        100 if h.is_contiguous(memory_format=torch.channels_last) else 0)
    return (h, h * read, h.reshape(2, -1) * 3, h.flatten(1), h.contiguous(),
            h.clone(memory_format=torch.preserve_format), torch.zeros_like(h),
            torch.empty_like(h).fill_(1.0) + h, torch.ones_like(h) + h.sum(),
            h.to(memory_format=torch.channels_last), h.unfold(3, 2, 1),
            h.transpose(1, 3).reshape(2, -1), h.sum((2, 3)), torch.cat([h, h * 2], 1),
            torch.stack([h, h], 2), h.index_select(1, torch.tensor([2, 0])),
            F.pad(h, (1, 2, 0, 1)), torch.flip(h, (1,)), torch.roll(h, 1, 2),
            F.channel_shuffle(h, 2))


def _memory_order(h):
    """Ops whose values depend on the order of `h`'s elements in memory: `as_strided` reads
    it, random draws fill it (NOTE [random draws read their input's layout])."""
    return (h.as_strided((2, 3), (1, 2)), h.as_strided((3, 4), (4, 1), 5),
            torch.rand_like(h) * h, F.dropout(h, 0.5, training=True),
            torch.bernoulli(torch.sigmoid(h)),
            F.embedding_bag(torch.tensor([[0, 2], [1, 3]]), h.reshape(-1, 4)[:10]))


def _volumes(h, w3, wt3, g4, b4):
    pooled, indices = F.max_pool3d(h, 2, return_indices=True)
    return (F.conv3d(h, w3), F.conv_transpose3d(h, wt3),
            F.batch_norm(h, None, None, g4, b4, training=True), pooled, indices,
            F.avg_pool3d(h, 2), F.interpolate(h, scale_factor=2, mode="trilinear"),
            F.interpolate(h, scale_factor=2, mode="nearest"), F.group_norm(h, 2),
            F.adaptive_avg_pool3d(h, 2), h.clone(), h)


# group -> (consumers of the fused tensor and parameters, parameter shapes)
_GROUPS_4D = {
    "conv": (_conv, [(3, 6, 3, 3), (3,), (6, 3, 3, 3)]),
    "norms": (_norms, [(6,), (6,), (4,)]),
    "pools": (_pools, []),
    "resampling": (_resampling, []),
    "linear_algebra": (_linear_algebra, [(4, 3), (3, 4), (3,)]),
    "scans_and_sorts": (_scans_and_sorts, []),
    "views_and_copies": (_views_and_copies, []),
    "memory_order": (_memory_order, []),
}
_GROUPS_5D = {"volumes": (_volumes, [(3, 4, 2, 2, 2), (4, 2, 2, 2, 2), (4,), (4,)])}


def _run(fn, x, params):
    """fn's outputs and the gradients of the input and parameters (`.backward()` of a fixed
    random weighting of every floating output)."""
    leaf = x.detach().clone(memory_format=torch.preserve_format)
    if leaf.stride() != x.stride():  # not dense: the same view of a leaf copy of its base
        grad_of = x._base.detach().clone().requires_grad_()
        leaf = torch.as_strided(grad_of, x.shape, x.stride(), x.storage_offset())
    else:
        grad_of = leaf.requires_grad_()
    leaves = [p.clone().requires_grad_() for p in params]
    torch.manual_seed(0)  # the same draws on both sides
    outputs = fn(leaf, *leaves)
    generator = torch.Generator().manual_seed(1)
    loss = sum((out * torch.randn(out.shape, generator=generator)).sum()
               for out in outputs if out.dtype.is_floating_point and out.requires_grad)
    loss.backward()
    return outputs, [grad_of.grad, *(p.grad for p in leaves)]


def _audit(prefix, groups, x):
    """Compare the consumers `groups` ({name: (fn, parameter shapes)}) of the fused prefix
    of `x`, all in one program, with eager's."""
    taken, labels, params = [], [], []
    for name, (fn, shapes) in groups.items():
        own = _params(0, *shapes)
        taken.append((fn, len(own)))
        labels.extend(f"{name}[{i}]" for i in range(len(fn(x, *own))))
        params.extend(own)

    def program(x, *params):
        h, outputs = _PREFIXES[prefix](x), []
        for fn, count in taken:
            outputs.extend(fn(h, *params[:count]))
            params = params[count:]
        return tuple(outputs)

    expected, expected_grads = _run(program, x, params)
    jitted = fulmen.jit(program, executors=["codegen", "torch"])
    actual, grads = _run(jitted, x, params)
    assert len(actual) == len(expected) == len(labels)
    for label, got, want in zip(labels, actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=label)
        assert significant_strides(got) == significant_strides(want), (
            f"{label}: strides {got.stride()}, eager's {want.stride()}")
    for i, (got, want) in enumerate(zip(grads, expected_grads)):
        assert (got is None) == (want is None), f"gradient {i}"
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"gradient {i}")
            assert significant_strides(got) == significant_strides(want), (
                f"gradient {i}: strides {got.stride()}, eager's {want.stride()}")
    assert any("codegen." in str(trace) for trace in fulmen.last_traces(jitted)[-1:])


@pytest.mark.parametrize("layout", ["channels_last", "permuted"])
def test_consumers_of_a_fused_tensor_as_eager(layout):
    """Every 4-d group in one program (one compile), on the layouts a kernel writes otherwise
    than eager's."""
    _audit("map", _GROUPS_4D, _layouts_4d()[layout])


_SLOW = [(prefix, group, layout) for prefix in _PREFIXES for group in _GROUPS_4D
         for layout in _layouts_4d()] + [
    (prefix, group, layout) for prefix in _PREFIXES for group in _GROUPS_5D
    for layout in _layouts_5d()]


@pytest.mark.slow
@pytest.mark.parametrize("prefix,group,layout", _SLOW)
def test_consumers_of_a_fused_tensor_as_eager_by_group(prefix, group, layout):
    groups, layouts = (_GROUPS_5D, _layouts_5d()) if group in _GROUPS_5D else (
        _GROUPS_4D, _layouts_4d())
    _audit(prefix, {group: groups[group]}, layouts[layout])


def test_conv_of_a_fused_map_reading_a_reduction_returns_eagers_strides():
    """A flattened op's last prim computes its output under the op's name with the prim's
    strides: `x - x.mean(1, keepdim=True)` of a channels-last x ends in a `sub` of a row-major
    broadcast, and the fused region's output reported row-major, unmarked, so the claim pass
    did not see that the kernel's result is laid out otherwise than eager's, and the conv of
    it returned row-major (eager: channels-last). The region returns the op's own proxy now
    (NOTE [a fusion's outputs report eager's layout] in `fulmen/transforms/fusion.py`)."""
    x = torch.randn(2, 6, 5, 4).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(3, 6, 3, 3)

    def head(x):
        return F.conv2d(x - x.mean(1, keepdim=True), weight, padding=1)

    expected, actual = head(x), fulmen.jit(head, executors=["codegen", "torch"])(x)
    torch.testing.assert_close(actual, expected)
    assert expected.stride() != expected.contiguous().stride()  # not vacuous
    assert actual.stride() == expected.stride()


_CPU_LAYOUTS = {
    "conv_transpose2d": (lambda x, w: F.conv_transpose2d(x, w, stride=2, output_padding=1),
                         (2, 6, 5, 4), (6, 3, 3, 3)),
    "conv_transpose3d": (lambda x, w: F.conv_transpose3d(x, w), (2, 4, 3, 4, 5), (4, 2, 2, 2, 2)),
    "conv3d": (lambda x, w: F.conv3d(x, w), (2, 4, 3, 4, 5), (3, 4, 2, 2, 2)),
    "roll": (lambda x, w: torch.roll(x, 1, 2), (2, 6, 5, 4), None),
    "channel_shuffle": (lambda x, w: F.channel_shuffle(x, 2), (2, 6, 5, 4), None),
}


@pytest.mark.parametrize("op", sorted(_CPU_LAYOUTS))
def test_ops_keeping_a_channels_last_input_format_on_cpu_are_traced_so(op):
    """PyTorch's meta kernels lay these ops' outputs out row-major, eager's CPU kernels in the
    input's suggested memory format (channels-last): the trace answered row-major to
    `stride()`, and a fused input's result was put back row-major (`as_layout` to the traced
    strides) where eager returns channels-last. The convolutions recorded whole take the CPU
    backend's format (`_convolution_meta` in `fulmen/ops/opaque.py`), `roll` and
    `channel_shuffle` the input's suggested format."""
    fn, shape, weight_shape = _CPU_LAYOUTS[op]
    x = torch.randn(*shape)
    x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4
                     else torch.channels_last_3d)
    weight = None if weight_shape is None else torch.randn(*weight_shape)

    def program(x):
        out = fn(torch.relu(x * 2 + 1), weight)
        return out, torch.tensor(out.stride())

    expected, expected_strides = program(x)
    assert expected.stride() != expected.contiguous().stride()  # not vacuous
    actual, traced_strides = fulmen.jit(program, executors=["codegen", "torch"])(x)
    assert tuple(traced_strides.tolist()) == expected.stride()  # the trace's answer
    torch.testing.assert_close(actual, expected)
    assert actual.stride() == expected.stride()


_SYMBOLIC_CASES = {
    "conv2d": (lambda x: F.conv2d(x, torch.ones(3, 6, 3, 3), padding=1), "channels_last"),
    # a weight passed in has symbolic sizes; the layer norm specialises the image's sizes
    # after the conv is traced, and the substitution expands its strides (`-s21*s37 + 7*s37`)
    "conv2d_specialised": (lambda x, w: F.conv2d(x, w, padding=1)
                           * F.layer_norm(x, (5, 4)).mean(), "channels_last", (3, 6, 3, 3)),
    "conv_transpose2d": (lambda x: F.conv_transpose2d(x, torch.ones(6, 3, 3, 3), stride=2),
                         "channels_last"),
    "batch_norm": (lambda x: F.batch_norm(x, None, None, training=True), "permuted"),
    "group_norm": (lambda x: F.group_norm(x, 3), "channels_last"),
    "roll": (lambda x: torch.roll(x, 1, 2), "channels_last"),
    "channel_shuffle": (lambda x: F.channel_shuffle(x, 2), "channels_last"),
}


_SYMBOLIC_SLOW = {"conv2d", "conv_transpose2d", "roll"}  # the rules the fast cases share


@pytest.mark.parametrize("op", [pytest.param(op, marks=pytest.mark.slow) if op in _SYMBOLIC_SLOW
                                else op for op in sorted(_SYMBOLIC_CASES)])
def test_symbolic_sizes_keep_the_cpu_kernels_layouts(op):
    """With symbolic sizes the CPU kernels' formats were not asked (PyTorch's fake kernels
    answered: row-major for a channels-last convolution, a permuted batch norm's input order),
    and a strided output of a convolution shrinking its input (`-s21*s37 + 7*s37`, expanded)
    was not matched as dense by the claim pass (`_same_expr`), so no `as_layout` gave a fused
    input's result eager's strides. The formats are now asked of fake CPU stand-ins of the
    trace's ShapeEnv (`fulmen/ops/kernel_layouts.py`)."""
    fn, layout, *weight_shape = _SYMBOLIC_CASES[op]
    x, weights = _layouts_4d()[layout], _params(0, *weight_shape)

    def program(x, *weights):
        return fn(torch.relu(x * 2 + 1), *weights)

    expected = program(x, *weights)
    assert expected.stride() != expected.contiguous().stride() or layout == "permuted"
    actual = fulmen.jit(program, executors=["codegen", "torch"], dynamic=True)(x, *weights)
    torch.testing.assert_close(actual, expected)
    assert actual.stride() == expected.stride()
