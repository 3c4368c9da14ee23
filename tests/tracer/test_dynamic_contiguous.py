"""`contiguous()` of a tensor that is contiguous only for a batch of 1 (issue 16): a causal LM's
`labels[..., 1:].contiguous()` returns the slice itself for `(1, T)` labels and a copy for a
larger batch. With the batch of 1 traced as a symbol, one compilation serves both, and what
the program sees (values, aliasing, strides, mutations) is eager's at every call."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from tests.layouts import significant_strides
from tests.spies import record_calls

SHAPES = ((1, 5), (1, 8), (2, 5), (4, 11), (1, 3), (3, 2), (1, 9))


def _shifted_loss(logits, labels):
    """The shift of HF's `ForCausalLMLoss`: pad, drop the first label, `contiguous()`."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return F.cross_entropy(logits.flatten(0, 1), shifted.view(-1), ignore_index=-100)


@pytest.mark.parametrize("backward", [False, True])
def test_shifted_labels_of_a_batch_of_one_need_no_third_compilation(backward):
    torch.manual_seed(0)
    table = torch.randn(16, 8, requires_grad=backward)

    def fn(ids, labels):
        return _shifted_loss(table[ids] @ table.t(), labels)

    jfn = fulmen.jit(fn)
    for shape in SHAPES:
        ids = torch.randint(0, 16, shape)
        got, want = jfn(ids, ids), fn(ids, ids)
        torch.testing.assert_close(got, want)
        if backward:
            (grad,) = torch.autograd.grad(got, table)
            torch.testing.assert_close(grad, torch.autograd.grad(want, table)[0])
    assert fulmen.cache_misses(jfn) == 2


def _shares_memory(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_contiguous_returns_the_input_itself_exactly_where_eager_does():
    def fn(x):
        padded = x * 2
        return padded, padded[..., 1:].contiguous()

    jfn = fulmen.jit(fn)
    for shape in SHAPES:
        x = torch.randn(shape)
        (p, y), (want_p, want_y) = jfn(x), fn(x)
        torch.testing.assert_close((p, y), (want_p, want_y))
        assert _shares_memory(p, y) == _shares_memory(want_p, want_y), shape
        assert (y.stride(), y.storage_offset()) == (want_y.stride(), want_y.storage_offset())
    assert fulmen.cache_misses(jfn) == 2


def test_mutating_a_contiguous_result_that_may_alias_is_eager():
    def fn(x):
        padded = x + 1
        shifted = padded[..., 1:].contiguous()
        shifted.mul_(3)  # for a batch of 1 this writes into `padded` too
        return padded.sum(-1), shifted

    jfn = fulmen.jit(fn)
    for shape in SHAPES:
        x = torch.randn(shape)
        torch.testing.assert_close(jfn(x), fn(x))


def test_reading_the_strides_of_a_contiguous_result_that_may_alias_is_eager():
    def fn(x):
        shifted = (x + 1)[..., 1:].contiguous()
        return shifted.t() * shifted.t().stride(1)  # eager: 9 for (1, 9), 4 for (2, 5)

    jfn = fulmen.jit(fn)
    for shape in SHAPES:
        x = torch.randn(shape)
        torch.testing.assert_close(jfn(x), fn(x))


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_a_rank3_contiguous_result_is_laid_out_row_major_for_every_batch(kernels, request):
    """`x[:, 1:]` of a `(B, 4, n)` tensor is contiguous exactly for `B == 1`: the copy the trace
    sees is row-major (strides `(3n, n, 1)`), so the ops after it (elementwise, a permute, a
    reduction, a flatten) compile for every batch in the two entries of the rank-2 case and
    return eager's values and strides: exactly on the torch executor, and on the dimensions of
    size other than 1 with codegen's kernels (a kernel already in the disk cache wrote the
    permuted output row-major, and the test failed in whichever order of test files had
    compiled that kernel before; the default executors would run torch or a kernel by the
    state of that cache, so each case names its own)."""
    if kernels:
        request.getfixturevalue("codegen_eager")

    def fn(x):
        shifted = (x + 1)[:, 1:].contiguous()
        return shifted * 2, shifted.permute(2, 0, 1).exp(), shifted.sum(1), shifted.view(-1)

    jfn = fulmen.jit(fn, executors=None if kernels else ["torch"])
    for shape in ((1, 4, 5), (1, 4, 8), (2, 4, 5), (4, 4, 11), (1, 4, 3), (3, 4, 2)):
        x = torch.randn(shape)
        got, want = jfn(x), fn(x)
        torch.testing.assert_close(got, want)
        if kernels:
            assert [significant_strides(g) for g in got] == [
                significant_strides(w) for w in want], shape
        else:
            assert [g.stride() for g in got] == [w.stride() for w in want], shape
    assert fulmen.cache_misses(jfn) == 2


def test_contiguous_with_symbolic_sizes_asks_no_fake_tensor(monkeypatch):
    """`contiguous()` of a transposed tensor (a copy) and of a row-major one (itself) with
    symbolic sizes is described without PyTorch's fake tensors (milliseconds each: GPT-2's
    attention output); values, strides and aliasing are eager's."""
    from fulmen.ops import meta

    asked = record_calls(monkeypatch, meta, "call_on_meta")

    def fn(x):
        copied = (x * 2).transpose(1, 2).contiguous()
        same = x.contiguous()
        return copied + 1, same, copied.stride()

    jfn = fulmen.jit(fn, dynamic=True)
    for shape in ((2, 5, 3), (3, 7, 4), (2, 9, 3)):
        x = torch.randn(shape)
        got, want = jfn(x), fn(x)
        torch.testing.assert_close(got[0], want[0])
        assert got[0].stride() == want[0].stride() and got[2] == want[2]
        assert got[1] is x or got[1].data_ptr() == x.data_ptr()
    assert torch.Tensor.contiguous not in asked
