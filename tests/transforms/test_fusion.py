"""The fusion partitioner (with the codegen executor): regions, no cycles, printed traces,
and the fallback when kernels cannot be compiled."""

import re
import warnings

import pytest
import torch

import fulmen
from fulmen.core import check_trace
from fulmen.executors.codegen import codegen_ex
from fulmen.executors.codegen.cpu import compiler as cg_build
from fulmen.transforms.fusion import _defined_before_use, partition_for_fusion

EXECUTORS = ["codegen", "torch"]
pytestmark = pytest.mark.usefixtures("codegen_eager")


def _normalise(source: str) -> str:
    source = re.sub(r"fusion\d+", "fusionN", source)
    source = re.sub(r"# \S+\.py:\d+ ", "# <src> ", source)
    return source.split("\n", 1)[1]  # drop the header (timings)


def test_no_cycle_through_unfusible_op():
    # exp -> matmul -> add also reads exp's output: merging exp with add would make a cycle
    # through the matmul, so exp and (add, sin) must be two regions around it.
    def fn(x, w):
        t = x.exp()
        m = t @ w
        return (t + m).sin()

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    torch.testing.assert_close(jfn(x, w), fn(x, w))
    trace = fulmen.last_traces(jfn)[-1]
    check_trace(trace)
    calls = [b.sym.name for b in trace.bsyms if b.sym.python_name != "del"]
    assert len(calls) == 3 and calls[0].startswith("fusion") and calls[2].startswith("fusion")
    assert "matmul" in calls[1]
    fused = [b for b in trace.bsyms if "fusion" in b.sym.tags]
    assert [s.sym.name for s in fused[0].subsymbols] == ["exp"]
    assert [s.sym.name for s in fused[1].subsymbols] == ["add", "sin"]


def test_op_restored_whole_keeps_its_shape_only_input():
    # expand_as's prims never read `y`; left unfused, the op is restored whole and reads it,
    # so the region producing `y` must come first (HF HRM: `z_init.expand_as(hidden)`)
    def fn(x, w):
        y = x * 2
        z = torch.cumsum(w.expand_as(y), -1)
        return z + y

    x, w = torch.randn(2, 3, 4), torch.randn(1, 3, 4)
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    torch.testing.assert_close(jfn(x, w), fn(x, w))
    check_trace(fulmen.last_traces(jfn)[-1])


@pytest.mark.parametrize("producer", ["matmul", "scale"])
def test_cross_entropy_splits_only_to_fuse_with_its_producer(producer):
    """cross_entropy = log_softmax (a fusible reduction) + a gather: flattened, the log_softmax
    fuses with an elementwise producer of the logits; after a matmul it would only leave its
    rest as small torch statements, so it runs whole."""
    target = torch.randint(0, 300, (64,))
    target[5] = -100

    def fn(x, w):
        logits = x @ w
        if producer == "scale":
            logits = logits * 0.5
        return torch.nn.functional.cross_entropy(logits, target)

    x, w = torch.randn(64, 8), torch.randn(8, 300)  # not a tiny region
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    torch.testing.assert_close(jfn(x, w), fn(x, w))
    calls = [bsym.sym.python_name for bsym in fulmen.last_traces(jfn)[-1].bsyms]
    assert ("torch.nn.functional.cross_entropy" in calls) == (producer == "matmul")
    assert any(call.startswith("codegen.fusion") for call in calls) == (producer == "scale")


def test_partitioner_is_pure_and_merges_siblings():
    def fn(x, y):
        return x.exp() * 2, (x + y).cos()  # independent siblings sharing x

    x, y = torch.randn(5), torch.randn(5)
    jfn = fulmen.jit(fn, executors=["torch"])
    jfn(x, y)
    trace = fulmen.last_traces(jfn)[0]
    before = str(trace)
    fused = partition_for_fusion(trace, codegen_ex)
    assert str(trace) == before  # the input trace is untouched
    check_trace(fused)
    regions = [b for b in fused.bsyms if "fusion" in b.sym.tags]
    assert len(regions) == 1 and len(regions[0].subsymbols) == 4
    assert isinstance(regions[0].output, tuple) and len(regions[0].output) == 2


def test_region_never_crosses_random_or_opaque_ops():
    def fn(x):
        r = torch.rand_like(x)
        return (x * r).exp() + x.cumsum(0).sin()

    jfn = fulmen.jit(fn, executors=EXECUTORS)
    x = torch.randn(6)
    torch.manual_seed(1)
    expected = fn(x)
    torch.manual_seed(1)
    torch.testing.assert_close(jfn(x), expected)
    trace = fulmen.last_traces(jfn)[-1]
    for bsym in trace.bsyms:
        if "fusion" in bsym.sym.tags:
            names = {s.sym.name for s in bsym.subsymbols}
            assert not names & {"uniform", "rand_like", "cumsum"}


SNAPSHOT = '''\
import torch
from fulmen.extend import get_executor
from fulmen.ops import prims
codegen = get_executor('codegen')

def computation(x, b):
  # x: "cpu f32[2, 3]"
  # b: "cpu f32[3]"

  # <src>  return torch.relu(x * b + 1).sum(1)
  t7 = codegen.fusionN(b, x)  # t7: "cpu f32[2]"
    # t0 = prims.broadcast_in_dim(b, (2, 3), (1,))
    # t1 = prims.mul(x, t0)
    # t2 = prims.add(t1, 1)
    # t3 = prims.le(t2, 0)
    # t4 = prims.maximum(t2, 0)
    # t5 = prims.mul(t4, 0)
    # t6 = prims.where(t3, t5, t2)
    # t7 = prims.sum(t6, (1,))
  del b, x
  return t7
'''


def test_printed_fused_trace_snapshot():
    def fn(x, b):
        return torch.relu(x * b + 1).sum(1)

    x, b = torch.randn(2, 3), torch.randn(3)
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    torch.testing.assert_close(jfn(x, b), fn(x, b))
    final = fulmen.last_traces(jfn)[-1]
    assert _normalise(str(final)) == SNAPSHOT
    # the printed execution trace runs on its own
    torch.testing.assert_close(final.python_callable()(x, b), fn(x, b))


def test_compile_failure_falls_back_to_torch_with_one_warning(monkeypatch):
    monkeypatch.setattr(cg_build, "compiler", lambda: None)

    def fn(x):
        return (x * 3.25).tanh() - 0.125

    jfn = fulmen.jit(fn, executors=EXECUTORS)
    x = torch.randn(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = jfn(x), jfn(x + 1)
    torch.testing.assert_close(first, fn(x))
    torch.testing.assert_close(second, fn(x + 1))
    messages = [str(w.message) for w in caught if "fulmen codegen" in str(w.message)]
    assert len(messages) == 1 and "no C++ compiler" in messages[0]


def test_compiler_error_falls_back(monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails

    def fn(x):
        return (x - 0.375).abs() * 5.5

    jfn = fulmen.jit(fn, executors=EXECUTORS)
    x = torch.randn(9)
    with pytest.warns(RuntimeWarning, match="fulmen codegen"):
        torch.testing.assert_close(jfn(x), fn(x))


def assert_pointwise_check_agrees_with_lowering(fn, *args, skip=()) -> None:
    """`fits_pointwise` (the partitioner's fast check) answers as codegen's `lower` does for
    every contiguous run of the prim statements of `fn(*args)` (statements of prims named in
    `skip` left out), and both answers occur more than 10 times."""
    from fulmen.executors.codegen.lower import Unsupported, fits_pointwise, lower
    from fulmen.transforms import decompose_to_prims

    jfn = fulmen.jit(fn, executors=["torch"], transforms=[decompose_to_prims])
    jfn(*args)
    bsyms = [b for b in fulmen.last_traces(jfn)[1].bsyms if b.sym.is_prim and b.output is not None
             and b.sym.name not in skip]
    outcomes = []
    for start in range(len(bsyms)):
        for end in range(start + 1, len(bsyms) + 1):
            region = bsyms[start:end]
            try:
                lower(region, [], check_only=True)
                expected = True
            except Unsupported:
                expected = False
            assert fits_pointwise(region) == expected, [b.sym.name for b in region]
            outcomes.append(expected)
    assert outcomes.count(True) > 10 and outcomes.count(False) > 10


def _views_of_computed_values(x, b):
    y = (x + b).t() * 2  # a view of a computed value
    z = x.t().exp() + y  # a view of an input
    return z.sum(0) + b, z[1:] * 3  # another shape; a slice of a computed value


def test_fast_pointwise_check_agrees_with_lowering():
    assert_pointwise_check_agrees_with_lowering(
        _views_of_computed_values, torch.randn(4, 4), torch.randn(4), skip=("sum",))


def _fused_regions(jfn) -> list[list[str]]:
    trace = fulmen.last_traces(jfn)[-1]
    return [[s.sym.name for s in b.subsymbols] for b in trace.bsyms if "fusion" in b.sym.tags]


def test_tiny_cpu_regions_stay_on_torch(monkeypatch):
    # TINY_REGION: up to 4 torch ops on at most 16384 elements run faster as torch ops
    # than as one region call; larger tensors or longer chains are fused
    from fulmen.transforms.region_size import TINY_REGION

    monkeypatch.delenv("FULMEN_FUSE_TINY")
    max_ops, max_numel = TINY_REGION

    def short(x, y):
        return torch.relu(x * y + 1.0)  # 3 torch ops

    def long(x, y):
        for _ in range(max_ops):
            x = (x + y).relu()
        return x  # 2 * max_ops torch ops

    small, big = torch.randn(4, 16), torch.randn(max_numel + 1)
    for fn, x, fused in ((short, small, False), (short, big, True), (long, small, True)):
        jfn = fulmen.jit(fn, executors=EXECUTORS)
        torch.testing.assert_close(jfn(x, x), fn(x, x))
        assert bool(_fused_regions(jfn)) == fused, (fn.__name__, x.shape)
    monkeypatch.setenv("FULMEN_FUSE_TINY", "1")
    jfn = fulmen.jit(short, executors=EXECUTORS)
    jfn(small, small)
    assert len(_fused_regions(jfn)) == 1  # FULMEN_FUSE_TINY=1 fuses it anyway


def test_tiny_policy_with_symbolic_sizes_adds_no_guard(monkeypatch):
    # a region of symbolic sizes is tiny when it is at the traced sizes; deciding so adds no
    # guard, so one compilation serves small and large calls alike (results equal eager)
    from fulmen.transforms.region_size import TINY_REGION

    monkeypatch.delenv("FULMEN_FUSE_TINY")
    fn = lambda x, y: torch.relu(x * y + 1.0)  # noqa: E731
    for first, fused in ((4, False), (TINY_REGION[1] + 5, True)):
        jfn = fulmen.jit(fn, executors=EXECUTORS, dynamic=True)
        for n in (first, 7, TINY_REGION[1] * 3, 2):
            x = torch.randn(n)
            torch.testing.assert_close(jfn(x, x), fn(x, x))
        assert bool(_fused_regions(jfn)) == fused
        assert fulmen.cache_misses(jfn) == 1


def test_statements_reordered_for_their_inputs_keep_the_order_of_draws():
    """`_defined_before_use` (after an op is restored whole) moves a statement after its
    producers; a draw moved so must not pass a later draw (NOTE [fusion keeps the order of
    draws]): the generator would hand each its neighbour's numbers."""

    def draws(x):
        doubled = x * 2
        return torch.rand_like(doubled) + torch.rand(3)

    jfn = fulmen.jit(draws)
    jfn(torch.ones(3))
    mul, rand_like, rand, add = fulmen.last_traces(jfn)[0].bsyms
    order = [bsym.sym.name for bsym in _defined_before_use([rand_like, rand, mul, add])]
    assert order == ["mul", "rand_like", "rand", "add"]


def _rotary_like(q, k, c):
    c2 = (c * 2).reshape(1, 1, 8, 4)  # broadcast against both: as HF Llama's cos and sin
    return (q * c2).sin(), (k.transpose(1, 2) * c2).cos()


def test_a_broadcast_read_by_another_region_is_not_written_at_full_size():
    """NOTE [a broadcast joins its consumers]: the key's kernel broadcasts the (1, 1, 8, 4)
    tensor itself; the query's kernel used to write it out as a (2, 2, 8, 4) copy."""
    q, k, c = torch.randn(2, 4, 8, 4), torch.randn(2, 8, 2, 4), torch.randn(8, 4)
    jfn = fulmen.jit(_rotary_like, executors=EXECUTORS)
    for actual, expected in zip(jfn(q, k, c), _rotary_like(q, k, c)):
        torch.testing.assert_close(actual, expected)
    trace = fulmen.last_traces(jfn)[-1]
    fused = [b for b in trace.bsyms if b.sym.name.startswith("fusion")]
    read = {p.name for b in fused for p in b.proxy_inputs}
    between = [p for b in fused for p in b.proxy_outputs if p.name in read]
    assert between and all(p.numel() <= 8 * 4 for p in between), between


def test_partition_reach_is_the_descendants_of_each_region_after_merges(monkeypatch):
    # the cycle check reads each region's descendants as bits that every merge updates for
    # the regions reaching the merged pair (`_Partition._contract`); a stale bit lets a later
    # merge close a cycle. Checked after every merge against a search of the region graph, on
    # a trace where merges join siblings and consumers of two regions around matmuls: `k` and
    # `g` merge as readers of `y`, after which `p` (reaching `k` through a matmul only) reaches
    # the matmul of `g`.
    import networkx as nx

    from fulmen.transforms import fusion

    def fn(x, y, w):
        p = x.exp()
        k, g = (p @ w) + y, y.sin()
        a, b = k.cos(), k.tanh()
        m = (a * b) @ w
        return (m + a).relu() + (m - b).sigmoid(), g @ w, (p + 1).abs()

    checked = []
    contract = fusion._Partition._contract

    def checked_contract(self, keep, gone):
        contract(self, keep, gone)
        graph = nx.DiGraph()
        graph.add_nodes_from(self.succ)
        graph.add_edges_from((r, s) for r, nexts in self.succ.items() for s in nexts)
        for region in self.succ:
            bits = {r for r in self.succ if self.reach[region] >> r & 1}
            assert bits == nx.descendants(graph, region), region
        checked.append((keep, gone))

    monkeypatch.setattr(fusion._Partition, "_contract", checked_contract)
    x, y, w = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    jfn = fulmen.jit(fn, executors=["torch"])
    jfn(x, y, w)
    fused = partition_for_fusion(fulmen.last_traces(jfn)[0], codegen_ex)
    check_trace(fused)
    assert len(checked) >= 8  # the merges happened (the check is not vacuous)
