"""Layout truth: every traced op's output proxy reports eager's strides (issue 18).

For each OpInfo sample of every op fulmen decomposes, the sample is traced (no compilation)
with its tensors laid out three ways: as given, permuted (dense, dims in reverse memory order)
and channels_last (4-D tensors); the strides the trace's output proxies report must equal those
of eager's outputs wherever a dimension has more than one element (size-1 dims have no layout).

`make test` takes up to 2 samples per OpInfo; `make conformance` (`--opinfo-samples=all`)
every sample. Ops whose proxies may not match are listed in `KNOWN` with the reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from fulmen import FulmenError, jit
from fulmen.tracer.tracer import trace_program
from tests.ops.opinfo_harness import matched_opinfos, samples

# (OpInfo id, layout) -> why its traced strides may differ from eager's there.
_PAD_LAYOUT = ("PyTorch's meta kernel of 2-d reflection/replication padding lays the output out "
               "contiguously; eager's CPU kernel keeps channels_last")
KNOWN: dict[tuple[str, str], str] = {
    ("nn.functional.pad.replicate_negative", "channels_last"): _PAD_LAYOUT,
    ("nn.functional.pad.replicate", "channels_last"): _PAD_LAYOUT,
    ("nn.functional.pad.reflect", "channels_last"): _PAD_LAYOUT,
}

LAYOUTS = ("given", "permuted", "channels_last")


def relayout(value, layout: str):
    """`value` with each tensor's values kept and its memory order changed to `layout`."""

    def convert(leaf):
        if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided:
            return leaf
        if layout == "permuted" and leaf.dim() >= 2:
            order = tuple(reversed(range(leaf.dim())))
            moved = leaf.detach().permute(order).contiguous().permute(order)
            return moved.requires_grad_(leaf.requires_grad)
        if layout == "channels_last" and leaf.dim() == 4:
            return leaf.detach().contiguous(memory_format=torch.channels_last)
        return leaf

    return pytree.tree_map(convert, value)


def stride_mismatches(expected, traced) -> list[str]:
    """Where the traced outputs' strides differ from eager's (dims of size > 1 only)."""
    exp = [leaf for leaf in pytree.tree_leaves(expected) if isinstance(leaf, torch.Tensor)]
    got = [leaf for leaf in pytree.tree_leaves(traced) if isinstance(leaf, torch.Tensor)]
    if len(exp) != len(got):
        return [f"{len(got)} tensor outputs, eager has {len(exp)}"]
    problems = []
    for index, (e, g) in enumerate(zip(exp, got)):
        if e.shape != g.shape or e.numel() == 0 or e.layout != torch.strided:
            continue
        dims = [d for d in range(e.dim()) if e.shape[d] > 1]
        if [e.stride(d) for d in dims] != [g.stride(d) for d in dims]:
            problems.append(f"output {index} {tuple(e.shape)}: traced strides {g.stride()}, "
                            f"eager {e.stride()}")
    return problems


def traced_output(info, input, args, kwargs):
    """The output of tracing `info.op` on a sample: proxies carrying the traced strides."""

    def fn(input, *args):
        return info.op(input, *args, **kwargs)

    program = trace_program(fn, (input, *args), {})
    return program.trace.output


def _ids(info):
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


def _limit(request) -> int | None:
    option = request.config.getoption("--opinfo-samples")
    return None if option == "all" else min(int(option), 2)


@pytest.mark.parametrize("info", matched_opinfos(), ids=_ids)
def test_traced_strides_match_eager(info, request):
    checked, problems = 0, []
    for sample in samples(info, _limit(request)):
        for layout in LAYOUTS:
            if (_ids(info), layout) in KNOWN:
                continue
            given = (sample.input, sample.args, sample.kwargs)
            moved = relayout(given, layout)
            if layout != "given" and all(
                    a is b for a, b in zip(pytree.tree_leaves(moved), pytree.tree_leaves(given))):
                continue  # nothing to lay out differently
            input, args, kwargs = moved
            try:
                with torch.no_grad():
                    expected = info.op(input, *args, **kwargs)
            except Exception:
                continue  # eager rejects the sample (or this layout of it)
            try:
                with torch.no_grad():
                    traced = traced_output(info, input, args, kwargs)
            except FulmenError:
                continue  # refused or a graph break: test_opinfo covers those
            checked += 1
            problems += [f"{layout}: {p}" for p in stride_mismatches(expected, traced)]
    assert not problems, f"{info.name}: " + "; ".join(problems[:4])
    if checked == 0:
        pytest.skip("no sample traced")


def _hint(value):
    """A symbolic size or stride evaluated at the sizes of the call it was traced for."""
    return value.node.hint if isinstance(value, torch.SymInt) else value


def _symbolic_dims(args) -> dict[int, tuple[int, ...]]:
    """Every dimension of more than one element of each contiguous tensor argument."""
    leaves = pytree.tree_leaves(args)
    dims = {i: tuple(d for d in range(leaf.dim()) if leaf.shape[d] > 1)
            for i, leaf in enumerate(leaves)
            if isinstance(leaf, torch.Tensor) and leaf.is_contiguous()}
    return {i: d for i, d in dims.items() if d}


def _at_hints(leaf):
    if not isinstance(leaf, torch.Tensor):
        return leaf
    return torch.empty_strided([_hint(s) for s in leaf.shape], [_hint(s) for s in leaf.stride()],
                               dtype=leaf.dtype, device="meta")


@pytest.mark.parametrize("info", matched_opinfos(), ids=_ids)
def test_traced_strides_match_eager_with_symbolic_sizes(info):
    """The same property for a trace with symbolic sizes (`fulmen.tracer.symbolic`): the
    traced strides are expressions of the sizes, and at the traced call's sizes they must be
    eager's (the first two samples per op with a dimension that can be symbolic, inputs as
    given, every dimension of more than one element of a contiguous tensor argument symbolic).
    """
    checked, problems = 0, []
    for sample in samples(info, 8):
        if checked == 2:
            break
        input, args, kwargs = sample.input, sample.args, sample.kwargs
        try:
            with torch.no_grad():
                expected = info.op(input, *args, **kwargs)
        except Exception:
            continue  # eager rejects the sample

        def fn(input, *args, kwargs=kwargs):
            return info.op(input, *args, **kwargs)

        dims = _symbolic_dims((input, *args))
        if not dims:
            continue  # nothing can be symbolic
        try:
            with torch.no_grad():
                program = trace_program(fn, (input, *args), {}, dynamic=dims)
        except Exception:
            continue  # refused or no symbolic meta kernel: test_opinfo covers those
        checked += 1
        problems += stride_mismatches(expected, pytree.tree_map(_at_hints, program.trace.output))
    assert not problems, f"{info.name}: " + "; ".join(problems[:4])
    if checked == 0:
        pytest.skip("no sample traced symbolically")


@pytest.mark.parametrize("other_shape", [(1, 1, 7, 8), (1, 4, 1, 8), (7, 8), (1, 1, 7, 1)])
def test_a_generalised_one_broadcasting_takes_the_layout_rule(other_shape, monkeypatch):
    """A batch of 1 generalised to a symbol (`fulmen.tracer.symbolic`) against an operand whose
    batch is 1: the expand's stride is 0 with no guard, as the fake `expand` decides it, so
    the elementwise layout rule answers (no fake tensor, which cost tens of milliseconds per
    new question), with eager's strides at the traced sizes and at a batch of 3."""
    import fulmen.ops.elementwise_layout as elementwise_layout

    def no_fake_tensors(*tensors):
        raise AssertionError("the fake-tensor path ran")

    monkeypatch.setattr(elementwise_layout, "compute_elementwise_output_strides",
                        no_fake_tensors)

    def fn(x, y):
        return x * y

    for batch in (1, 3):
        x = torch.randn(batch, 4, 7, 8)
        y = torch.randn(*other_shape)
        with torch.no_grad():
            program = trace_program(fn, (x, y), {}, dynamic={0: (0, 2)})
        expected = fn(x, y)
        assert not stride_mismatches(expected, pytree.tree_map(_at_hints, program.trace.output))


_DEVICE_LAID_OUT = {
    "linalg.svd": lambda x: torch.linalg.svd(x),
    "linalg.svd.reduced": lambda x: torch.linalg.svd(x.t(), full_matrices=False),
    "svd": lambda x: torch.svd(x.t()),
    "linalg.eig": lambda x: torch.linalg.eig(x[:, :4]),
}


@pytest.mark.parametrize("name", sorted(_DEVICE_LAID_OUT))
def test_ops_laid_out_by_device_report_the_cpu_kernels_strides(name):
    """PyTorch's Python meta kernels of `linalg_svd` and `linalg_eig` lay the vectors out by
    the device (column-major on the CPU, row-major for cuSOLVER) and take a meta tensor for a
    CUDA one: a CPU trace must report the CPU kernel's strides (NOTE [meta kernels see the
    device] in `fulmen.ops.meta`)."""
    fn = _DEVICE_LAID_OUT[name]
    x = torch.randn(4, 6)
    expected = fn(x)
    traced = trace_program(fn, (x,), {}).trace.output
    assert not stride_mismatches(expected, traced)


def _batch_norm_calls():
    w, b = torch.randn(4), torch.randn(4)
    mean, var = torch.zeros(4), torch.ones(4)
    return {
        "native_batch_norm.train": lambda x: torch.native_batch_norm(x, w, b, None, None, True,
                                                                     0.1, 1e-5),
        "native_batch_norm.eval": lambda x: torch.native_batch_norm(x, w, b, mean, var, False,
                                                                    0.1, 1e-5),
        "F.batch_norm.train": lambda x: F.batch_norm(x, None, None, w, b, True),
        "F.batch_norm.eval": lambda x: F.batch_norm(x, mean, var, w, b, False),
        "F.batch_norm.running": lambda x: F.batch_norm(x, mean.clone(), var.clone(), w, b, True),
        "torch.batch_norm": lambda x: torch.batch_norm(x, w, b, mean, var, False, 0.1, 1e-5,
                                                       False),
    }


@pytest.mark.parametrize("name", sorted(_batch_norm_calls()))
@pytest.mark.parametrize("shape,order", [((4, 6), (1, 0)), ((2, 5, 4), (0, 2, 1)),
                                         ((3, 2, 5, 4), (1, 3, 0, 2)),
                                         ((2, 5, 3, 4), (0, 3, 1, 2))])
def test_batch_norm_of_a_permuted_input_reports_the_cpu_kernels_strides(name, shape, order):
    """The CPU batch norm allocates its output in the input's suggested memory format
    (row-major for a transposed input, channels_last where the input is), while PyTorch's meta
    kernel allocates it like the input: the traced output reports eager's strides."""
    fn = _batch_norm_calls()[name]
    x = torch.randn(shape).permute(order)  # 4 channels in dim 1
    expected = fn(x)
    traced = trace_program(fn, (x,), {}).trace.output
    assert not stride_mismatches(expected, traced)


@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.channels_last_3d],
                         ids=["channels_last", "channels_last_3d"])
def test_group_norm_of_a_channels_last_input_reports_the_cpu_kernels_strides(memory_format):
    """The CPU group norm allocates its output in the input's suggested memory format
    (channels_last for a channels-last input), while PyTorch's meta kernel answers row-major:
    the traced output reports eager's strides (the group norm backward picks the layout it
    hands eager's kernel from them)."""
    shape = (2, 8, 4, 4) if memory_format == torch.channels_last else (2, 8, 3, 4, 4)
    x = torch.randn(shape).contiguous(memory_format=memory_format)
    expected = F.group_norm(x, 2)
    traced = trace_program(lambda x: F.group_norm(x, 2), (x,), {}).trace.output
    assert expected.stride() != expected.contiguous().stride()  # not vacuous
    assert not stride_mismatches(expected, traced)


def _assert_compiled_in_eagers_layout(fn, x) -> None:
    """`jit(fn)(x)`, with static and with symbolic sizes, gives eager's values and eager's
    strides, which are not row-major (else the check could not fail)."""
    want = fn(x)
    assert want.stride() != want.contiguous().stride()  # not vacuous
    for dynamic in (False, True):
        got = jit(fn, dynamic=dynamic)(x)
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want)


def test_transposed_convolution_of_a_channels_last_input_returns_eagers_strides():
    """Eager's CPU transposed convolution writes a channels-last result for a channels-last
    input; PyTorch's meta kernel answers row-major, and the compiled result was copied
    row-major (and a pooling after it traced so)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ConvTranspose2d(4, 6, 3, 2), torch.nn.ReLU(),
                                torch.nn.AvgPool2d(2))
    x = torch.randn(2, 4, 5, 5).contiguous(memory_format=torch.channels_last)
    _assert_compiled_in_eagers_layout(model, x)


@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.channels_last_3d],
                         ids=["channels_last", "channels_last_3d"])
def test_channel_shuffle_of_a_channels_last_input_returns_eagers_strides(memory_format):
    """The CPU channel shuffle allocates its output in the input's suggested memory format;
    PyTorch's meta kernel answers row-major, so the map after it was traced row-major and its
    compiled result copied so."""
    shuffle = torch.nn.Sequential(torch.nn.ChannelShuffle(2), torch.nn.Hardtanh())
    rank = 4 if memory_format == torch.channels_last else 5
    x = torch.randn(2, 4, *[3, 5, 2][:rank - 2]).contiguous(memory_format=memory_format)
    _assert_compiled_in_eagers_layout(shuffle, x)


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_a_3d_pad_of_a_channels_last_3d_input_returns_eagers_strides(mode):
    """The CPU reflect and replicate 3-d pads allocate in the input's suggested memory format;
    PyTorch's meta kernel answers row-major, so under autograd the compiled result was copied
    row-major."""
    x = torch.randn(2, 4, 4, 6, 6).contiguous(memory_format=torch.channels_last_3d)
    x.requires_grad_()

    def fn(x):
        return F.pad(x, (1, 1, 1, 1, 1, 1), mode=mode)

    _assert_compiled_in_eagers_layout(fn, x)
