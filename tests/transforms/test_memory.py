"""memory_estimate: live bytes per statement, del-aware, view-aware."""

import torch

import fulmen


def f(x):
    a = x * 2  # 64 floats
    b = a.reshape(8, 8)  # a view: no new bytes
    c = torch.exp(b)
    return c.sum()


def test_timeline_counts_inputs_outputs_and_frees():
    jfn = fulmen.jit(f)
    jfn(torch.randn(64))
    traced, *_, final = fulmen.last_traces(jfn)
    kept = fulmen.memory_estimate(traced)
    freed = fulmen.memory_estimate(final)
    assert kept.timeline[0] == 64 * 4  # the input
    assert kept.peak == 64 * 4 * 3 + 4  # x, a, c and the sum; the reshape is a view
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
