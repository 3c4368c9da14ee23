"""fulmen.verify finds the stage and the statement that diverge, and writes a working repro."""

import subprocess
import sys

import pytest
import torch

import fulmen
from fulmen.extend import OperatorExecutor
from fulmen.ops import prims


def f(x, y):
    return torch.sin(x) * y + 1


def test_verify_passes_on_a_correct_program():
    report = fulmen.verify(f, torch.randn(4), torch.randn(4))
    assert report.ok, str(report)
    assert "all stages agree" in str(report)


def test_verify_names_stage_and_op_of_a_planted_bug(tmp_path):
    bad = OperatorExecutor("planted")
    op = bad.register_operator("wrong_sin", like=torch.sin, fn=torch.cos)
    bad.register_implementation(torch.sin, op)
    x, y = torch.randn(4), torch.randn(4)
    report = fulmen.verify(f, x, y, executors=[bad, "torch"], repro_dir=str(tmp_path))
    text = str(report)
    assert not report.ok
    assert "claiming by executors" in report.first_bad_stage
    assert "sin" in report.culprit_op and "torch.cos(x)" in report.culprit, text
    result = subprocess.run([sys.executable, report.repro_path], capture_output=True, text=True)
    assert result.returncode == 1, result.stdout + result.stderr  # reproduces on its own
    assert "max |region - reference|" in result.stdout


def test_verify_checks_backward_stages():
    x = torch.randn(3, requires_grad=True)
    report = fulmen.verify(lambda t: (t.exp() * t).sum(), x)
    assert report.ok, str(report)
    assert any(check.stage.startswith("backward") for check in report.stages)


_WEIGHT = torch.randn(4, 4)


def _breaks(x):
    y = x @ _WEIGHT  # a captured global
    if y.sum() > 0:  # a graph break: the program is a tree of segments
        return torch.sin(y)
    return torch.sin(-y)


def test_verify_a_program_with_a_graph_break_and_a_captured_tensor():
    x = torch.randn(3, 4, requires_grad=True)
    report = fulmen.verify(_breaks, x)
    assert report.ok, str(report)
    assert any(check.stage.startswith("compiled segments") for check in report.stages)
    bad = OperatorExecutor("planted_in_segment")
    op = bad.register_operator("wrong_sin", like=torch.sin, fn=torch.cos)
    bad.register_implementation(torch.sin, op)
    report = fulmen.verify(_breaks, x.detach(), executors=[bad, "torch"])
    assert not report.ok and report.first_bad_stage.startswith("compiled segments"), str(report)
    bad_grad = OperatorExecutor("planted_grad_in_segment")
    op = bad_grad.register_operator("wrong_neg", like=prims.neg, fn=lambda a: a)
    bad_grad.register_implementation(prims.neg, op)
    report = fulmen.verify(lambda t: _breaks(t.exp() - t), x, executors=[bad_grad, "torch"])
    assert not report.ok, str(report)
    assert report.first_bad_stage == "backward: compiled segments (graph breaks)", str(report)


def test_verify_finds_a_wrong_op_used_only_by_the_backward():
    bad = OperatorExecutor("planted_grad")
    op = bad.register_operator("wrong_neg", like=prims.neg, fn=lambda a: a)
    bad.register_implementation(prims.neg, op)
    x = torch.randn(3, requires_grad=True)
    # sub's VJP negates the cotangent: only the backward trace contains a neg
    report = fulmen.verify(lambda t: (t.exp() - t).sum(), x, executors=[bad, "torch"])
    assert not report.ok and report.first_bad_stage.startswith("backward"), str(report)
    assert "neg" in report.culprit_op


def test_repro_of_a_codegen_fusion_runs_on_its_own(tmp_path, monkeypatch, codegen_eager):
    from fulmen.executors.codegen import codegen_ex

    fuse = codegen_ex.fuse

    def planted(region, outputs):  # a kernel that is 1% off, in this process only
        bsym = fuse(region, outputs)
        if bsym is not None:
            impl = bsym.sym.impl
            bsym.sym.impl = lambda *args: impl(*args) * 1.01
        return bsym

    monkeypatch.setattr(codegen_ex, "fuse", planted)

    def g(x, y):
        return (torch.sin(x) * y + x.exp() * 0.1).softmax(-1) * 3

    x, y = torch.randn(8, 16), torch.randn(8, 16)
    report = fulmen.verify(g, x, y, executors=["codegen", "torch"], repro_dir=str(tmp_path))
    assert not report.ok and "fusion" in report.culprit_op, str(report)
    result = subprocess.run([sys.executable, report.repro_path], capture_output=True, text=True)
    # a fresh process fuses the region again (the real kernel) and compares it with its prims
    assert result.returncode == 0, result.stdout + result.stderr
    assert "max |region - reference|" in result.stdout


def _one_ulp_up(t):
    return t.view(torch.int16).add(1).view(torch.bfloat16)


def test_one_ulp_bfloat16_is_not_a_divergence():
    ulp = OperatorExecutor("one_ulp")
    op = ulp.register_operator("sin_one_ulp_up", like=torch.sin,
                               fn=lambda a: _one_ulp_up(torch.sin(a)))
    ulp.register_implementation(torch.sin, op)
    x, y = torch.randn(64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    report = fulmen.verify(lambda a: torch.sin(a) * 2, x, executors=[ulp, "torch"])
    assert report.ok and report.stages[-1].max_error > 0, str(report)
    # also with tolerances given for float32: never tighter than the dtype's ulp
    report = fulmen.verify(lambda a: torch.sin(a) * 2, x, executors=[ulp, "torch"], rtol=1e-6,
                           atol=0.0)
    assert report.ok, str(report)
    # but a real error in bfloat16 is one
    wrong = OperatorExecutor("wrong_bf16")
    op = wrong.register_operator("sin_off", like=torch.sin, fn=lambda a: torch.sin(a) + 0.1)
    wrong.register_implementation(torch.sin, op)
    assert not fulmen.verify(f, x, y, executors=[wrong, "torch"]).ok


def test_bfloat16_rounding_that_grows_is_judged_against_float64(codegen_eager):
    def g(x, w):  # layer norm's backward cancels: eager and fulmen round differently
        h = torch.nn.functional.gelu(x @ w)
        return torch.nn.functional.layer_norm(h, (h.shape[-1],)).softmax(-1)

    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    report = fulmen.verify(g, x, w, executors=["codegen", "torch"])
    assert report.ok, str(report)
    assert any(check.stage.startswith("backward") and check.max_error > 0
               for check in report.stages)


def test_repro_with_opaque_ops_runs_on_its_own(tmp_path):
    def h(x):
        return torch.ops.aten.gelu.default(x) * 2  # an opaque op (an OpOverload)

    bad = OperatorExecutor("planted_opaque")
    op = bad.register_operator("wrong_gelu", like=torch.ops.aten.gelu.default,
                               fn=torch.ops.aten.silu.default)
    bad.register_implementation(torch.ops.aten.gelu.default, op)
    report = fulmen.verify(h, torch.randn(4), executors=[bad, "torch"], repro_dir=str(tmp_path))
    assert not report.ok
    result = subprocess.run([sys.executable, report.repro_path], capture_output=True, text=True)
    assert result.returncode == 1, result.stdout + result.stderr  # reproduces in a new process
    assert "torch.ops.aten.gelu.default(x)" in open(report.repro_path).read()


def _program(x, w):
    h = torch.relu(x @ w)
    g = torch.tanh(h) * 2 + h.sin()
    return (g.softmax(-1) * x.sum()).mean(0), h.exp()


def _planted_tanh(name):
    from fulmen.executors import register_executor

    bad = OperatorExecutor(name)
    op = bad.register_operator("tanh_one_percent_off", like=torch.tanh,
                               fn=lambda a: torch.tanh(a) * 1.01)
    bad.register_implementation(torch.tanh, op)
    register_executor(bad)  # by name, so the written script finds it in this process
    return bad


def test_minimizer_shrinks_to_the_wrong_statement_and_keeps_the_failure(tmp_path):
    import runpy

    from fulmen.tools.minimize import failure_of, minimize_program, write_script

    _planted_tanh("planted_minimize")
    x, w = torch.randn(4, 5, requires_grad=True), torch.randn(5, 5, requires_grad=True)
    executors = ["planted_minimize", "torch"]
    failure = failure_of(_program, [x, w], executors=executors)
    assert failure is not None and failure.kind == "value: output", failure
    small = minimize_program(_program, x, w, executors=executors)
    assert small.failure.kind == failure.kind
    statements = [b.sym.name for b in small.trace.bsyms]
    assert statements == ["tanh"], small.trace  # from 9 statements to the culprit
    path = write_script(small, str(tmp_path / "repro.py"))
    with pytest.raises(SystemExit) as exit_status:  # the script reproduces it
        runpy.run_path(path, run_name="__main__")
    assert exit_status.value.code == 1
    assert failure_of(_program, [x, w], executors=["torch"]) is None  # a correct one passes


def test_verify_minimize_writes_a_script_and_names_the_pass(tmp_path):
    import subprocess

    _planted_tanh("planted_verify_minimize")
    x, w = torch.randn(4, 5), torch.randn(5, 5)
    report = fulmen.verify(_program, x, w, executors=["planted_verify_minimize", "torch"],
                           minimize=True, repro_dir=str(tmp_path))
    assert not report.ok and report.minimized_path, str(report)
    assert "value: output" in report.minimized_failure
    inner = report.minimized_report
    assert inner is not None and not inner.ok and "tanh" in inner.culprit_op, str(report)
    assert "claiming by executors" in inner.first_bad_stage
    # a fresh process has no such executor: the script runs and says so (exit 0, no failure)
    result = subprocess.run([sys.executable, report.minimized_path], capture_output=True,
                            text=True)
    assert "planted_verify_minimize" in result.stdout + result.stderr


def test_cross_executor_check_compares_two_compiled_runs():
    from fulmen.tools.minimize import failure_of

    _planted_tanh("planted_cross")
    x, w = torch.randn(4, 5), torch.randn(5, 5)
    assert failure_of(_program, [x, w], executors=["codegen", "torch"], against=["torch"]) \
        is None
    failure = failure_of(_program, [x, w], executors=["planted_cross", "torch"],
                         against=["codegen", "torch"])
    assert failure is not None and failure.kind == "value: output"
