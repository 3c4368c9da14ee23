"""memory_estimate: live bytes per statement, del-aware, view-aware."""

import torch

import fulmen


def f(x):
    a = x * 2  # 64 floats
    b = a.view(8, 8)  # a view: no new bytes
    c = torch.exp(b)
    return c.sum()


def test_timeline_counts_inputs_outputs_and_frees():
    jfn = fulmen.jit(f)
    jfn(torch.randn(64))
    traced, *_, final = fulmen.last_traces(jfn)
    kept = fulmen.memory_estimate(traced)
    freed = fulmen.memory_estimate(final)
    assert kept.timeline[0] == 64 * 4  # the input
    assert kept.peak == 64 * 4 * 3 + 4  # x, a, c and the sum; the view is free
    assert freed.peak < kept.peak  # `del` frees each tensor after its last use
    assert freed.timeline[-1] == 4  # only the output is left


def test_plot_memory_draws_one_line_per_trace():
    import matplotlib

    matplotlib.use("Agg")
    jfn = fulmen.jit(f)
    jfn(torch.randn(64))
    traces = fulmen.last_traces(jfn)
    ax = fulmen.plot_memory(traces[0], traces[-1], labels=["traced", "final"])
    assert len(ax.get_lines()) == 2


def mutate_through_view(x):
    y = x * 2  # f32[16, 16]: 1024 bytes
    row = y[0]  # a view of y: no new bytes
    row.add_(1)  # f32[16]: 64 bytes, then view_scatter writes them into a copy of y: 1024
    return y.sum()  # f32[]: 4 bytes


def test_memory_estimate_of_a_mutation_through_a_view():
    """Snapshot: the statements and live bytes after each, computed by hand from the comments of
    `mutate_through_view`. The view (`getitem`) costs nothing (the name-matching estimate before
    `Tag.VIEW` charged it 64 bytes, not knowing `ltorch.getitem`), and `view_scatter`, which
    copies its base, costs the base's 1024 bytes (that estimate charged it nothing: its name
    holds `.view`)."""
    jfn = fulmen.jit(mutate_through_view, executors=["torch"])
    jfn(torch.randn(16, 16))
    traced, *_, final = fulmen.last_traces(jfn)
    kept = fulmen.memory_estimate(traced)
    assert list(zip(kept.statements, kept.timeline)) == [
        ("(inputs)", 1024),  # x
        ("ltorch.mul", 1024 + 1024),  # y
        ("ltorch.getitem", 2048),  # row: a view of y
        ("ltorch.add", 2048 + 64),  # row + 1
        ("functionalized.view_scatter", 2112 + 1024),  # the new y: a copy
        ("ltorch.sum", 3136 + 4),
    ]
    assert kept.peak == 3140
    freed = fulmen.memory_estimate(final)
    assert list(zip(freed.statements, freed.timeline)) == [
        ("(inputs)", 1024),
        ("torch.mul", 2048),
        ("del", 1024),  # x
        ("torch.Tensor.__getitem__", 1024),  # row: a view
        ("torch.add", 1024 + 64),
        ("del", 1088),  # row: a view, frees nothing
        ("torchex.view_scatter", 1088 + 1024),
        ("del", 1024),  # the old y (1024) and row + 1 (64)
        ("torch.sum", 1024 + 4),
        ("del", 4),  # the new y
    ]
    assert freed.peak == 2112


def test_a_view_run_by_an_executor_costs_nothing():
    """An executor's implementation of a view op is a view too (the torch executor's `view`,
    registered with `register_implementation(..., fn=...)`): the execution trace's estimate
    charges it nothing, as the traced one does."""
    jfn = fulmen.jit(f, executors=["torch"])
    jfn(torch.randn(64))
    final = fulmen.last_traces(jfn)[-1]
    estimate = fulmen.memory_estimate(final)
    views = [i for i, bsym in enumerate(final.bsyms, 1) if bsym.sym.name == "view"]
    assert views
    for i in views:
        assert estimate.timeline[i] == estimate.timeline[i - 1]
