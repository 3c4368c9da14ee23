"""In-place operations inside traced code: functionalized, with eager's outputs and side effects.

Every case runs eagerly and through `fulmen.jit` (twice: the second call is a cache hit) on
fresh copies of the same inputs, then compares the outputs and the inputs after the call.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen import FulmenError, NotYetSupportedError
from fulmen.ops.functionalized import WRITE_BACK


def _clone_tree(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _assert_same(actual, expected):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, equal_nan=True)
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_same(a, e)
    else:
        assert actual == expected


def check(fn, *args):
    """Outputs and post-call inputs of `jit(fn)` equal eager's, on a miss and on a hit."""
    eager_args = _clone_tree(args)
    expected = fn(*eager_args)
    jfn = fulmen.jit(fn)
    for _ in range(2):
        jit_args = _clone_tree(args)
        actual = jfn(*jit_args)
        _assert_same(actual, expected)
        _assert_same(jit_args, eager_args)
    assert fulmen.cache_hits(jfn) == 1
    return jfn


def _write_backs(jfn):
    return [b for b in fulmen.last_traces(jfn)[0].bsyms if b.sym is WRITE_BACK]


def test_mutation_of_an_input_is_written_back():
    def fn(x, y):
        x.add_(y)
        x.mul_(2)
        return x * 3

    jfn = check(fn, torch.randn(3, 4), torch.randn(4))
    (write_back,) = _write_backs(jfn)
    assert write_back.args[0].name == "x"
    assert "torch.Tensor.copy_(x, " in str(fulmen.last_traces(jfn)[0])
    # executed outside autograd where the input requires grad (an optimizer's parameters)
    assert "torchex.copy_(x, " in str(fulmen.last_traces(jfn)[-1])


def test_returning_the_mutated_input_returns_the_input_itself():
    jfn = fulmen.jit(lambda x: x.add_(1))
    x = torch.zeros(3)
    out = jfn(x)
    assert out is x
    torch.testing.assert_close(x, torch.ones(3))


def _view_then_mutate(x):
    y = x.view(2, 8)
    y.add_(1)
    return y


def _view_before_mutation(x):
    row = x[1]
    x.mul_(2)
    return row


def _view_after_mutation(x):
    x.add_(1)
    return x.t()[1:], x * 2


def _view_of_view(x):
    y = x[:, 1:].transpose(0, 1)
    y[0].fill_(7.0)
    return y.unsqueeze(0)


@pytest.mark.parametrize("fn", [_view_then_mutate, _view_before_mutation, _view_after_mutation,
                                _view_of_view])
@pytest.mark.parametrize("executors", [None, ["codegen", "torch"]], ids=["default", "codegen"])
def test_returned_view_of_a_mutated_input_is_a_view_of_the_input(fn, executors):
    # eager returns a view of the (mutated) input: writing into the output writes the input
    jfn = fulmen.jit(fn, executors=executors)
    for _ in range(2):  # a miss and a hit
        eager_x, x = torch.arange(16.0).view(4, 4), torch.arange(16.0).view(4, 4)
        expected, out = fn(eager_x), jfn(x)
        _assert_same(out, expected)
        _assert_same(x, eager_x)
        first, eager_first = (out[0], expected[0]) if isinstance(out, tuple) else (out, expected)
        assert first.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        first.mul_(-1)
        eager_first.mul_(-1)
        _assert_same(x, eager_x)


def test_returned_view_of_a_mutated_buffer_is_a_view_of_the_buffer():
    # a preallocated KV cache returning the filled part: eager returns a view of the buffer
    class Cache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.register_buffer("keys", torch.zeros(2, 8, 4))

        def forward(self, x, pos: int):
            k = self.proj(x)
            self.keys[:, pos:pos + x.shape[1]] = k.detach()
            return k.sum(), self.keys[:, :pos + x.shape[1]]

    torch.manual_seed(0)
    eager = Cache()
    model = Cache()
    model.load_state_dict(eager.state_dict())
    jm = fulmen.jit(model)
    for pos in (0, 2):
        x = torch.randn(2, 2, 4)
        (expected_loss, expected), (loss, out) = eager(x, pos), jm(x, pos)
        loss.backward()
        expected_loss.backward()
        torch.testing.assert_close(out, expected)
        assert out.untyped_storage().data_ptr() == model.keys.untyped_storage().data_ptr()
        torch.testing.assert_close(model.proj.weight.grad, eager.proj.weight.grad)
        out[:, -1] = 5.0  # the caller writes through the returned view
        expected[:, -1] = 5.0
        torch.testing.assert_close(model.keys, eager.keys)


@pytest.mark.parametrize("case", [
    lambda x, y: x.__iadd__(y),
    lambda x, y: x.sub_(y, alpha=2),
    lambda x, y: x.masked_fill_(y > 0, -1.0),
    lambda x, y: x.copy_(y),
    lambda x, y: x.zero_(),
    lambda x, y: x.fill_(3.5),
    lambda x, y: x.clamp_(-0.5, 0.5),
    lambda x, y: x.clamp_(min=y),
    lambda x, y: x.addcmul_(y, y, value=0.5),
    lambda x, y: x.lerp_(y, 0.3),
    lambda x, y: x.exp_().div_(y.abs() + 1),
    lambda x, y: F.relu(x, inplace=True),
    lambda x, y: F.silu(x, inplace=True),
    lambda x, y: torch.add(x, y, out=x),
    lambda x, y: (torch._foreach_add_([x, y], 1.5), x * y)[1],  # a name `_` first and last
], ids=["iadd", "sub_", "masked_fill_", "copy_", "zero_", "fill_", "clamp_", "clamp_t",
        "addcmul_", "lerp_", "chain", "relu_inplace", "silu_inplace", "out=", "_foreach_add_"])
def test_inplace_methods(case):
    check(case, torch.randn(3, 4), torch.randn(3, 4))


def test_inplace_dunders():
    def fn(x, y, i):
        x += y
        x -= 1
        x *= y
        x /= 2
        i //= 2
        i %= 3
        i |= 4
        i <<= 1
        return x, i

    check(fn, torch.randn(3), torch.randn(3), torch.arange(6))


def test_inplace_bitwise_dunders_update_inputs_whose_results_are_unused():
    """`&=`, `|=`, `^=`, `<<=` and `>>=` reach `__torch_function__` under their dunder names
    (`+=` arrives as `add_`): each is a mutation of the input even where nothing reads the
    result (recorded as an ordinary op, it was dropped as dead code and the caller's tensor
    kept its old value)."""
    def fn(a, b, c, d, e, m):
        a &= m
        b |= m
        c ^= m
        d <<= 1
        e >>= 1
        return m + 1

    ints = [torch.arange(6) * k for k in (3, 5, 7, 9, 11)]
    check(fn, *ints, torch.tensor([1, 2, 4, 8, 16, 3]))


def test_slice_assignment():
    def fn(x, y):
        x[..., :2] = y
        x[0] = 0.5
        x[:, -1] = x[:, 0] * 2
        return x.sum(0)

    check(fn, torch.randn(3, 4), torch.randn(3, 2))


def test_advanced_index_assignment():
    def fn(x, idx, v):
        x[idx] = v
        x[x > 1] = 1.0
        return x

    check(fn, torch.randn(5, 3), torch.tensor([0, 3]), torch.randn(2, 3))


def test_mutation_of_a_view_of_an_input():
    def fn(x):
        x[0].add_(1)
        x.view(-1)[:3] = 0
        x.t().mul_(2)
        row = x[1]
        x.add_(10)  # the earlier view `row` sees this
        return row * 1, x

    check(fn, torch.randn(3, 4))


def test_view_chain_and_multi_output_views():
    def fn(x):
        a, b = x.chunk(2, dim=1)
        b.unsqueeze(0)[0, :, 1] = -1
        x.transpose(0, 1)[2:].zero_()
        return a + 0, x

    check(fn, torch.randn(3, 4))


def test_mutation_visible_through_a_later_read_and_earlier_views():
    def fn(x):
        col = x[:, 1]
        y = x.exp()
        x.mul_(0)
        return y, col.sum(), x.sum()

    check(fn, torch.randn(4, 3))


def test_mutation_of_an_intermediate():
    def fn(x):
        y = x * 2
        y[:, 0] = 1
        y.masked_fill_(y > 1.5, 0)
        z = y.relu_()
        return z is y, y + 1

    jfn = check(fn, torch.randn(3, 3))
    assert _write_backs(jfn) == []


def test_intermediate_mutated_after_being_copied_keeps_old_values():
    def fn(x):
        y = torch.empty_like(x)
        y.copy_(x)
        x.add_(1)  # y keeps the old values
        return y

    jfn = fulmen.jit(fn)
    x = torch.ones(2)
    out = jfn(x)
    assert out is not x
    torch.testing.assert_close(out, torch.ones(2))
    torch.testing.assert_close(x, torch.full((2,), 2.0))


def test_chained_and_dtype_cast_mutations():
    def fn(x, h):
        x.add_(1.5).mul_(h)  # float16 in place with a float32 operand stays float16
        return x

    check(fn, torch.randn(4).half(), torch.randn(4))


def test_inplace_type_errors_match_eager():
    jfn = fulmen.jit(lambda i: i.add_(0.5))
    with pytest.raises((FulmenError, RuntimeError), match="can't be cast"):
        jfn(torch.arange(3))
    jfn = fulmen.jit(lambda x, y: x.add_(y))
    with pytest.raises((FulmenError, RuntimeError), match="doesn't match the broadcast shape"):
        jfn(torch.randn(3), torch.randn(2, 3))


def test_mutation_of_a_buffer_updates_the_module():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(()))
            self.register_buffer("cache", torch.zeros(2, 6))
            self.weight = torch.nn.Parameter(torch.randn(3))

        def forward(self, x, pos: int):
            self.count += 1
            self.cache[:, pos:pos + 3] = x * self.weight
            return self.cache.sum(1) + self.count

    eager, jitted = Counter(), Counter()
    jitted.load_state_dict(eager.state_dict())
    jmodel = fulmen.jit(jitted)
    with torch.no_grad():
        for pos in (0, 3, 0):
            x = torch.randn(2, 3)
            torch.testing.assert_close(jmodel(x, pos), eager(x, pos))
            torch.testing.assert_close(jitted.cache, eager.cache)
            torch.testing.assert_close(jitted.count, eager.count)
    assert fulmen.cache_hits(jmodel) == 1


def test_batch_norm_training_updates_running_stats():
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3))
    jitted = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3))
    jitted.load_state_dict(eager.state_dict())
    jmodel = fulmen.jit(jitted)
    for _ in range(2):
        x = torch.randn(4, 2, 5, 5)
        expected = eager(x)
        actual = jmodel(x)
        torch.testing.assert_close(actual, expected)
        for (name, a), (_, e) in zip(jitted.named_buffers(), eager.named_buffers()):
            torch.testing.assert_close(a, e, msg=name)
    expected.sum().backward()
    actual.sum().backward()
    for a, e in zip(jitted.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-4, atol=1e-5)


def test_a_training_batch_norm_whose_output_is_unused_updates_its_statistics():
    """A training batch norm run only for its running statistics (`swa_utils.update_bn`
    discards the model's output): `F.batch_norm` with the caller's buffers, and a module
    with `momentum=None` (a cumulative average, `num_batches_tracked` in the factor), update
    them as eager does. Recorded as an ordinary op, the unused call was dead code."""
    def functional(x, mean, var):
        F.batch_norm(x, mean, var, training=True, momentum=0.3)
        return x.sum()

    check(functional, torch.randn(4, 3, 5), torch.zeros(3), torch.ones(3))

    torch.manual_seed(0)
    eager = torch.nn.BatchNorm1d(3, momentum=None)
    jitted = torch.nn.BatchNorm1d(3, momentum=None)

    def calibrate(bn, x):
        bn(x)
        return x.mean()

    jcalibrate = fulmen.jit(calibrate)
    for step in range(2):
        x = torch.randn(4, 3) + step
        torch.testing.assert_close(jcalibrate(jitted, x), calibrate(eager, x))
        for (name, a), (_, e) in zip(jitted.named_buffers(), eager.named_buffers()):
            torch.testing.assert_close(a, e, msg=name)


def test_intermediate_mutation_under_autodiff():
    def fn(x, w):
        y = x * w
        y.mul_(2)
        y[0] = y[0] * 3
        return y.sum()

    x = torch.randn(3, 2)
    w = torch.randn(3, 2, requires_grad=True)
    expected = torch.autograd.grad(fn(x, w), w)[0]
    actual = torch.autograd.grad(fulmen.jit(fn)(x, w), w)[0]
    torch.testing.assert_close(actual, expected)


def test_mutating_a_leaf_that_requires_grad_raises_as_eager():
    x = torch.randn(3, requires_grad=True)  # (the warning names the cause: no buffer is updated)
    with pytest.warns(UserWarning, match="an argument that requires grad"), \
            pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        fulmen.jit(lambda x: x.add_(1))(x)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        fulmen.jit(lambda x: x[0].mul_(2))(x)
    with pytest.raises(FulmenError, match="requires grad"):
        fulmen.jit(lambda x: x.add_(1), fullgraph=True)(x)
    with torch.no_grad():  # allowed without autodiff, as in eager
        y = x.detach().clone()
        fulmen.jit(lambda x: x.add_(1))(x)
        torch.testing.assert_close(x.detach(), y + 1)


@pytest.mark.parametrize("mutate_first", [True, False])
def test_mutated_input_in_a_differentiated_trace(mutate_first):
    # the backward must see the values the forward used, not the input after its update
    def fn(buf, w):  # eager saves `buf` itself only where no later update touches it
        if mutate_first:
            buf.add_(1)
            return (buf * w).sum()
        out = (buf * 2) * w
        buf.mul_(3)
        return out.sum()

    w = torch.randn(3, requires_grad=True)
    eager_buf, jit_buf = torch.ones(3), torch.ones(3)
    expected = torch.autograd.grad(fn(eager_buf, w), w)[0]
    jfn = fulmen.jit(fn)
    actual = torch.autograd.grad(jfn(jit_buf, w), w)[0]
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(jit_buf, eager_buf)
    assert "functionalized.snapshot(buf)" in str(fulmen.last_traces(jfn)[0])


def test_updating_an_input_with_a_value_that_requires_grad_answers_as_eager():
    def fn(cache, k):
        cache[0] = k * 2
        return cache.sum()

    k = torch.randn(3, requires_grad=True)
    eager_cache, cache = torch.zeros(2, 3), torch.zeros(2, 3)
    fn(eager_cache, k)
    with pytest.warns(UserWarning, match="requires grad"):  # the call runs eagerly
        fulmen.jit(fn)(cache, k).backward()
    assert cache.requires_grad and type(cache.grad_fn) is type(eager_cache.grad_fn)
    torch.testing.assert_close(cache, eager_cache)
    torch.testing.assert_close(k.grad, torch.full((3,), 2.0))


def test_reshape_of_an_intermediate_is_decided_by_its_eager_strides():
    def view(x):
        t = x * 2
        t.reshape(-1).add_(1)  # t is contiguous: reshape is a view, t changes
        return t

    def copy(x):
        t = x.transpose(0, 1) * 2
        t.reshape(-1).add_(1)  # t is transposed, as in eager: reshape copies, t is unchanged
        return t

    check(view, torch.randn(2, 3))
    check(copy, torch.randn(2, 3))


def test_undecidable_aliasing_raises():
    def expand_write(x):
        x.expand(3, 4).zero_()
        return x

    with pytest.raises(NotYetSupportedError, match="expand"):
        fulmen.jit(expand_write)(torch.randn(1, 4))


def test_reshape_of_a_contiguous_input_is_a_view():
    def fn(x):
        x.reshape(-1)[1] = 7.0
        x.flatten()[0] = 3.0
        return x

    check(fn, torch.randn(2, 3))


def test_random_inplace_matches_eager_stream():
    def fn(x):
        x.uniform_(-1, 1)
        return x.normal_() * 2

    torch.manual_seed(1)
    expected = fn(torch.empty(5))
    torch.manual_seed(1)
    actual = fulmen.jit(fn)(torch.empty(5))
    torch.testing.assert_close(actual, expected)



def test_random_inplace_bounds_given_as_0d_tensors_as_eager():
    """HF's NEFTune hook: `zeros_like(out).uniform_(-mag, mag)` with `mag` a 0-d tensor, whose
    number eager reads; the trace crashed (`.item()` on a meta tensor)."""
    def fn(x):
        mag = 5.0 / torch.sqrt(torch.tensor(x.size(0) * x.size(1)))
        return x + torch.zeros_like(x).uniform_(-mag, mag), torch.empty(3).normal_(mag, mag * 2)

    x = torch.randn(4, 6)
    jfn = fulmen.jit(fn)
    for seed in (1, 2):
        torch.manual_seed(seed)
        expected = fn(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(jfn(x), expected)

def test_mutation_of_a_captured_tensor():
    state = torch.zeros(3)

    def fn(x):
        state.add_(x)
        return state * 1

    jfn = fulmen.jit(fn)
    jfn(torch.ones(3))
    out = jfn(torch.ones(3))
    torch.testing.assert_close(state, torch.full((3,), 2.0))
    torch.testing.assert_close(out, torch.full((3,), 2.0))


def test_metadata_inplace_raises_under_fullgraph_and_runs_eagerly_otherwise():
    with pytest.raises(NotYetSupportedError, match="t_"):
        fulmen.jit(lambda x: x.t_(), fullgraph=True)(torch.randn(2, 3))
    x = torch.randn(2, 3)
    with pytest.warns(UserWarning, match="t_"):
        out = fulmen.jit(lambda x: x.t_())(x)
    assert out is x and x.shape == (3, 2)


def test_mutated_inputs_sharing_memory_run_eagerly():
    jfn = fulmen.jit(lambda x, y: x.add_(y))
    a, b = torch.zeros(3), torch.ones(3)
    jfn(a, b)
    with pytest.warns(UserWarning, match="share memory"):
        out = jfn(a, a[:])  # a cache hit: the runtime checks aliasing of mutated inputs
    assert out is a
    torch.testing.assert_close(a, torch.full((3,), 2.0))  # eager's x.add_(x)
    out = jfn(a, a)  # one tensor twice: one trace input (NOTE [repeated tensor arguments])
    assert out is a and fulmen.compile_stats(jfn).eager_calls == 1
    torch.testing.assert_close(a, torch.full((3,), 4.0))
    a = torch.full((3,), 3.0)
    torch.testing.assert_close(fulmen.jit(lambda x, y: x.mul_(y))(a, a[:]), torch.full((3,), 9.0))
    with pytest.raises(NotYetSupportedError, match="share memory"):
        fulmen.jit(lambda x, y: x.mul_(y), fullgraph=True)(a, a[:])


def test_a_strided_input_sharing_only_its_last_element_with_another_runs_eagerly():
    """`buf[::2]` and `buf[8:]` of a 9-element buffer share one element, the strided view's
    last: its memory span ends after that element (`(size - 1) * stride + 1` elements)."""
    def fn(a, b):
        a.add_(1)
        return b * 2

    jfn = fulmen.jit(fn)
    jfn(torch.zeros(5), torch.zeros(1))  # traced on independent inputs
    expected_buf, buf = torch.zeros(9), torch.zeros(9)
    expected = fn(expected_buf[::2], expected_buf[8:])
    with pytest.warns(UserWarning, match="share memory"):
        actual = jfn(buf[::2], buf[8:])
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(buf, expected_buf)


def test_reshape_aliasing_decided_from_meta_kernel_strides():
    # MobileNetV2: flatten of a pooled output, then an in-place dropout/add on the result;
    # the pool's output strides come from PyTorch's meta kernel, so flatten is known a view
    def pooled(x):
        p = torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), start_dim=1)
        p.add_(1)
        return p

    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(fulmen.jit(pooled)(x), pooled(x))


def test_reshape_of_a_non_contiguous_input_is_a_copy():
    def fn(x):
        flat = x.reshape(-1)  # x is a transposed input: eager copies
        flat.add_(1)
        return flat

    base = torch.randn(3, 4)
    x, x_eager = base.t(), base.clone().t()
    torch.testing.assert_close(fulmen.jit(fn)(x), fn(x_eager))
    torch.testing.assert_close(x, x_eager)  # the input is not modified, as in eager


def test_inplace_aten_ops_called_through_torch_ops_write_their_arguments():
    """`torch.ops.aten.add_.Tensor(x, y)`: an OpOverload's name (`add_.Tensor`) does not end in
    `_`, so the in-place check read its schema too late and the write was dropped."""
    def fn(x, xs):
        torch.ops.aten.add_.Tensor(x, torch.ones_like(x))
        torch.ops.aten.mul_(x, 3)
        torch.ops.aten._foreach_mul_.Scalar(xs, 2.0)
        return x * 2

    got, want = (torch.zeros(3), [torch.ones(2)]), (torch.zeros(3), [torch.ones(2)])
    torch.testing.assert_close(fulmen.jit(fn)(*got), fn(*want))
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1][0], want[1][0])

    def through_out(x):
        torch.ops.aten.add.out(x, 1, out=x)
        return x

    jitted, x = fulmen.jit(through_out), torch.zeros(2)  # not recorded: runs eagerly (h52probe)
    assert jitted(x) is x and torch.equal(x, torch.ones(2))
    assert fulmen.compile_stats(jitted).eager_calls == 1
    with pytest.raises(NotYetSupportedError, match="through torch.ops"):
        fulmen.jit(through_out, fullgraph=True)(torch.zeros(2))


@pytest.mark.parametrize("write, make", [
    (lambda x: torch.view_as_real(x).mul_(2), lambda: torch.ones(2, dtype=torch.complex64)),
    (lambda x: torch.view_as_complex(x).mul_(2j), lambda: torch.ones(2, 2)),
    (lambda x: x.conj().add_(1), lambda: torch.ones(3)),
    (lambda x: x.conj().add_(1j), lambda: torch.ones(3, dtype=torch.complex64)),
    (lambda x: x.resolve_conj().add_(1), lambda: torch.ones(3)),
    (lambda x: torch.atleast_2d(x).add_(1), lambda: torch.ones(3)),
    (lambda x: torch.atleast_3d(x)[0].add_(1), lambda: torch.ones(2, 2)),
    (lambda x: x.cpu().mul_(2), lambda: torch.ones(3)),
    (lambda x: x.view(torch.int32).add_(1), lambda: torch.ones(3)),
], ids=["view_as_real", "view_as_complex", "conj-real", "conj-complex", "resolve_conj",
        "atleast_2d", "atleast_3d", "cpu", "view-dtype"])
def test_writes_through_every_kind_of_view_reach_the_input(write, make):
    """Each of these returns a view of (or the very) input in eager; a write through it once
    left the input unchanged (the view was not known as one), or failed in view_scatter."""
    def fn(x):
        write(x)
        return x * 1

    got, want = make(), make()
    torch.testing.assert_close(fulmen.jit(fn)(got), fn(want))
    torch.testing.assert_close(got, want)


def test_a_write_through_a_view_traced_with_symbolic_sizes_warns_nothing(recwarn):
    """`view_scatter`'s meta runs on fake tensors with symbolic sizes; its alias check read
    their `data_ptr`, which warns (seen under DeepSeek-V3 generate)."""
    def fn(x):
        x[:, 1:].mul_(2)
        return x.sum(1)

    jfn = fulmen.jit(fn, dynamic=True)
    for rows in (3, 5):
        got, want = torch.ones(rows, 4), torch.ones(rows, 4)
        torch.testing.assert_close(jfn(got), fn(want))
        torch.testing.assert_close(got, want)
    assert not [w for w in recwarn if "data pointer" in str(w.message)], recwarn.list


def test_a_tensor_hook_inside_runs_the_call_eagerly():
    # Lightning Fabric's module wrapper registers a hook on every output: `fulmen.jit(
    # fabric.setup(model))` traces it
    def fn(x):
        y = x * 2
        y.register_hook(lambda grad: grad * 10)
        return (y * y).sum()

    x = torch.randn(3, requires_grad=True)
    fn(x).backward()
    want, x.grad = x.grad, None
    jfn = fulmen.jit(fn)
    with pytest.warns(UserWarning, match="never fire"):
        jfn(x).backward()
    torch.testing.assert_close(x.grad, want)  # the hook's x10 is applied
    assert fulmen.compile_stats(jfn).eager_calls == 1
    with pytest.raises(NotYetSupportedError, match="never fire") as info:
        fulmen.jit(fn, fullgraph=True)(x)
    assert "register_hook" in str(info.value)


def test_retain_grad_inside_runs_the_call_eagerly():
    def fn(x):
        y = x * 2
        y.retain_grad()
        return y, (y * y).sum()

    x = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match="retain_grad"):
        y, loss = fulmen.jit(fn)(x)
    loss.backward()
    torch.testing.assert_close(y.grad, 2 * y.detach())


_UPDATES_OF_AN_INPUT = {
    "mul_": lambda h: (h.mul_(2), h.sum())[1],
    "view_add_": lambda h: (h[:, :3].add_(1), (h * h).sum())[1],
    "diagonal_zero_": lambda h: (h.diagonal().zero_(), (h * 3).sum())[1],
    "masked_fill_": lambda h: (h.masked_fill_(h > 0, 0.5), h.tanh().sum())[1],
    "relu_returned": lambda h: torch.relu_(h),
}


@pytest.mark.parametrize("update", list(_UPDATES_OF_AN_INPUT))
def test_an_input_requiring_grad_modified_in_place_trains_as_eager(update):
    """A non-leaf argument that requires grad, modified in place (a jitted block whose first
    layer is `nn.ReLU(inplace=True)`): eager records the update in the argument's history."""
    fn = _UPDATES_OF_AN_INPUT[update]
    results = []
    for run in (fn, fulmen.jit(fn)):
        torch.manual_seed(0)
        w = torch.randn(4, 6, requires_grad=True)
        h = w * 1.5
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = run(h)
        out.sum().backward()
        results.append((out.detach(), h.detach(), w.grad, h._version, type(h.grad_fn)))
    for actual, expected in zip(*results):
        if isinstance(actual, torch.Tensor):
            torch.testing.assert_close(actual, expected)
        else:
            assert actual == expected


def test_out_argument_with_an_input_requiring_grad_raises_eagers_error():
    def f(p):
        r = torch.zeros(3)
        torch.add(p, 1, out=r)
        return r

    p = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        f(p)
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        fulmen.jit(f)(p)
    with torch.no_grad():  # no autograd: eager and fulmen write the result
        torch.testing.assert_close(fulmen.jit(f)(p), p.detach() + 1)


def _gather_out(src, index, out):
    return torch.gather(src, 0, index, out=out)


def _add_out(src, index, out):
    return torch.add(src, 1, out=out)


def test_out_argument_of_another_dtype_is_refused_or_cast_as_eager():
    """`gather` requires `out=` of the result's own dtype (eager refuses float64 for a float32
    source) where `add` casts to it: fulmen asks the op itself, never writes silently."""
    src, index = torch.randn(3, 3), torch.tensor([[0, 1, 2], [2, 1, 0], [1, 1, 1]])
    for fn in (_gather_out, _add_out):
        eager_out, jit_out = torch.zeros(3, 3, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64)
        try:
            expected = fn(src, index, eager_out)
        except RuntimeError as error:
            with pytest.raises(RuntimeError, match="Expected out tensor to have dtype float"):
                fulmen.jit(fn)(src, index, jit_out)
            assert fn is _gather_out and "out tensor" in str(error)
            torch.testing.assert_close(jit_out, eager_out)  # nothing written
            continue
        assert fulmen.jit(fn)(src, index, jit_out) is jit_out
        torch.testing.assert_close(jit_out, expected)
        assert fn is _add_out


def _overwritten(kind):
    def fn(x, z):
        y = x * 2
        h = x.sum()  # x has another use: its gradient is defined either way
        if kind == "zero_":
            y.zero_()
        elif kind == "fill_":
            y.fill_(3.0)
        else:
            y.copy_(z)
        return y, h
    return fn


@pytest.mark.parametrize("kind", ["zero_", "fill_", "copy_"])
def test_a_value_overwritten_in_place_still_requires_grad_as_in_eager(kind):
    # eager's Fill/Zero/CopyBackward keep the overwritten tensor in the graph: the result
    # requires grad and gives the tensor it replaced a zero gradient, not none
    fn = _overwritten(kind)
    x = torch.randn(3, 4, requires_grad=True)
    z = torch.randn(3, 4)
    expected, actual = fn(x, z), fulmen.jit(fn)(x, z)
    assert [t.requires_grad for t in actual] == [t.requires_grad for t in expected]
    torch.testing.assert_close(actual, expected)
    cotangents = (torch.randn(3, 4), torch.randn(()))
    torch.testing.assert_close(torch.autograd.grad(actual, x, cotangents),
                               torch.autograd.grad(expected, x, cotangents))


@pytest.mark.parametrize("update", [
    lambda w: w.add_(1), lambda w: w[0].mul_(2), lambda w: w.unsqueeze_(0),
], ids=["add_", "view_mul_", "unsqueeze_"])
def test_in_place_update_of_a_new_leaf_requiring_grad_raises_as_eager(update):
    def fn(a):
        w = torch.ones(3, requires_grad=True)
        update(w)
        return a * w

    with pytest.raises(RuntimeError, match="leaf Variable"):
        fn(torch.ones(3))
    with pytest.raises(RuntimeError, match="leaf Variable"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the call runs eagerly
        fulmen.jit(fn)(torch.ones(3))


def test_no_grad_update_of_a_new_leaf_requiring_grad_answers_as_eager(codegen_eager):
    """`torch.ones(3, requires_grad=True)` is a fresh leaf (NOTE [fresh leaves]): the result
    requires grad only because of it, so the call runs eagerly. It used to compile, and the
    result required grad only while torch ran the region: a fused kernel's did not."""

    def fn(a):
        w = torch.ones(3, requires_grad=True)
        with torch.no_grad():
            w.mul_(2)  # eager allows this under no_grad
        return (a * w).sum()

    a = torch.randn(3)
    out = fulmen.jit(fn)(a)
    torch.testing.assert_close(out, fn(a))
    assert out.requires_grad


def test_out_tuple_writes_every_output():
    """`torch.max(x, dim, out=(values, indices))` writes both tensors of the tuple, as eager."""

    def fn(x, values, indices):
        torch.max(x, 1, out=(values, indices))
        return values * 2, indices + 1

    check(fn, torch.randn(3, 5), torch.empty(3), torch.empty(3, dtype=torch.long))


def test_copy_from_another_dtype_casts_like_eager():
    def fn(x, y):
        x.copy_(y)
        return x * 2

    check(fn, torch.zeros(3, 4), torch.arange(12).reshape(3, 4))
    check(fn, torch.zeros(3, 4), torch.randn(3, 4, dtype=torch.float64))
