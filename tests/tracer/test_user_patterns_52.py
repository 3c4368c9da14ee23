"""User patterns probed in session 52 (h52probe), each compared with eager: debugging prints
and a tensor's text inside a jitted function, storage-identity checks (`data_ptr()`), in-place
activation functions that are no tensor method (`F.leaky_relu_`), a custom op writing its
arguments, `out=` tensors eager resizes, dict/list arguments stored into and returned, slices
bounded by 0-d tensors. Constructs fulmen cannot compile run eagerly, never raise."""

import contextlib
import io

import pytest
import torch
from torch import nn

import fulmen


class _Printing(nn.Module):
    """A model with a debugging print in its forward (`print(x.shape)`, `print(x)`)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 2)

    def forward(self, x):
        h = self.proj(x)
        print("h", h.shape, h)
        return h.relu()


def _printed(call, x) -> tuple[str, torch.Tensor]:
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        out = call(x)
    return text.getvalue(), out


def test_a_print_in_forward_prints_eagers_text_on_every_call():
    """A compiled call runs no Python: the print ran while tracing only, and printed the
    traced tensor as its placeholder (`<TensorProxy t0: ...>`); calls served from the cache
    printed nothing."""
    torch.manual_seed(0)
    model = _Printing()
    jmodel = fulmen.jit(model)
    inputs = [torch.randn(4, 3), torch.randn(4, 3)]
    for x in [*inputs, inputs[0]]:  # the third call has the first call's key
        want_text, want = _printed(model, x)
        got_text, got = _printed(jmodel, x)
        assert got_text == want_text, (got_text, want_text)
        assert "tensor(" in got_text and "Proxy" not in got_text
        torch.testing.assert_close(got, want)


class _PrintingShapes(nn.Module):
    """A debugging print of sizes only (`print("h", h.shape)`): no tensor's text is asked,
    so nothing breaks the graph and only the print itself tells a compiled call apart."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 2)

    def forward(self, x):
        h = self.proj(x)
        print("h", h.shape)
        return h.relu()


def test_a_print_of_sizes_only_prints_on_every_call():
    torch.manual_seed(0)
    model = _PrintingShapes()
    jmodel = fulmen.jit(model)
    for x in [torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3)]:
        want_text, want = _printed(model, x)
        got_text, got = _printed(jmodel, x)
        assert got_text == want_text == "h torch.Size([4, 2])\n", (got_text, want_text)
        torch.testing.assert_close(got, want)


def test_output_other_code_writes_is_not_taken_for_a_print():
    """Only what the traced function prints refuses the trace: a function without a print
    is compiled, while the caller's own prints around the calls still reach stdout."""
    jfn = fulmen.jit(lambda x: x * 2 + 1)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        for i in range(3):
            print("step", i)
            torch.testing.assert_close(jfn(torch.full((2,), float(i))),
                                       torch.full((2,), 2.0 * i + 1))
    assert text.getvalue() == "step 0\nstep 1\nstep 2\n"
    stats = fulmen.compile_stats(jfn)
    assert stats.calls == 3 and stats.eager_calls == 0


def _shares_storage(x, y):
    """Packed attention's check (`q.data_ptr() == k.data_ptr()`), or an alignment check of a
    kernel choice (HF's grouped-mm `weight.data_ptr() % 16`)."""
    same = x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    return x * 2 if same or x.data_ptr() % 16 else x * 3


def test_a_storage_identity_question_runs_the_call_eagerly():
    """`data_ptr()` / `untyped_storage()` of a traced tensor has no answer a trace can guard:
    the call raised a FulmenError ('needs the tensor's value') where eager runs."""
    base = torch.randn(4, 3)
    jfn = fulmen.jit(_shares_storage)
    for x, y in [(base, base[1:]), (base, torch.randn(4, 3)), (base[1:], base)]:
        torch.testing.assert_close(jfn(x, y), _shares_storage(x, y))
    assert fulmen.compile_stats(jfn).eager_calls == 3


def _described(x):
    """Text of a tensor used by the program (`str(t)`, `repr(t)`, `"%s" % t`)."""
    text = str(x) + repr(x[0]) + "%s" % x.sum()  # noqa: UP031 - the spelling is the test
    return x * len(text)


def test_a_tensors_text_read_by_the_program_is_eagers():
    """`str(t)` of a traced tensor gave the placeholder `<TensorProxy t0: ...>` (as `f"{t}"`
    did before it broke the graph): a silently wrong length here, a wrong log line."""
    jfn = fulmen.jit(_described)
    for x in [torch.ones(2, 3), torch.full((2, 3), 100.0), torch.ones(2, 3)]:
        torch.testing.assert_close(jfn(x), _described(x))
    assert fulmen.compile_stats(jfn).eager_calls == 0


_FUNCTION_ONLY_INPLACE = {  # in-place functions that are no tensor method (`torch._C._nn`'s)
    "hardtanh_": lambda x: torch.nn.functional.hardtanh_(x, -0.5, 0.5),
    "elu_": lambda x: torch.nn.functional.elu_(x, 0.7),
    "leaky_relu_": lambda x: torch.nn.functional.leaky_relu_(x, 0.2),
    "threshold_": lambda x: torch.nn.functional.threshold_(x, 0.1, 5.0),
    "rrelu_": lambda x: torch.nn.functional.rrelu_(x, training=False),
}


@pytest.mark.parametrize("name", list(_FUNCTION_ONLY_INPLACE))
def test_in_place_activation_functions_train_and_mutate_as_eager(name):
    """`F.leaky_relu_(h, 0.2)` (a function only; `h.leaky_relu_` does not exist) was recorded
    as the method `h.leaky_relu_(...)`: AttributeError, raised as a FulmenError where eager
    runs. On an intermediate with gradients, and on an argument (row 0 a view of it)."""
    activation = _FUNCTION_ONLY_INPLACE[name]

    def on_intermediate(x):
        return activation(x * 2) + x

    def on_argument(x):
        activation(x[0])
        return activation(x) * 3

    jfn, jarg = fulmen.jit(on_intermediate), fulmen.jit(on_argument)
    for seed in range(2):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        want, got = on_intermediate(x), jfn(x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), x),
                                   torch.autograd.grad(want.sum(), x))
        a, b = x.detach().clone(), x.detach().clone()
        torch.testing.assert_close(jarg(b), on_argument(a))
        torch.testing.assert_close(b, a)
    for jitted in (jfn, jarg):
        assert fulmen.compile_stats(jitted).eager_calls == 0


@torch.library.custom_op("fulmen_test52::accumulate", mutates_args=("total",))
def _accumulate(x: torch.Tensor, total: torch.Tensor) -> None:
    """A user's custom op that writes one of its arguments (a cache or accumulator update)."""
    total.add_(x)


@_accumulate.register_fake
def _(x, total):
    return None


def _step(x, total):
    _accumulate(x * 2, total)
    return total + 1


def test_a_custom_op_that_writes_its_arguments_runs_as_eager():
    """`torch.library.custom_op(..., mutates_args=...)` reaches the tracer as an OpOverload that
    writes an argument, which fulmen does not functionalize: the call raised
    NotYetSupportedError where eager runs; it now runs eagerly, with eager's writes."""
    jfn = fulmen.jit(_step)
    for seed in range(2):
        x = torch.randn(3, generator=torch.Generator().manual_seed(seed))
        want_total, got_total = torch.ones(3), torch.ones(3)
        torch.testing.assert_close(jfn(x, got_total), _step(x, want_total))
        torch.testing.assert_close(got_total, want_total)
    assert fulmen.compile_stats(jfn).eager_calls == 2


def _into_buffers(a, b, rows, total):
    torch.mm(a, b, out=rows)
    torch.sum(a, 0, out=total)
    return rows + total


@pytest.mark.parametrize("size", [(3, 3), (0,)], ids=["fitting", "empty"])
def test_out_tensors_eager_resizes_run_as_eager(size):
    """`torch.mm(a, b, out=torch.empty(0))`: eager resizes an `out=` tensor of another shape;
    the trace raised 'output with shape [0] doesn't match the broadcast shape [3, 3]'."""
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    jfn = fulmen.jit(_into_buffers)
    want_buffers = [torch.zeros(size), torch.zeros(size[:1])]
    got_buffers = [torch.zeros(size), torch.zeros(size[:1])]
    torch.testing.assert_close(jfn(a, b, *got_buffers), _into_buffers(a, b, *want_buffers))
    for got, want in zip(got_buffers, want_buffers):
        torch.testing.assert_close(got, want)
    assert fulmen.compile_stats(jfn).eager_calls == (size == (0,))


def _annotate(batch):
    """A training framework's step: results stored into the batch dict it returns."""
    batch["logits"] = batch["x"] * 2
    return batch


def _log_twice(x, log, same_log):
    log.append(x + 1)
    return x * len(same_log)


def test_containers_stored_into_and_returned_or_passed_twice_run_as_eager():
    """A dict argument the function stores into and returns (eager returns the very object),
    or a list passed twice and appended to: fulmen's copies cannot be eager's one object, and
    the call raised NotYetSupportedError where eager runs; it now runs eagerly."""
    jannotate, jlog = fulmen.jit(_annotate), fulmen.jit(_log_twice)
    for seed in range(2):
        x = torch.randn(3, generator=torch.Generator().manual_seed(seed))
        batch = {"x": x}
        assert jannotate(batch) is batch and set(batch) == {"x", "logits"}
        torch.testing.assert_close(batch["logits"], x * 2)
        log, want = [], []
        torch.testing.assert_close(jlog(x, log, log), _log_twice(x, want, want))
        assert len(log) == 1
        torch.testing.assert_close(log[0], want[0])
    assert fulmen.compile_stats(jannotate).eager_calls == 2
    assert fulmen.compile_stats(jlog).eager_calls == 2


def _trimmed(hidden, mask):
    """Padding trimmed by a length read from a mask (`hidden[:, :mask.sum(1).max()]`), and a
    window written through such a slice."""
    length = mask.sum(1).max()
    out = hidden[:, :length] * 2
    out[:, length - 1:] = 0.0
    return out


def test_slices_bounded_by_zero_dim_tensors_as_eager():
    """A slice bound that is a 0-d integer tensor (eager reads it with `__index__`) reached
    the meta kernel as a traced tensor: FulmenError 'aten._local_scalar_dense ... reached the
    dispatcher with a traced tensor' where eager runs."""
    jfn = fulmen.jit(_trimmed)
    hidden = torch.randn(2, 6, 3)
    for lengths in ([4, 2], [3, 3], [4, 1]):
        mask = (torch.arange(6) < torch.tensor(lengths)[:, None]).long()
        torch.testing.assert_close(jfn(hidden, mask), _trimmed(hidden, mask))
    assert fulmen.compile_stats(jfn).eager_calls == 0


def _pieces(x, size):
    return [piece.sum(0) for piece in x.split(size)]


def test_a_split_whose_piece_count_follows_a_tensor_runs_as_eager():
    """`x.split(n)` with `n` a 0-d tensor runs between compiled segments; called again with
    another `n` it returned fewer pieces than traced and the trace tree failed (KeyError 't2')
    where eager runs; the call now runs eagerly, and the traced count stays compiled."""
    jfn = fulmen.jit(_pieces)
    x = torch.randn(6, 4)
    for size in (2, 3, 2):
        got, want = jfn(x, torch.tensor(size)), _pieces(x, torch.tensor(size))
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert fulmen.compile_stats(jfn).eager_calls == 1


def _rolled(x, shift):
    return torch.roll(x, shifts=shift, dims=0) * 2


def test_a_roll_by_a_zero_dim_tensor_as_eager():
    """`torch.roll(x, shifts=n)` with `n` a 0-d tensor (a shift drawn with torch.randint, as in
    shifted-window attention or augmentation): the decomposition iterated the 0-d tensor,
    TypeError where eager runs; it now runs as the torch op."""
    jfn = fulmen.jit(_rolled)
    x = torch.randn(6, 4)
    for shift in (2, 3, 2):
        torch.testing.assert_close(jfn(x, torch.tensor(shift)), _rolled(x, torch.tensor(shift)))
    assert fulmen.compile_stats(jfn).eager_calls == 0
