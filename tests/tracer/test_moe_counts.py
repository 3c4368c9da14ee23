"""Mixture-of-experts routing: the token count of each expert (the output size of
`torch.where`, a graph break) is traced symbolic once it has varied, so later steps reuse the
compiled segments (NOTE [symbolic counts at a break site] in `fulmen.tracer.break_sizes`).
Every call is compared with eager: values, gradients, and which compiled path it took."""

import copy

import pytest
import torch

import fulmen


class TwoExperts(torch.nn.Module):
    """Top-1 routing over two linear experts, as HF's MoE blocks do it (`where` + index_add)."""

    def __init__(self, width: int = 8, branch: bool = False) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(width, 2, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2))
        self.branch = branch

    def forward(self, x):
        logits = self.gate(x)
        choice = logits.argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            (idx,) = torch.where(choice == i)
            y = expert(x[idx]) * logits[idx, i:i + 1].sigmoid()
            if self.branch:  # Python decides on the count: a guard of the symbol
                y = y * 2 if idx.shape[0] > 6 else y - 1
            out = out.index_add(0, idx, y)
        return out


def _step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    (out * out).sum().backward()
    return out, [p.grad for p in model.parameters()]


def _counts(model, x):
    with torch.no_grad():
        choice = model.gate(x).argmax(-1)
    return [int((choice == i).sum()) for i in range(2)]


def _compare_training(model, inputs):
    eager = copy.deepcopy(model)
    jitted = fulmen.jit(model)
    for x in inputs:
        out, grads = _step(jitted, x)
        want, want_grads = _step(eager, x)
        torch.testing.assert_close(out, want)
        for got, expected in zip(grads, want_grads):
            torch.testing.assert_close(got, expected)
    return fulmen.compile_stats(jitted)


def test_random_routing_training_retraces_once():
    torch.manual_seed(0)
    model = TwoExperts()
    inputs = [torch.randn(16, 8) for _ in range(6)]
    counts = {tuple(_counts(model, x)) for x in inputs}
    assert len(counts) >= 4  # the routing varies (the test would pass vacuously otherwise)
    stats = _compare_training(model, inputs)
    # the second count is a symbol from then on: one retrace, not one per step
    assert stats.eager_calls == 0 and len(stats.recompile_reasons) == 1, stats.recompile_reasons


def test_decisions_on_the_count_are_checked_at_each_call():
    torch.manual_seed(1)
    model = TwoExperts(branch=True)
    inputs = [torch.randn(12, 8) for _ in range(12)]
    counts = [_counts(model, x)[0] for x in inputs]
    assert {n > 6 for n in counts if n >= 2} == {True, False}  # both sides of the branch
    stats = _compare_training(model, inputs)
    assert stats.eager_calls == 0


@pytest.mark.parametrize("count", [0, 1])
def test_counts_zero_and_one_take_their_own_paths(count):
    torch.manual_seed(2)
    model = TwoExperts()
    with torch.no_grad():
        model.gate.weight.zero_()
        model.gate.weight[0, 0] = 1.0  # expert 0 takes the tokens whose first feature is > 0

    def batch(n: int) -> torch.Tensor:
        x = torch.randn(10, 8)
        x[:, 0] = -1.0
        x[:n, 0] = 1.0
        return x

    # the counts vary first (the site goes symbolic), then the specialised ones come
    inputs = [batch(5), batch(3), batch(count), batch(6), batch(count)]
    stats = _compare_training(model, inputs)
    assert stats.eager_calls == 0


def test_inference_with_varying_routing_reuses_the_symbolic_path():
    torch.manual_seed(3)
    model = TwoExperts()
    jitted = fulmen.jit(model)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(20, 8)
            torch.testing.assert_close(jitted(x), model(x))
    stats = fulmen.compile_stats(jitted)
    assert stats.eager_calls == 0 and len(stats.recompile_reasons) == 1, stats.recompile_reasons


class TopTwo(torch.nn.Module):
    """Top-2 routing as HF Mixtral's eager experts do it: `torch.where` of a `(k, tokens)`
    mask gives two index tensors of one count, which the program uses together."""

    def __init__(self, width: int = 8, experts: int = 3) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(width, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(experts))

    def forward(self, x):
        weights, chosen = self.gate(x).softmax(-1).topk(2, dim=-1)
        mask = torch.nn.functional.one_hot(chosen, len(self.experts)).permute(2, 1, 0)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            pos, idx = torch.where(mask[i])
            out = out.index_add(0, idx, expert(x[idx]) * weights[idx, pos, None])
        return out


def test_two_index_tensors_of_one_count_share_the_symbolic_path():
    torch.manual_seed(4)
    stats = _compare_training(TopTwo(), [torch.randn(16, 8) for _ in range(6)])
    assert stats.eager_calls == 0 and len(stats.recompile_reasons) == 1, stats.recompile_reasons


def test_a_count_given_to_an_op_described_from_values_is_traced_exactly():
    def fn(x):
        (idx,) = torch.where(x > 0)
        counts = torch.bincount(idx % 3, minlength=idx.shape[0])  # needs the count as a number
        return x[idx].sum() + counts.float().sum() + counts.shape[0]

    jitted = fulmen.jit(fn)
    for n in (5, 7, 9, 4, 7):
        x = -torch.ones(12)
        x[:n] = 1
        torch.testing.assert_close(jitted(x), fn(x))
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_a_returned_count_is_each_calls_own():
    def fn(x):
        (idx,) = torch.where(x > 0)
        return x[idx].sum(), idx.shape[0]

    jitted = fulmen.jit(fn)
    for n in (5, 7, 9, 4):
        x = -torch.ones(12)
        x[:n] = 1
        assert jitted(x) == fn(x)
    stats = fulmen.compile_stats(jitted)
    assert stats.eager_calls == 0 and len(stats.recompile_reasons) == 1


@pytest.mark.slow  # (about 9 s: a retrace per refused specialisation)
def test_counts_alternating_between_specialisations_equal_eager_at_every_call():
    """Decisions on two counts (a bound, an equality, a parity, a comparison of both) with
    counts from 0 to 16 in random order: every call equals eager, whichever path it takes."""

    def fn(x, w):
        (a,) = torch.where(x > 0)
        (b,) = torch.where(x < -0.5)
        y = (x[a] * w[: a.shape[0]]).sum() if a.shape[0] <= w.shape[0] else x[a].sum()
        if a.shape[0] == 3:
            y = y * 3
        if a.shape[0] % 2 == 0:
            y = y + 1
        z = torch.cat([x[a], x[b]]).cumsum(0)[-1] if a.shape[0] + b.shape[0] > 0 else x.sum()
        if b.shape[0] > a.shape[0]:
            z = z - 2
        return y + z + a.shape[0] * b.shape[0]

    generator = torch.Generator().manual_seed(5)
    jitted, w = fulmen.jit(fn), torch.randn(10, generator=generator)
    for n in (5, 7, 3, 12, 4, 1, 9):
        x = torch.randn(16, generator=generator)
        x[:n] = x[:n].abs() + 0.1
        x[n:] = -x[n:].abs()
        torch.testing.assert_close(jitted(x, w), fn(x, w))
