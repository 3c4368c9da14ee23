"""Graph breaks: value-dependent Python runs as in eager, split into guarded segments."""

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.core import FulmenError
from fulmen.tree import MAX_BRANCHES


def _grads_match(fn, jfn, *args):
    """Forward values and gradients of every floating input equal eager's."""
    def run(f):
        inputs = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
        out = f(*inputs)
        out.sum().backward() if out.requires_grad else None
        return out.detach(), [i.grad for i in inputs]

    out, grads = run(jfn)
    ref, ref_grads = run(fn)
    torch.testing.assert_close(out, ref)
    for grad, ref_grad in zip(grads, ref_grads):
        if ref_grad is None:
            assert grad is None
        else:
            torch.testing.assert_close(grad, ref_grad)


def _branchy(x, y):
    z = x * 2
    if z.sum() > 0:
        return (z + y).exp()
    return (z - y).sin() * y


def test_branch_on_a_tensor_value_runs_both_ways_with_gradients():
    jfn = fulmen.jit(_branchy)
    x = torch.randn(5)
    y = torch.randn(5, requires_grad=True)
    for sign in (1, -1, 1, -1, -1):
        _grads_match(_branchy, jfn, (x.abs() * sign).requires_grad_(), y)
    stats = fulmen.compile_stats(jfn)
    assert stats.cache_misses == 1  # one cache entry, two branches of its trace tree
    assert stats.branches == 2
    assert stats.graph_breaks == [s for s in stats.graph_breaks if "bool(" in s]
    assert "test_graph_breaks.py" in stats.graph_breaks[0]


def test_printed_path_names_the_break_and_its_line():
    jfn = fulmen.jit(_branchy)
    jfn(torch.ones(3), torch.ones(3))
    traced = str(fulmen.last_traces(jfn)[0])
    assert "# graph break: bool(" in traced and "answered True" in traced
    assert "if z.sum() > 0:" in traced
    # every stage of every segment follows; the segments of the path run one after another
    names = {trace.name for trace in fulmen.last_traces(jfn)[1:]}
    assert any(name.endswith("segment0") for name in names)
    assert any(name.endswith("segment1") or name == "forward" for name in names)


def test_the_traced_path_runs_and_its_guard_checks_the_answer():
    jfn = fulmen.jit(_branchy)
    x, y = torch.ones(3), torch.ones(3)
    jfn(x, y)
    program = fulmen.last_traces(jfn)[0].python_callable()
    torch.testing.assert_close(program(x, y), _branchy(x, y))
    with pytest.raises(FulmenError, match="guard answered False"):
        program(-x, y)


def test_item_feeding_a_python_loop_count():
    def fn(x, n):
        y = x
        for _ in range(int(n.sum().item())):
            y = y * 1.5 + 1
        return y

    jfn = fulmen.jit(fn)
    x = torch.randn(4, requires_grad=True)
    for count in (2, 3, 2, 0):
        n = torch.tensor([count])
        _grads_match(fn, jfn, x, n)


def test_boolean_mask_indexing_and_nonzero():
    def fn(x):
        picked = x[x > 0]
        where = torch.nonzero(x < -0.5)
        return picked.exp().sum() + where.sum()

    jfn = fulmen.jit(fn)
    for seed in range(4):
        torch.manual_seed(seed)
        _grads_match(fn, jfn, torch.randn(3, 5, requires_grad=True))
    assert fulmen.compile_stats(jfn).branches >= 2


def test_data_dependent_ops_without_meta_kernels():
    def fn(x):
        values = torch.unique(x.round())
        counts = torch.bincount((x.abs() * 3).long().flatten())
        return values.sum() + counts.float().mean() + torch.masked_select(x, x > 0).sum()

    jfn = fulmen.jit(fn)
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(6)
        torch.testing.assert_close(jfn(x), fn(x))


def test_contains_equal_allclose_and_tolist():
    def fn(x, y):
        out = x * 2
        if 3.0 in x:
            out = out + 1
        if torch.equal(x, y):
            out = out * 3
        if torch.allclose(x, y + 1e-9):
            out = out - 5
        return out + sum(x.tolist())

    jfn = fulmen.jit(fn)
    cases = [(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 3.0])),
             (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0])),
             (torch.tensor([3.0, 2.0]), torch.tensor([0.0, 0.0]))]
    for x, y in cases * 2:
        torch.testing.assert_close(jfn(x, y), fn(x, y))


def test_mutation_and_randomness_before_a_break_match_eager():
    def fn(x, buf):
        buf.add_(1)
        h = F.dropout(x, 0.5, training=True)
        if (h > 0).sum() > 2:
            return h * buf
        return h - buf

    jfn = fulmen.jit(fn)
    for seed in range(4):
        x = torch.randn(8)
        buf, ref_buf = torch.zeros(8), torch.zeros(8)
        torch.manual_seed(seed)
        out = jfn(x, buf)
        torch.manual_seed(seed)
        ref = fn(x, ref_buf)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(buf, ref_buf)


def test_random_draws_match_eager_across_a_new_branch():
    def fn(x):
        h = x + torch.rand_like(x)
        if h.sum() > x.numel():
            return h * 2
        return h

    jfn = fulmen.jit(fn)
    for seed in range(6):
        x = torch.randn(4) + (seed % 2)
        torch.manual_seed(seed)
        out, after = jfn(x), torch.rand(2)
        torch.manual_seed(seed)
        ref, ref_after = fn(x), torch.rand(2)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(after, ref_after)


def test_module_with_break_trains_like_eager():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 2)

        def forward(self, x, mask):
            h = torch.tanh(self.a(x))
            if mask.all():  # the pattern of HF's masking utilities
                return self.b(h)
            return self.b(h * mask[:, None])

    torch.manual_seed(0)
    model = Net()
    jmodel = fulmen.jit(model)
    for step in range(4):
        x = torch.randn(3, 4)
        mask = torch.ones(3) if step % 2 == 0 else torch.tensor([1.0, 0.0, 1.0])
        model.zero_grad()
        jmodel(x, mask).square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x, mask).square().sum().backward()
        for grad, param in zip(grads, model.parameters()):
            torch.testing.assert_close(grad, param.grad)


def test_a_guard_with_too_many_answers_runs_eagerly():
    def fn(x):
        return x * int(x.sum().item())

    jfn = fulmen.jit(fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for value in range(MAX_BRANCHES + 3):
            x = torch.full((2,), float(value))
            torch.testing.assert_close(jfn(x), fn(x))
    stats = fulmen.compile_stats(jfn)
    assert stats.branches == MAX_BRANCHES and stats.eager_calls == 3
    assert sum("run eagerly" in str(w.message) for w in caught) == 1


def test_fullgraph_keeps_the_error():
    with pytest.raises(FulmenError, match="bool"):
        fulmen.jit(_branchy, fullgraph=True)(torch.ones(3), torch.ones(3))


def test_breaks_are_logged_once(caplog):
    jfn = fulmen.jit(lambda x: x + 1 if x.max() > 10 else x - 1)
    with caplog.at_level(logging.INFO, logger="fulmen.breaks"):
        jfn(torch.ones(2))
        jfn(torch.full((2,), 20.0))
        jfn(torch.ones(3))
    messages = [r.getMessage() for r in caplog.records if r.name == "fulmen.breaks"]
    assert len(messages) == 1 and "graph break: bool(" in messages[0]


def test_no_break_program_has_no_tree():
    jfn = fulmen.jit(lambda x: x * 2)
    jfn(torch.ones(2))
    assert [entry.tree for entry in jfn._cache.values()] == [False]
    assert fulmen.compile_stats(jfn).graph_breaks == []
    assert fulmen.compile_stats(jfn).branches == 0


def test_data_dependent_op_reading_a_captured_tensor():
    weights = torch.randint(1, 4, (5,))

    def fn(x):
        return torch.cov(x, fweights=weights) + torch.nonzero(weights > 1).sum()

    jfn = fulmen.jit(fn)
    for _ in range(2):
        x = torch.randn(3, 5)
        torch.testing.assert_close(jfn(x), fn(x))


def _longformer_global_scores(x, mask):
    """Longformer's global attention: a view sized by a tensor (`n = mask.sum(-1).max()`),
    written through a transposed view of it."""
    n = mask.sum(-1).max()
    scores = x * 2
    view = scores.view(2, n, 4)
    view.transpose(1, 2)[0, 1] = -1.0
    return scores, view.view(2, n * 4) + 1


@pytest.mark.parametrize("mask", [[[1, 1, 1, 0], [1, 1, 0, 0]], [[1, 1, 0, 0], [1, 0, 0, 0]]])
def test_write_through_a_view_sized_by_a_tensor_value(mask):
    mask = torch.tensor(mask)
    x = torch.randn(2, int(mask.sum(-1).max()), 4, requires_grad=True)
    expected = _longformer_global_scores(x, mask)
    actual = fulmen.jit(_longformer_global_scores)(x, mask)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
    sum(a.sum() for a in actual).backward()
    grad, x.grad = x.grad, None
    sum(e.sum() for e in expected).backward()
    torch.testing.assert_close(grad, x.grad)
