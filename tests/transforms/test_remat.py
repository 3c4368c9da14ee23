"""Rematerialization: the min-cut choice against brute force, and end-to-end effects."""

import itertools

import pytest
import torch

import fulmen
from fulmen.tracer import trace_program
from fulmen.transforms import dce, remat
from fulmen.transforms.autodiff import split_forward_backward
from fulmen.transforms.remat import (
    MAX_RECOMPUTED_REDUCTION,
    STATEMENT_BYTES,
    choose_saved,
    input_derived,
    is_recomputable,
    is_view,
    nbytes,
    rematerialize,
)


def _split(fn, *shapes):
    inputs = [torch.randn(*shape, requires_grad=True) for shape in shapes]
    return split_forward_backward(dce(trace_program(fn, tuple(inputs), {}).trace))


def _computable(target: str, available: set[str], producers: dict) -> bool:
    if target in available:
        return True
    bsym = producers.get(target)
    if bsym is None or not is_recomputable(bsym):
        return False
    return all(_computable(p.name, available, producers) for p in bsym.proxy_inputs)


def _recomputed(needed, available: set[str], producers: dict, charged=None) -> int:
    """How many values the backward computes again from `available` (re-taking a view of a
    value it has costs nothing and is not counted); only those made by the statements of ids
    `charged` when given."""
    names, stack = set(), [p.name for p in needed]
    while stack:
        name = stack.pop()
        if name in available or name in names:
            continue
        names.add(name)
        stack.extend(p.name for p in producers[name].proxy_inputs)
    return sum(not is_view(producers[name]) and (charged is None or id(producers[name]) in charged)
               for name in names)


def _storage_bytes(saved, producers: dict, inputs: set[str]) -> int:
    """Bytes kept alive by saving `saved`: a view keeps its base's storage (each counted once);
    forward inputs cost nothing."""
    bases = set()
    for proxy in saved:
        name = proxy.name
        while name in producers and is_view(producers[name]):
            name = next(p.name for p in producers[name].proxy_inputs)
        bases.add(name)
    proxies = {p.name: p for b in producers.values() for p in b.proxy_outputs}
    return sum(nbytes(proxies[name]) for name in bases if name not in inputs)


def _cost(forward, needed, available: set[str], bytes_: int) -> tuple[int, int]:
    """The objective of the cut (bytes kept alive plus the host-time charge per recomputed
    statement of `input_derived`), then the recomputation as the tie-break."""
    producers = {name: b for b in forward.bsyms for name in b.output_names}
    charged = input_derived(forward.args, forward.bsyms)
    return (bytes_ + remat.STATEMENT_BYTES * _recomputed(needed, available, producers, charged),
            _recomputed(needed, available, producers))


def _brute_force(forward, needed) -> tuple[int, int]:
    """The least `_cost` over every set of forward values the backward could be given."""
    producers = {name: b for b in forward.bsyms for name in b.output_names}
    inputs = {p.name for p in forward.args}
    candidates = [p for b in forward.bsyms for p in b.proxy_outputs]
    best = None
    for size in range(len(candidates) + 1):
        for subset in itertools.combinations(candidates, size):
            available = inputs | {p.name for p in subset}
            if all(_computable(p.name, available, producers) for p in needed):
                cost = _cost(forward, needed, available,
                             _storage_bytes(subset, producers, inputs))
                best = cost if best is None else min(best, cost)
    return best


PROGRAMS = {
    "chain": (lambda x: torch.tanh(torch.exp(x) * 2).sin(), [(8, 8)]),
    "matmul": (lambda x, w: torch.relu(torch.sin(x) @ w).exp().sum(), [(4, 6), (6, 5)]),
    "diamond": (lambda x: (x.exp() * x.sin()) + x.cos() * x.exp(), [(5, 5)]),
    "broadcast": (lambda x, b: torch.tanh(x + b).pow(2).mean(0), [(6, 4), (4,)]),
    "mlp": (lambda x, w1, w2: torch.nn.functional.gelu(x @ w1) @ w2, [(3, 4), (4, 8), (8, 2)]),
    # views of one matmul output, as in attention's q/k/v split: the backward needs exp(q) and
    # v; saving v keeps all of x @ w alive, so saving exp(q) too would cost more than x @ w
    "split views": (lambda x, w: (lambda q, v: q.exp() * v)(*(x @ w).split(3, dim=1)),
                    [(4, 5), (5, 6)]),
    "transposed views": (lambda x, w: (lambda q, v: (q.sin() * 2).transpose(0, 1) @ v)(
        *(x @ w).split(3, dim=1)), [(4, 5), (5, 6)]),
    # a mask from arange (no gradient's path: its statements are charged), read by the
    # backward: with the charge, saved; without, rebuilt
    "mask": (lambda x: (x * torch.where(torch.arange(6)[None, :] <= torch.arange(6)[:, None],
                                        x.new_ones(()), 0.5)).sin(), [(6, 6)]),
    # a tie in bytes: saving exp(x @ w) or x @ w (and recomputing exp)
    "tie": (lambda x, w: torch.exp(x @ w) @ w, [(4, 4), (4, 4)]),
}


@pytest.mark.parametrize("statement_bytes", [0, STATEMENT_BYTES])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_min_cut_matches_brute_force(name, statement_bytes, monkeypatch):
    # with no charge the choice is by bytes alone
    monkeypatch.setattr(remat, "STATEMENT_BYTES", statement_bytes)
    fn, shapes = PROGRAMS[name]
    split = _split(fn, *shapes)
    forward = split.forward
    residuals = forward.output[1]
    saved = choose_saved(forward.args, forward.bsyms, residuals)
    inputs = {p.name for p in forward.args}
    producers = {n: b for b in forward.bsyms for n in b.output_names}
    available = inputs | {p.name for p in saved}
    assert all(_computable(p.name, available, producers) for p in residuals)
    bytes_ = _storage_bytes(saved, producers, inputs)
    # fewest bytes plus statement charge, and among the cheapest, the least recomputation
    assert _cost(forward, residuals, available, bytes_) == \
        _brute_force(forward, residuals)


def test_a_view_is_charged_its_base_once():
    # the backward needs two views of one matmul output: save the output, re-take the views
    split = _split(lambda x, w: (lambda q, v: q.exp() * v)(*(x @ w).split(2, dim=1)),
                   (3, 4), (4, 4))
    forward = split.forward
    saved = choose_saved(forward.args, forward.bsyms, forward.output[1])
    matmul_outputs = {p.name for b in forward.bsyms if not is_recomputable(b)
                      for p in b.proxy_outputs}
    assert {p.name for p in saved} - {p.name for p in forward.args} == matmul_outputs


def test_recomputation_is_placed_just_before_its_first_use():
    def fn(x, w1, w2, w3):
        h = x
        for w in (w1, w2, w3):
            h = torch.sin(h) @ w  # backward: cos(h) needs h, w's gradient needs sin(h)
        return h

    split = _split(fn, (4, 8), (8, 8), (8, 8), (8, 8))
    remat = rematerialize(split)
    forward_names = {n for b in split.forward.bsyms for n in b.output_names}
    bsyms = remat.backward.bsyms
    recomputed = [bool(b.output_names & forward_names) for b in bsyms]
    assert sum(recomputed) == 3  # the three sin(h), none saved
    for index, bsym in enumerate(bsyms):
        if not recomputed[index]:
            continue
        # the first statement after this run of recomputation reads what it recomputed
        after = next(i for i in range(index, len(bsyms)) if not recomputed[i])
        used = set().union(*(b.input_names for b in bsyms[index + 1: after + 1]))
        assert bsym.output_names & used


def test_matmul_and_random_ops_are_never_recomputed():
    split = _split(lambda x, w: torch.nn.functional.dropout(x @ w, 0.5).exp(), (4, 4), (4, 4))
    kinds = {b.sym.name: is_recomputable(b) for b in split.forward.bsyms}
    assert kinds["matmul"] is False
    assert not any(ok for name, ok in kinds.items() if "bernoulli" in name or "dropout" in name)


def test_rematerialized_training_matches_and_saves_less():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 256),
                                torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    with_remat, without = fulmen.jit(block), fulmen.jit(block, rematerialize=False)
    grads = []
    for jitted in (with_remat, without):
        block.zero_grad()
        jitted(x).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in block.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    remat_bytes = sum(nbytes(p) for p in fulmen.last_traces(with_remat)[-1].output[1])
    plain_bytes = sum(nbytes(p) for p in fulmen.last_traces(without)[-1].output[1])
    assert remat_bytes < plain_bytes
    assert any("rematerialization" in t.provenance
               for t in fulmen.last_backward_traces(with_remat))


def test_checkpoint_regions_are_recomputed():
    from torch.utils.checkpoint import checkpoint

    def block(x, w):
        return torch.tanh(x @ w).sin()

    def fn(x, w):
        return checkpoint(block, x, w, use_reentrant=False).exp().sum()

    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    jfn = fulmen.jit(fn)
    jfn(x, w).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    fn(x, w).backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
    forward = fulmen.last_traces(jfn)[-1]
    saved = {p.name for p in forward.output[1]}
    region = [b for b in forward.bsyms if "checkpoint" in b.tags]
    assert region and not any(b.output_names & saved for b in region)  # nothing saved inside
    assert "torch.matmul" in str(fulmen.last_backward_traces(jfn)[-1])  # recomputed


@pytest.mark.parametrize("inputs_require_grad", [True, False])
def test_reentrant_checkpoint_gives_eager_values_and_gradients(inputs_require_grad):
    # was refused; checkpoint() without use_reentrant defaults to it (with a warning)
    from torch.utils.checkpoint import checkpoint

    layer = torch.nn.Linear(4, 4)

    def fn(x):
        h = checkpoint(lambda t: torch.nn.functional.dropout(layer(t).relu(), 0.3), x,
                       use_reentrant=True)
        return (h * x).sum()

    results = []
    for f in (fn, fulmen.jit(fn)):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1),
                        requires_grad=inputs_require_grad)
        torch.manual_seed(0)
        out = f(x)
        if out.requires_grad:  # with no input requiring grad, nothing inside gets one
            out.backward()  # (eager's reentrant checkpoint refuses torch.autograd.grad)
        grads = [None if t.grad is None else t.grad.clone() for t in (layer.weight, x)]
        layer.zero_grad(set_to_none=True)
        results.append((out, out.requires_grad, grads))
    torch.testing.assert_close(results[1], results[0])
    assert results[0][1] == inputs_require_grad


def test_reentrant_checkpoint_with_one_argument_requiring_grad_records_the_region():
    """Eager's reentrant checkpoint records the region when ANY tensor argument requires grad:
    here `x` does and the mask does not, so the layer inside gets its gradient."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)

    def fn(x, mask):
        h = checkpoint(lambda t, m: layer(t).tanh() * m, x, mask, use_reentrant=True)
        return (h * x).sum()

    x = torch.randn(3, 4, requires_grad=True)
    mask = (torch.randn(3, 4) > 0).float()
    results = []
    for f in (fn, fulmen.jit(fn)):
        f(x, mask).backward()
        results.append([layer.weight.grad.clone(), x.grad.clone()])
        layer.zero_grad(set_to_none=True)
        x.grad = None
    torch.testing.assert_close(results[1], results[0])


def test_symbolic_sizes_choose_on_the_call_sizes_without_guards():
    """NOTE [remat on hints]: with symbolic sizes, whether a reduction is small enough to
    recompute (`MAX_RECOMPUTED_REDUCTION` elements per output) is decided at the compiled call's
    sizes, not guarded: one compilation serves lengths on both sides of the bound, with eager's
    values and gradients (it was guarded, so a longer row compiled again)."""

    def f(x):
        return (x.exp().sum(-1, keepdim=True) * x.sin()).sum()

    jfn = fulmen.jit(f, dynamic=True)
    for n in (100, MAX_RECOMPUTED_REDUCTION + 900, 3 * MAX_RECOMPUTED_REDUCTION):
        x = torch.randn(3, n, dtype=torch.float64, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        out = jfn(x)
        out.backward()
        f(x_eager).backward()
        torch.testing.assert_close(out, f(x_eager.detach()))
        torch.testing.assert_close(x.grad, x_eager.grad)
    assert fulmen.cache_misses(jfn) == 1


def test_a_small_value_built_by_many_statements_is_saved_not_rebuilt():
    # a causal mask as HF builds it: arange, index views, a comparison, `full` and `where`; the
    # backward of `x * mask` needs the mask (4 KiB): rebuilding it takes more statements than
    # saving it is worth (remat.STATEMENT_BYTES), so the forward saves it
    def fn(x):
        idx = torch.arange(32)
        allowed = (idx[None, :] <= idx[:, None]) & torch.ones((), dtype=torch.bool)
        mask = torch.where(allowed, torch.full((32, 32), 0.5), -1.0)
        return (x * mask).sin()

    split = _split(fn, (32, 32))
    saved = choose_saved(split.forward.args, split.forward.bsyms, split.forward.output[1])
    producers = {n: b.sym.name for b in split.forward.bsyms for n in b.output_names}
    assert "where" in {producers.get(p.name) for p in saved}
    jfn, x = fulmen.jit(fn), torch.randn(32, 32, requires_grad=True)
    jfn(x).sum().backward()
    expected = torch.autograd.grad(fn(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)
    assert not any(b.sym.name == "arange" for b in fulmen.last_backward_traces(jfn)[-1].bsyms)
