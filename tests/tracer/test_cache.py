"""Caching under guards: hits do no tracing; every guarded property retraces."""


import pytest
import torch

import fulmen
from tests.spies import count_traces


def f(x, y):
    return x * y + 1


def test_same_metadata_hits_and_does_not_trace(monkeypatch):
    traced = count_traces(monkeypatch)
    jfn = fulmen.jit(f)
    jfn(torch.randn(4, 4), torch.randn(4, 4))
    jfn(torch.randn(4, 4), torch.randn(4, 4))
    assert (fulmen.cache_misses(jfn), fulmen.cache_hits(jfn)) == (1, 1)
    assert len(traced) == 1


@pytest.mark.parametrize(
    "second",
    [
        lambda: (torch.randn(8, 4), torch.randn(8, 4)),  # shape
        lambda: (torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4)),  # dtype
        lambda: (torch.randn(4, 4).t(), torch.randn(4, 4)),  # layout
        lambda: (torch.randn(4, 4), 2.0),  # tensor -> Python scalar
    ],
    ids=["shape", "dtype", "layout", "scalar"],
)
def test_changed_metadata_retraces(second):
    jfn = fulmen.jit(f)
    jfn(torch.randn(4, 4), torch.randn(4, 4))
    x, y = second()
    torch.testing.assert_close(jfn(x, y), f(x, y))
    assert fulmen.cache_misses(jfn) == 2


def test_scalar_values_are_guarded():
    jfn = fulmen.jit(f)
    x = torch.randn(3)
    torch.testing.assert_close(jfn(x, 2.0), f(x, 2.0))
    torch.testing.assert_close(jfn(x, 3.0), f(x, 3.0))
    torch.testing.assert_close(jfn(x, 2.0), f(x, 2.0))
    assert (fulmen.cache_misses(jfn), fulmen.cache_hits(jfn)) == (2, 1)


def test_requires_grad_and_grad_mode_retrace():
    jfn = fulmen.jit(f)
    x, y = torch.randn(3, requires_grad=True), torch.randn(3)
    out = jfn(x, y)
    assert out.requires_grad and fulmen.last_backward_traces(jfn)
    with torch.no_grad():
        detached = jfn(x, y)
    assert not detached.requires_grad and not fulmen.last_backward_traces(jfn)
    torch.testing.assert_close(detached, f(x, y).detach())
    jfn(x.detach(), y)  # grad mode on, nothing requires grad: another specialisation
    jfn(x, y)
    assert (fulmen.cache_misses(jfn), fulmen.cache_hits(jfn)) == (3, 1)


def test_default_dtype_is_guarded():
    def make(x):
        return x + torch.ones(3)

    jfn = fulmen.jit(make)
    x = torch.zeros(3, dtype=torch.float64)
    assert jfn(x).dtype == torch.float64
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert jfn(x).dtype == torch.float64
        assert fulmen.cache_misses(jfn) == 2
    finally:
        torch.set_default_dtype(previous)


def test_module_train_eval_retraces_and_matches():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(jmodel(x), model(x))
        model.train()
        torch.manual_seed(1)
        expected = model(x)
        torch.manual_seed(1)
        torch.testing.assert_close(jmodel(x), expected)
    assert fulmen.cache_misses(jmodel) == 2


def test_compile_stats_has_seconds_per_stage():
    jfn = fulmen.jit(f)
    jfn(torch.randn(2), torch.randn(2))
    stats = fulmen.compile_stats(jfn)
    assert {"tracing", "claiming by executors", "python compilation"} <= set(stats.stage_seconds)
    assert all(seconds >= 0 for seconds in stats.stage_seconds.values())
    assert stats.calls == 1


def test_recompile_reasons_are_explained_and_logged(caplog):
    import logging

    jfn = fulmen.jit(f)
    jfn(torch.randn(4, 4), torch.randn(4, 4))
    with caplog.at_level(logging.INFO, logger="fulmen.recompiles"):
        jfn(torch.randn(8, 4), torch.randn(8, 4))
        jfn(torch.randn(8, 4), 2.0)
    reasons = fulmen.compile_stats(jfn).recompile_reasons
    assert "x.shape changed from (4, 4) to (8, 4)" in reasons[0]
    assert any("y" in reason for reason in reasons[1])
    assert "x.shape changed from (4, 4) to (8, 4)" in caplog.text



class _Window:
    """A cache-like object: a tensor and a Python count the code reads (as HF's sliding
    window layer keeps `cumulative_length`)."""

    def __init__(self, seen: int) -> None:
        self.keys = torch.ones(2)
        self.seen = seen


def test_a_number_inside_an_object_argument_is_a_named_reason():
    def fn(x, window):
        return x * window.seen + window.keys

    jfn = fulmen.jit(fn)
    x = torch.ones(2)
    for seen in (3, 4):
        torch.testing.assert_close(jfn(x, _Window(seen)), fn(x, _Window(seen)))
    assert "window.seen changed from 3 to 4" in fulmen.compile_stats(jfn).recompile_reasons[0]

def test_module_training_flag_change_is_a_reason():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    jmodel = fulmen.jit(model)
    with torch.no_grad():
        jmodel(torch.randn(1, 2))
        model.eval()
        jmodel(torch.randn(1, 2))
    assert "model.training changed from True to False" in \
        fulmen.compile_stats(jmodel).recompile_reasons[0]


SCALE = 2.0


def test_captured_python_numbers_and_module_attributes_retrace():
    offset = 1.0

    def fn(x):
        return x * SCALE + offset

    jfn = fulmen.jit(fn)
    x = torch.ones(2)
    torch.testing.assert_close(jfn(x), fn(x))
    offset = 5.0  # noqa: F841  (read through the closure cell)
    torch.testing.assert_close(jfn(x), fn(x))
    global SCALE
    SCALE, previous = 3.0, SCALE
    try:
        torch.testing.assert_close(jfn(x), fn(x))
    finally:
        SCALE = previous
    assert fulmen.cache_misses(jfn) == 3
    assert "offset changed from 1.0 to 5.0" in fulmen.compile_stats(jfn).recompile_reasons[0]

    model = torch.nn.Dropout(0.0)
    jmodel = fulmen.jit(model)
    torch.testing.assert_close(jmodel(x), x)
    model.p = 1.0
    torch.testing.assert_close(jmodel(x), torch.zeros(2))


def test_fusion_decisions_are_logged(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="fulmen.fusion"):
        fulmen.jit(f, executors=["codegen", "torch"])(torch.randn(4, 4), torch.randn(4, 4))
    assert "codegen fuses" in caplog.text


def test_cache_size_limit_runs_further_calls_eagerly_with_one_warning():
    import warnings

    def fn(x):
        return torch.sin(x) * 2

    jfn = fulmen.jit(fn, cache_size_limit=3, dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 7):
            x = torch.randn(n)
            torch.testing.assert_close(jfn(x), fn(x))
    assert fulmen.cache_misses(jfn) == 6 and fulmen.compile_stats(jfn).eager_calls == 3
    messages = [str(w.message) for w in caught if "cache_size_limit" in str(w.message)]
    assert len(messages) == 1 and "x.shape changed" in messages[0]
    torch.testing.assert_close(jfn(torch.ones(2)), fn(torch.ones(2)))  # compiled ones still hit
    assert fulmen.cache_hits(jfn) == 1


def test_a_miss_compiles_with_the_collector_paused_and_restores_it():
    """NOTE [the collector while compiling] in fulmen/pipeline.py: the program traces with Python's
    cyclic collector off (tracing's garbage would set off full collections of the process);
    the collector's state afterwards is the caller's, also when compiling fails."""
    import gc

    seen = []

    def g(x):
        return x * 2 + 1

    def spy(trace):  # a user pass: it runs inside the miss (a store by `g` would run eagerly)
        seen.append(gc.isenabled())
        return trace

    jfn = fulmen.jit(g, transforms=[spy])
    x = torch.randn(3)
    assert gc.isenabled()
    torch.testing.assert_close(jfn(x), g(x))
    assert seen[0] is False and gc.isenabled()
    gc.disable()
    try:
        jfn(torch.randn(3, 2))  # a miss while the caller has it off: it stays off
        assert not gc.isenabled()
    finally:
        gc.enable()

    def fails(x):
        raise ValueError("user error")

    with pytest.raises(ValueError, match="user error"):
        fulmen.jit(fails)(x)
    assert gc.isenabled()


def test_a_compiles_survivors_set_off_no_full_collection_and_nothing_stays_frozen():
    """NOTE [a compile's survivors are long-lived] in fulmen/pipeline.py: what survives a
    compile (with the collector paused) is moved to the oldest generation without counting
    toward the next full collection (before: survivors of a third of the process's objects set
    one off within ~11 young collections), and nothing is left frozen, so a dropped entry is
    still collected; objects the program froze itself stay frozen."""
    import gc
    import weakref

    from fulmen.pipeline import collector_paused

    full = []

    def count(phase, info):
        if phase == "stop" and info["generation"] == 2:
            full.append(info)

    threshold = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    gc.collect()
    gc.callbacks.append(count)
    try:
        with collector_paused():
            kept = [[i] for i in range(len(gc.get_objects()) // 3)]  # a compile's survivors
        for _ in range(200_000):  # young garbage: ~28 young, ~2 middle collections
            cycle = []
            cycle.append(cycle)
        assert not full
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
    del kept
    assert gc.get_freeze_count() == 0

    def g(x):
        return x * 2 + 1

    jfn = fulmen.jit(g)
    x = torch.randn(3)
    torch.testing.assert_close(jfn(x), g(x))
    dropped = weakref.ref(next(iter(fulmen.compile_stats(jfn).cache.values())))
    del jfn
    gc.collect()
    assert dropped() is None

    gc.freeze()  # the program's own frozen objects: left as they are
    try:
        frozen = gc.get_freeze_count()
        fulmen.jit(g)(torch.randn(4))
        assert gc.get_freeze_count() > frozen // 2  # (a few freed meanwhile)
    finally:
        gc.unfreeze()


def test_the_backward_for_unused_outputs_compiles_with_the_collector_paused(monkeypatch):
    """A step that returns its logits beside the loss and calls `loss.backward()` compiles the
    backward without the logits' cotangent at that first backward, outside the miss: it too
    runs with the collector paused (NOTE [the collector while compiling]), restored after."""
    import gc

    import fulmen.pipeline as pipeline

    seen = []
    fold = pipeline.fold_unused_cotangents

    def folding(*args, **kwargs):
        seen.append(gc.isenabled())
        return fold(*args, **kwargs)

    monkeypatch.setattr(pipeline, "fold_unused_cotangents", folding)

    def step(x, w):
        logits = x @ w
        return logits.square().mean(), logits

    jfn = fulmen.jit(step)
    x, w = torch.randn(4, 3), torch.randn(3, 5, requires_grad=True)
    loss, _ = jfn(x, w)
    assert gc.isenabled()
    loss.backward()
    expected_w = w.detach().clone().requires_grad_()
    step(x, expected_w)[0].backward()
    torch.testing.assert_close(w.grad, expected_w.grad)
    assert seen == [False] and gc.isenabled()
