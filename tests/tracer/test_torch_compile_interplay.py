"""`torch.compile` and `fulmen.jit` in one program, as users mix them: a compiled module or
helper inside a jitted function is traced as its plain Python, and `torch.compile` of a jitted
module runs fulmen's compiled call between its graphs. Before, both crashed inside Dynamo
(`SeedsInside: torch.set_rng_state`, Dynamo's own state saving seen by fulmen's tracer)."""

import copy

import pytest
import torch

import fulmen
from fulmen.tracer.compiled_callees import compiled_code_runs_eagerly
from tests.fresh_process import imports_module


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))


def _same_training_call(got_model, call, want_model, x):
    want = want_model(x)
    got = call(x)
    torch.testing.assert_close(got, want)
    want.square().sum().backward()
    got.square().sum().backward()
    for p, q in zip(want_model.parameters(), got_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_jit_of_a_torch_compiled_module_traces_its_python():
    model, twin = _model(), _model()
    jmodel = fulmen.jit(torch.compile(twin))
    x = torch.randn(3, 4)
    _same_training_call(twin, jmodel, model, x)
    jmodel(x)
    stats = fulmen.compile_stats(jmodel)
    assert stats.cache_misses == 1 and stats.eager_calls == 0
    assert "linear" in str(fulmen.last_traces(jmodel)[0])
    assert torch._dynamo.eval_frame._stance.stance == "default"  # put back after the trace


def test_a_torch_compiled_helper_inside_a_jitted_function():
    helper = torch.compile(lambda x: torch.nn.functional.silu(x) * 3)

    def f(x, w):
        return helper(x @ w).sum(-1)

    x, w = torch.randn(3, 4), torch.randn(4, 5, requires_grad=True)
    want = f(x, w)
    (gw_want,) = torch.autograd.grad(want.sum(), w)
    jf = fulmen.jit(f)
    got = jf(x, w)
    (gw_got,) = torch.autograd.grad(got.sum(), w)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gw_got, gw_want)
    assert fulmen.compile_stats(jf).eager_calls == 0


def test_torch_compile_of_a_jitted_module_runs_fulmens_call():
    model, twin = _model(), _model()
    jmodel = fulmen.jit(twin)
    compiled = torch.compile(jmodel, backend="eager")
    x = torch.randn(3, 4)
    _same_training_call(twin, compiled, model, x)
    compiled(x)
    stats = fulmen.compile_stats(jmodel)
    assert stats.calls == 2 and stats.cache_misses == 1  # fulmen ran both calls
    jf = fulmen.jit(lambda x: x.sin() * 2)
    outer = torch.compile(lambda x: jf(x + 1) - 1, backend="eager")
    torch.testing.assert_close(outer(x), (x + 1).sin() * 2 - 1)
    assert fulmen.compile_stats(jf).calls == 1


def test_the_stance_is_put_back_after_an_error_and_nested_traces():
    import torch._dynamo  # noqa: F401 - the stance is set only once Dynamo is imported
    with pytest.raises(RuntimeError, match="boom"):
        with compiled_code_runs_eagerly():
            with compiled_code_runs_eagerly():
                assert torch._dynamo.eval_frame._stance.stance == "force_eager"
            assert torch._dynamo.eval_frame._stance.stance == "force_eager"
            raise RuntimeError("boom")
    assert torch._dynamo.eval_frame._stance.stance == "default"
    model = copy.deepcopy(_model())
    with torch.compiler.set_stance("eager_on_recompile"):  # a user's own stance survives
        fulmen.jit(model)(torch.randn(2, 4))
        assert torch._dynamo.eval_frame._stance.stance == "eager_on_recompile"


def test_tracing_without_torch_compile_does_not_import_dynamo():
    """Importing Dynamo costs about a second: a process that never called torch.compile does
    not pay it for fulmen's guard against compiled callees."""
    assert not imports_module("import torch, fulmen\n"
                              "f = fulmen.jit(lambda x: x.sin() * 2)\n"
                              "torch.testing.assert_close(f(torch.ones(3)), torch.ones(3).sin() * 2)")
