"""Codegen kernels where random samples rarely look, each test one fused region (a C++ compile
or a few) computing every case at once, compared with eager:

- spellings: comparisons at ties (`>=` spelled `>` differs only where the operands are equal),
  the constant exponents rendered without pow (`x ** -2` as `1 / (x * x)`: a missing
  parenthesis is `1 / x * x`);
- addressing: an inner stride other than 0/1 at every operand position, views taken inside the
  region with offsets along outer dims (slices starting past 0, flips: the offset is counted in
  elements times the dim's stride), size-1 dims broadcast (stride 0).
"""

import pytest
import torch

import fulmen

# a kernel that fails to build warns and runs the torch fallback (eager's values): here that is
# an error, so a miscompiled kernel source cannot hide behind the fallback
pytestmark = [pytest.mark.usefixtures("codegen_eager"), pytest.mark.filterwarnings(
    "error:fulmen codegen.*runs on the torch executor:RuntimeWarning")]

EXECUTORS = ["codegen", "torch"]


def _fused(jfn) -> bool:
    return "codegen.fusion" in str(fulmen.last_traces(jfn)[-1])


def _compare_all(a, b):
    return (a == b, a != b, a < b, a <= b, a > b, a >= b, torch.maximum(a, b),
            torch.minimum(a, b), torch.where(a >= b, a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float16], ids=str)
def test_comparisons_at_ties_match_eager(dtype):
    a = torch.tensor([[-2, -1, 0, 1, 2, 3, 3, 0]] * 4).to(dtype)
    b = torch.tensor([[-2, 0, 0, 2, 1, 3, 2, -1]] * 4).to(dtype)  # half the pairs tie
    jfn = fulmen.jit(_compare_all, executors=EXECUTORS)
    for actual, expected in zip(jfn(a, b), _compare_all(a, b), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert _fused(jfn)


def _integer_predicates(a):
    return (torch.signbit(a), torch.sign(a), a.abs(), torch.logical_not(a), a * 2)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8], ids=str)
def test_integer_predicates_at_zero_match_eager(dtype):
    """Integer spellings at 0 (`signbit(0)` is False: `<` spelled `<=` differs only there)."""
    a = torch.tensor([[-3, -1, 0, 1, 2, 0, -2, 5]] * 4).to(dtype)
    jfn = fulmen.jit(_integer_predicates, executors=EXECUTORS)
    for actual, expected in zip(jfn(a), _integer_predicates(a), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert _fused(jfn)


# the constants codegen spells without pow (codegen/ops.py POW_CONSTANT), and two it does not
EXPONENTS = (-2.0, -1.0, -0.5, 0.5, 1.0, 2.0, 3.0, -3.0, 1.7)


def _powers(x):
    return tuple(x ** exponent for exponent in EXPONENTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_constant_exponents_match_eager(dtype):
    x = torch.tensor([[0.25, 0.5, 1.5, 2.0, 3.0, 7.5]] * 3, dtype=dtype)
    jfn = fulmen.jit(_powers, executors=EXECUTORS)
    for exponent, actual, expected in zip(EXPONENTS, jfn(x), _powers(x), strict=True):
        torch.testing.assert_close(actual, expected, msg=f"x ** {exponent}")
    assert _fused(jfn)


def _mixed(a, b, c):
    return a * b - c, (a - c).exp()


@pytest.mark.parametrize("strided", ["a", "b", "c", "bc"])
def test_inner_strides_of_every_operand_position(strided):
    """An operand with an inner stride other than 0 or 1 (a step slice) at each pointer position
    of the kernel, beside contiguous ones: its index is `j * stride` wherever it sits."""
    def operand(name, seed):
        full = torch.randn(40, 66, generator=torch.Generator().manual_seed(seed))
        return full[:, ::2] if name in strided else full[:, :33].contiguous()

    args = [operand(name, seed) for seed, name in enumerate("abc")]
    jfn = fulmen.jit(_mixed, executors=EXECUTORS)
    for actual, expected in zip(jfn(*args), _mixed(*args), strict=True):
        torch.testing.assert_close(actual, expected)
    assert _fused(jfn)


def _views(a, b):
    return (a[1:, :-1] - a[:-1, 1:],  # finite differences: slices starting past 0 on both dims
            a[3:40:2, 5:].sin(),
            a.flip(0) * b,  # negative stride along the outer dim
            a.flip(0, 1) + a,
            a[:, 2:] + b[:, :1],  # a size-1 column broadcast along the rows
            b[:1, :] * a)  # a size-1 row broadcast down the columns


def test_views_inside_a_region_match_eager():
    a, b = torch.randn(48, 40), torch.randn(48, 40)
    jfn = fulmen.jit(_views, executors=EXECUTORS)
    for actual, expected in zip(jfn(a, b), _views(a, b), strict=True):
        torch.testing.assert_close(actual, expected)
    assert _fused(jfn)


def _special(a, b):
    return (torch.maximum(a, b), torch.minimum(a, b), torch.sign(a), torch.sign(b),
            torch.remainder(a, b), torch.fmod(a, b), torch.floor_divide(a, b), a.abs() * b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_special_values_on_either_side_match_eager(dtype):
    """NaN as the first and as the second operand of maximum/minimum, signs of zeros, and
    remainders of every sign combination (the prelude's helpers)."""
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([nan, 1.0, -0.0, 0.0, -2.5, 3.0, inf, -inf, 7.0, -7.0, 7.0, -7.0, 0.0])
    b = torch.tensor([2.0, nan, 0.0, -0.0, 1.5, -4.0, 1.0, nan, 3.0, 3.0, -3.0, -3.0, 5.0])
    a, b = a.repeat(3).to(dtype), b.repeat(3).to(dtype)
    jfn = fulmen.jit(_special, executors=EXECUTORS)
    for actual, expected in zip(jfn(a, b), _special(a, b), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
    assert _fused(jfn)


def test_escaping_views_of_inputs_are_the_chains_own_views():
    """A region returning views of its inputs (a transposed, sliced, broadcast, reshaped
    input) gives each by one `as_strided` planned from the chain's own view (`strided_views`):
    the same sizes, strides, storage and offset as the view ops give, call after call, for
    inputs at other storage offsets; a chain that copies (a reshape of a transposed input)
    keeps making the copy."""
    def fn(x, y):
        return (x.t()[1:], y.unsqueeze(0).expand(3, 4, 5), x.reshape(30), x.t().reshape(30),
                (x * 2).sum(1), y.exp())

    jfn = fulmen.jit(fn, executors=["codegen", "torch"])
    base = torch.randn(200)
    for start in (7, 0, 31):  # (planned at a nonzero offset: the plan keeps the relative one)
        x = base[start:start + 30].view(5, 6)
        y = torch.randn(4, 5)
        actual, expected = jfn(x, y), fn(x, y)
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e)
            assert a.shape == e.shape and a.stride() == e.stride()
            assert a.storage_offset() == e.storage_offset()
            same = e.untyped_storage().data_ptr() in (x.untyped_storage().data_ptr(),
                                                     y.untyped_storage().data_ptr())
            assert (a.untyped_storage().data_ptr() == e.untyped_storage().data_ptr()) == same


@pytest.mark.parametrize("width", [2, 1])
def test_a_repeat_of_grouped_heads_is_written_by_the_kernel(codegen_eager, monkeypatch, width):
    """Grouped-query attention's repeat of the keys (`k[:, :, None].expand(...).reshape(...)`)
    returned from a region copies in eager (the reshape merges an expanded dim): the kernel
    writes it (NOTE [a copying view is a kernel output]) with eager's values and layout, a
    storage of its own that a later update of the input does not reach. A reshape that only
    splits dims (`width` 1: the repeat is a plain broadcast) stays a view of the input."""
    from fulmen.executors.codegen.region import RegionCallable

    monkeypatch.setenv("FULMEN_FUSE_TINY", "1")

    def fn(qkv, w):
        k = qkv[..., 8:].reshape(2, 5, 2, 4).permute(0, 2, 1, 3)
        rep = k[:, :, None].expand(2, 2, width, 5, 4).reshape(2, 2 * width, 5, 4)
        return rep * w, rep

    jfn = fulmen.jit(fn, executors=EXECUTORS)
    for start in (0, 3):
        qkv = torch.randn(200)[start:start + 160].view(2, 5, 16)
        w = torch.randn(4)
        (out, rep), (want_out, want_rep) = jfn(qkv, w), fn(qkv, w)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(rep, want_rep)
        assert rep.stride() == want_rep.stride()
        shares = want_rep.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
        assert (rep.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()) == shares
        qkv.add_(1.0)
        torch.testing.assert_close(rep, want_rep)  # a copy stays, a view follows, as eager's
    regions = [b.sym.impl for b in fulmen.last_traces(jfn)[-1].bsyms
               if isinstance(b.sym.impl, RegionCallable)]
    assert len(regions) == 1
    kernel_outputs = sum(plan[0] == "kernel" for plan in regions[0].lowered.outputs)
    assert kernel_outputs == (2 if width == 2 else 1)


def test_a_reshape_that_copies_its_input_is_copied_on_every_call():
    """An access whose chain copies (the reshape of a permuted input, GPT-2's merged heads
    in the backward of its qkv split) keeps its call plan: each call copies its own input
    afresh (new values, another storage offset), never reads the first call's copy."""
    from fulmen.executors.codegen.region import RegionCallable

    def fn(a, b):
        heads = a.permute(0, 2, 1, 3).reshape(2, 6, 12)
        return torch.cat((heads, b.exp()), dim=-1) * 2

    jfn = fulmen.jit(fn, executors=EXECUTORS)
    storage = torch.randn(400)
    for start in (0, 5, 13):
        a = storage[start:start + 144].view(2, 4, 6, 3)
        b = torch.randn(2, 6, 4)
        torch.testing.assert_close(jfn(a, b), fn(a, b))
        storage.add_(1.0)
    regions = [b.sym.impl for b in fulmen.last_traces(jfn)[-1].bsyms
               if isinstance(b.sym.impl, RegionCallable)]
    assert regions and all(len(region._plans) == 1 for region in regions)


def _merged(kind, k, q, y):
    """A region reading grouped heads `k` (2, 2, 5, 4) repeated 3 times by a merging reshape,
    with a later view step (`kind`) that the split iteration dim can or cannot take."""
    rep = k[:, :, None].expand(2, 2, 3, 5, 4).reshape(2, 6, 5, 4)
    if kind == "sliced":
        return rep[:, 1:5] * q[:, :4]
    if kind == "flipped":
        return rep.flip(1) * q
    if kind == "copied first":  # a copying reshape, then a merge the slice cannot split
        head = y.transpose(1, 2).reshape(3, 2, 10)[:, :, None].expand(3, 2, 2, 10)
        return head.reshape(3, 4, 10)[:, 1:3] * 2.0
    if kind == "conflicting":  # dim 1 merged from (2, 3) and from (3, 2)
        other = y[:, None].expand(3, 2, 5, 4).reshape(6, 5, 4)
        return rep * q + other
    return rep * q + rep.exp()


@pytest.mark.parametrize("kind", ["repeated", "sliced", "flipped", "conflicting", "copied first"])
def test_a_merged_broadcast_is_read_in_place_by_a_split_dim(codegen_eager, monkeypatch, kind):
    """An access whose reshape merges a broadcast dim (grouped-query attention's repeated
    keys) is read in place: the kernel iterates the merged dim as the dims it merges (NOTE [a
    merged broadcast is a split iteration dim]), with eager's values for inputs at other
    storage offsets and with other values at each call. A later step the split dim cannot
    take (a slice or flip of it, another access merging it from other sizes) copies as
    before, with eager's values too."""
    from fulmen.executors.codegen.region import RegionCallable

    monkeypatch.setenv("FULMEN_FUSE_TINY", "1")
    jfn = fulmen.jit(lambda k, q, y: _merged(kind, k, q, y), executors=EXECUTORS)
    storage = torch.randn(300)
    for start in (0, 3, 17):
        k = storage[start:start + 80].view(2, 5, 2, 4).permute(0, 2, 1, 3)
        q, y = torch.randn(2, 6, 5, 4).transpose(1, 2).contiguous().transpose(1, 2), \
            torch.randn(3, 5, 4)
        torch.testing.assert_close(jfn(k, q, y), _merged(kind, k, q, y))
        storage.mul_(-1.5)
    regions = [b.sym.impl for b in fulmen.last_traces(jfn)[-1].bsyms
               if isinstance(b.sym.impl, RegionCallable)]
    assert len(regions) == 1
    (plan,) = regions[0]._plans.values()
    assert bool(plan.copies) == (kind != "repeated")


def _rounded(x):
    return torch.round(x * 2) + torch.round(x - 0.25, decimals=0), torch.round(x.double() * 2)


def test_round_at_halves_is_to_even_as_eager():
    """`torch.round` rounds halves to even (0.5 -> 0, 2.5 -> 2, -0.5 -> -0); C's `round` rounds
    them away from zero: only exact halves tell the two apart."""
    x = torch.tensor([[0.25, 0.75, 1.25, -0.25, -0.75, 2.75, 0.1, -1.25]] * 4)
    jfn = fulmen.jit(_rounded, executors=EXECUTORS)
    for actual, expected in zip(jfn(x), _rounded(x), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert _fused(jfn)


def test_a_row_split_into_blocks_among_threads_computes_its_last_element():
    """With several threads and few rows, a long row is split into blocks of a multiple of 64
    elements (`cpu/runtime.py`); the last block ends at the row's end, not a block past it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n in (10001, 40003):
            x = torch.randn(n)
            jfn = fulmen.jit(lambda x: (x * 2).exp() + 1, executors=EXECUTORS)
            torch.testing.assert_close(jfn(x), (x * 2).exp() + 1)
            assert _fused(jfn)
    finally:
        torch.set_num_threads(previous)


def test_threads_starting_mid_row_find_their_offsets():
    """Each thread of a pointwise kernel works through a contiguous range of (row, block) tasks,
    finding the offsets of its first task once and stepping to the next row as an odometer
    (`cpu/render.py`). With 5 threads, 6 rows of 2 blocks each, threads start mid-row and
    cross rows; a permuted input and a broadcast one have other strides on every dim."""
    previous = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        x = torch.randn(10001, 3, 2).permute(2, 1, 0)
        y = torch.randn(3, 1)
        jfn = fulmen.jit(lambda x, y: (x * y).exp() - x, executors=EXECUTORS)
        torch.testing.assert_close(jfn(x, y), (x * y).exp() - x)
        assert _fused(jfn)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_walked_in_spans_cover_every_row_once(threads):
    """A pointwise kernel steps its pointers from row to row along the next-to-last dim, in
    spans cut so every thread has work (NOTE [rows walked in spans] in `cpu/render.py`): 3 runs
    of 2047 short rows (no dims merge: a permuted input, a broadcast one) split into spans that
    do not divide the run, and a 2-d space of one run. Every element is computed once, from its
    own row."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(16, 2047, 3).permute(2, 1, 0)
        y = torch.randn(2047, 1)
        z = torch.randn(16, 4001).t()
        jfn = fulmen.jit(lambda x, y, z: ((x * y).exp() - x, z * 3 + 1), executors=EXECUTORS)
        for actual, expected in zip(jfn(x, y, z), ((x * y).exp() - x, z * 3 + 1), strict=True):
            torch.testing.assert_close(actual, expected)
        assert _fused(jfn)
    finally:
        torch.set_num_threads(previous)
