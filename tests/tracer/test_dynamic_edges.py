"""Symbolic sizes where they meet Python: formatted with a spec, strides beside a size 0,
numbers stored into objects, dict arguments edited in place, the cache size limit counting
symbolic entries. Each compared with eager over calls whose sizes vary (so the later calls
run a trace with symbolic sizes)."""

import warnings

import torch

import fulmen
from fulmen.transforms.dce import size_sources

SIZES = (5, 6, 7, 9)


def test_a_size_formatted_with_a_spec_is_eagers_string():
    def padded(x):
        return x * len(f"{x.shape[0]:04d}")

    def aligned(x):
        return x * len(format(x.shape[0], ">6"))

    for fn in (padded, aligned):
        jfn = fulmen.jit(fn)
        for n in SIZES:
            x = torch.randn(n, 3)
            torch.testing.assert_close(jfn(x), fn(x))


def test_strides_beside_a_size_zero_are_eagers():
    def fn(x):
        return x.sum(dim=1) + x.stride(0) * 10 + x.stride(1)

    jfn = fulmen.jit(fn)
    for n in SIZES:
        x = torch.empty(n, 0, 4)
        torch.testing.assert_close(jfn(x), fn(x))


class _Box:
    pass


def test_a_float_computed_from_a_size_and_stored_is_eagers():
    def fn(x, box):
        box.ratio = x.shape[0] / 4
        box.count = x.shape[0] + 1
        return x + 1

    jfn = fulmen.jit(fn)
    for n in SIZES:
        x = torch.randn(n)
        got, expected = _Box(), _Box()
        torch.testing.assert_close(jfn(x, got), fn(x, expected))
        assert (type(got.ratio), got.ratio, got.count) == \
            (type(expected.ratio), expected.ratio, expected.count)


def test_a_dict_argument_edited_in_place_holds_eagers_entries():
    def fn(x, state):
        state.pop("old")
        state["new"] = x * 2
        return x + 1

    jfn = fulmen.jit(fn)
    for _ in range(3):
        x = torch.randn(4)
        got, expected = {"old": x, "keep": 1}, {"old": x, "keep": 1}
        torch.testing.assert_close(jfn(x, got), fn(x, expected))
        assert list(got) == list(expected)
        torch.testing.assert_close(got["new"], expected["new"])


def test_the_cache_size_limit_counts_entries_with_symbolic_sizes():
    def fn(x):
        return x * 2

    jfn = fulmen.jit(fn, cache_size_limit=1, dynamic=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in (torch.randn(3), torch.randn(5), torch.randn(3, dtype=torch.float64)):
            torch.testing.assert_close(jfn(x), fn(x))
    stats = fulmen.compile_stats(jfn)
    assert stats.cache_misses == 2 and stats.eager_calls == 1
    assert sum("cache_size_limit" in str(w.message) for w in caught) == 1


def test_a_branch_that_specialises_a_size_holds_only_for_that_size():
    # the path of `x.sum() <= 0` asks `x.shape[0] == 6`: the symbolic entry serves it only
    # where the guards of both of its paths hold
    def fn(x):
        if x.sum() > 0:
            return x * 2
        return x * 3 if x.shape[0] == 6 else x * 5

    jfn = fulmen.jit(fn)
    for n, sign in ((3, 1), (5, 1), (6, -1), (7, -1), (8, 1), (6, -1), (9, -1)):
        x = torch.randn(n).abs() * sign
        torch.testing.assert_close(jfn(x), fn(x))


def test_views_whose_strides_vary_share_one_symbolic_entry():
    """A slice `base[:, :n]` of a base of varying width has strides that are not a function
    of its own sizes (NOTE [strides of a view input]): its strides get a symbol of their own,
    so the calls compile twice, not once per width; the program reads the stride, and a
    transposed view of the same sizes (other strides) is not served by that entry."""
    def f(x):
        return x * 2 + x.stride(0)

    jf = fulmen.jit(f)
    for width, n in [(10, 4), (12, 6), (15, 5), (20, 9), (7, 3)]:
        x = torch.randn(3, width)[:, :n]
        torch.testing.assert_close(jf(x), f(x))
    assert fulmen.cache_misses(jf) == 2
    for x in (torch.randn(5, 3).t(), torch.randn(3, 5, 2)[:, :, 0]):
        torch.testing.assert_close(jf(x), f(x))


def test_micro_batches_sliced_from_batches_of_varying_size_share_one_symbolic_entry():
    """`x.chunk(2)[1]` (DDP's rank 1, gradient accumulation's micro-batches) sits at an offset
    that changes with the batch size; the program never reads it, so the shape guard leaves it
    out (it compiled once per size)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 1))
    jitted = fulmen.jit(model)
    for n in (8, 8, 6, 10, 4, 12, 8):
        x = torch.randn(2 * n, 6).chunk(2)[1]
        torch.testing.assert_close(jitted(x), model(x))
    assert fulmen.compile_stats(jitted).cache_misses == 2


def _reads_offset(x):
    return x * x.storage_offset()


def test_a_storage_offset_the_program_reads_stays_guarded_with_symbolic_sizes():
    jfn = fulmen.jit(_reads_offset)
    for n in (8, 6, 10, 4, 6):
        x = torch.randn(2 * n, 3)[n:]
        torch.testing.assert_close(jfn(x), _reads_offset(x))


def _pad_to(x, y):
    return torch.nn.functional.pad(x, (1, y.shape[0] - 2), value=-1.0) * 2


def test_pad_amounts_from_a_symbolic_size_stay_symbolic():
    # HF Gemma 4 pads by a window minus the cached length: the amount was refused as a symbolic
    # size, so every decode step compiled anew (and ran eagerly past the cache size limit)
    jfn = fulmen.jit(_pad_to)
    with torch.no_grad():
        for n in (3, 4, 5, 6):
            x, y = torch.randn(2, n), torch.randn(n + 1)
            torch.testing.assert_close(jfn(x, y), _pad_to(x, y))
    assert fulmen.compile_stats(jfn).cache_misses == 2


def test_a_backward_whose_cotangent_size_is_a_floor_of_the_symbol_gets_the_symbol():
    """`x[1::2]` of a symbolic `s0`: the cotangent's size is `s0 // 2`, from which no binding
    solves `s0` (the backward needs it for the gradient's size); the input holding `s0` is
    saved for it. Found by the op fuzzer under dynamic=True ('the symbolic sizes [s52] are not
    a size of any input')."""

    def f(x):
        return x[1::2] + 1

    jitted = fulmen.jit(f, dynamic=True)
    for n in (5, 9, 8):
        x = torch.randn(n, requires_grad=True)
        jitted(x).backward(torch.arange(float(n // 2)))
        want = torch.zeros(n)
        want[1::2] = torch.arange(float(n // 2))
        torch.testing.assert_close(x.grad, want)
    assert fulmen.compile_stats(jitted).cache_misses == 1


def test_an_input_contiguous_but_for_a_size_one_strides_reads_eagers_strides():
    """A `(n, 1)` input with strides `(1, n)` is contiguous to `is_contiguous()`; its symbolic
    strides were the row-major `(1, 1)`, so code reading the size-1 dim's stride (through a
    transpose of `contiguous()`, which returns the input itself) read 1 where eager reads n.
    Found by the op fuzzer under dynamic=True."""

    def f(a):
        view = a.contiguous().transpose(0, -1)
        return a * (1.0 + 0.01 * view.stride(0))

    jitted = fulmen.jit(f, dynamic=True)
    for a in (torch.randn(1, 4).t(), torch.randn(1, 6).t(), torch.randn(6, 1),
              torch.randn(1, 5).t()):
        torch.testing.assert_close(jitted(a), f(a))


def test_a_flattened_residual_does_not_stand_for_the_sizes_it_multiplies():
    """A backward needing s0 and s1 (to shape a `(s0, s1, V)` gradient) whose inputs hold them
    only as the product of a flattened residual (`(s0*s1, V)`, from which no binding solves
    either): the size source must be a candidate that binds them, not another flattened value
    (rematerialization took one, and printing the backward raised 'the symbolic sizes [...]
    are not a size of any input'; the model fuzzer, `make fuzz` models: torch seed 2, met it as
    cross-entropy of flattened logits after a graph break)."""
    from fulmen.proxies import TensorProxy
    from fulmen.tracer.symbolic import SymbolicSizes

    sizes = SymbolicSizes()
    shape, strides = sizes.symbolize(torch.empty(2, 3, 19), "logits", dims=(0, 1))
    logits = TensorProxy("logits", shape, torch.float32, "cpu", strides=strides)
    flat = TensorProxy("flat", (shape[0] * shape[1], 19), torch.float32, "cpu")
    labels = TensorProxy("labels", (shape[0] * shape[1],), torch.int64, "cpu")
    grad = TensorProxy("grad", shape, torch.float32, "cpu", strides=strides)
    found = size_sources((), (grad,), (flat,), (labels, logits))
    assert [p.name for p in found] == ["logits"]


def test_dropout_keeps_a_generalised_batch_of_one():
    """Dropout on `(1, s, 8)` hidden states whose length varies: describing the mask's layout
    must not pin the batch of 1 (PyTorch's density check asked whether it is 1), so later
    batches reuse the symbolic entry (GPT-2's training sweep compiled 3 times); the masks are
    eager's draws."""
    w = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        return (torch.nn.functional.dropout(x @ w, 0.3, training=True) * 2).sum()

    jfn = fulmen.jit(fn)
    for batch, seq in ((1, 5), (1, 8), (2, 5), (4, 11), (1, 3)):
        x = torch.randn(batch, seq, 8)
        torch.manual_seed(batch * 100 + seq)
        got = jfn(x)
        (grad,) = torch.autograd.grad(got, w)
        torch.manual_seed(batch * 100 + seq)
        want = fn(x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(grad, torch.autograd.grad(want, w)[0])
    assert fulmen.cache_misses(jfn) == 2


def test_a_guard_that_divides_by_a_size_expression_misses_where_the_divisor_is_zero():
    # the symbolic entry's guards hold `(64 + 64*s) % (8*((1 + s) // 4)) == 0`; at s = 1 the
    # divisor is 0 (HF DeepSeek-V4's decode step): the entry does not apply, the call retraces
    def fn(x):
        n = x.shape[1]
        if n < 3:
            return x * 2
        return x.reshape(x.shape[0], -1, 8 * ((n + 1) // 4)).sum(-1)

    jfn = fulmen.jit(fn)
    for n in (7, 11, 15, 1, 2, 7, 1):
        x = torch.randn(2, n, 8 * max(1, (n + 1) // 4))
        torch.testing.assert_close(jfn(x), fn(x))


def test_a_torch_op_on_a_symbolic_size_alone_is_eagers_number():
    # Longformer and LED chunk a sequence with `torch.div(seq_len, w, rounding_mode="trunc")`.
    # PyTorch read a symbolic size passed as its Scalar as garbage (tensor(1944444) for 8 // 4)
    # and the trace captured it as a constant: every call after the first was wrong.
    def count(x):
        return x * torch.div(x.size(1), 4, rounding_mode="trunc") + torch.div(x.size(1), 3)

    def chunks(x):
        n = torch.div(x.size(1), 4, rounding_mode="floor")
        return x.view(x.size(0), n, 4).sum(-1)

    for fn in (count, chunks):
        jfn = fulmen.jit(fn, dynamic=True)
        for length in (8, 12, 16, 12):
            x = torch.randn(2, length)
            torch.testing.assert_close(jfn(x), fn(x), rtol=0, atol=0)


def test_an_op_on_a_symbolic_number_keeps_eagers_size_one_strides():
    # `x * (1.0 + 0.01 * s0)` is recorded whole (its number is symbolic) and PyTorch's meta kernel
    # laid the result out row-major, `(1, 1)` for a `(n, 1)` input with strides `(1, n)`, where
    # the CPU kernel keeps `(1, n)`: code reading the result's layout read another answer than
    # eager's. Found by the op fuzzer (`make fuzz`, dynamic=True).
    def f(a):
        scaled = a * (1.0 + 0.01 * a.transpose(0, 1).stride(0))
        return scaled, scaled.stride(), scaled.transpose(0, 1).is_contiguous()

    jitted = fulmen.jit(f, dynamic=True)
    for a in (torch.randn(1, 4).t(), torch.randn(1, 6).t(), torch.randn(1, 5).t()):
        got, want = jitted(a), f(a)
        assert got[1:] == want[1:]
        assert got[0].stride() == want[0].stride()
        torch.testing.assert_close(got[0], want[0])


def test_a_convolution_keeps_its_sizes_symbolic_and_eagers_layout(monkeypatch):
    """`conv2d` with symbolic sizes: eager's layout was asked of PyTorch on real stand-ins made
    from the sizes, which raised for symbolic ones (found by `FULMEN_DYNAMIC=strict` op_db).
    PyTorch's fake kernel answers instead: one entry for every image size, and eager's
    channels-last output where the weight is made channels-last inside (the meta kernel alone
    answers row-major there)."""
    monkeypatch.setenv("FULMEN_DYNAMIC", "strict")  # symbolic, raising where a trace fails

    def fn(x, w, channels_last):
        if channels_last:
            w = w.contiguous(memory_format=torch.channels_last)
        return torch.nn.functional.conv2d(x, w, padding=1).relu()

    for channels_last in (False, True):
        jfn = fulmen.jit(fn)
        w = torch.randn(4, 3, 3, 3)
        for size in (6, 9, 5):
            x = torch.randn(2, 3, size, size)
            out, want = jfn(x, w, channels_last), fn(x, w, channels_last)
            torch.testing.assert_close(out, want)
            assert out.stride() == want.stride()
        assert fulmen.cache_misses(jfn) == 1


def test_a_pooling_after_a_convolution_of_a_channels_last_batch_keeps_eagers_layout():
    """With symbolic sizes the convolution's layout was asked of PyTorch's fake kernel on the
    meta device, which answers row-major where eager's CPU backend keeps the input's
    channels-last layout: the convolution itself came back channels-last (torch runs it whole),
    but the pooling and batch norm after it were relaid row-major (found by probing a
    channels-last CNN with `dynamic=True`). Their stand-ins are now fake CPU tensors."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                                torch.nn.AdaptiveAvgPool2d(2))
    model = model.to(memory_format=torch.channels_last)
    jmodel = fulmen.jit(model, dynamic=True)
    for size in (6, 9):
        x = torch.randn(2, 3, size, size).to(memory_format=torch.channels_last)
        out, want = jmodel(x), model(x)
        assert out.stride() == want.stride() == (16, 1, 8, 4)
        torch.testing.assert_close(out, want)
    assert fulmen.cache_misses(jmodel) == 1


def test_a_pooling_after_a_group_norm_of_a_channels_last_batch_keeps_eagers_layout():
    """The CPU group norm writes its output in the input's suggested memory format; with
    symbolic sizes that format was not read (the strides are expressions), the group norm was
    traced row-major and the pooling after it relaid row-major. It is read on a fake stand-in
    now, with a guard on the sizes it reads."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.GroupNorm(2, 4), torch.nn.MaxPool2d(2))
    jmodel = fulmen.jit(model, dynamic=True)
    for size in (6, 8):
        x = torch.randn(2, 4, size, size).to(memory_format=torch.channels_last)
        out, want = jmodel(x), model(x)
        assert out.stride() == want.stride() != want.contiguous().stride()
        torch.testing.assert_close(out, want)
    assert fulmen.cache_misses(jmodel) == 1


class _Holder:
    """A plain object holding a tensor, as an HF cache layer holds its keys."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _reads_held_offset(holder):
    return holder.t * holder.t.storage_offset()


def _doubles_held(holder):
    return holder.t * 2


def test_a_held_tensors_offset_is_guarded_only_where_read():
    # NOTE [offsets of held tensors]: an unread offset of a tensor inside an object argument
    # was guarded as a constant, so each offset compiled a symbolic entry of its own (HF's
    # sliding-window cache: one more compile per prompt length); one the program reads is
    # still answered as eager
    reads, doubles = fulmen.jit(_reads_held_offset), fulmen.jit(_doubles_held)
    for n in (8, 6, 10, 4, 6):
        x = torch.randn(2 * n, 3)[n:]
        torch.testing.assert_close(reads(_Holder(x)), _reads_held_offset(_Holder(x)))
        torch.testing.assert_close(doubles(_Holder(x)), x * 2)
    assert fulmen.compile_stats(doubles).cache_misses == 2
