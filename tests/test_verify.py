"""fulmen.verify finds the stage and the statement that diverge, and writes a working repro."""

import subprocess
import sys

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


def test_verify_finds_a_wrong_op_used_only_by_the_backward():
    bad = OperatorExecutor("planted_grad")
    op = bad.register_operator("wrong_neg", like=prims.neg, fn=lambda a: a)
    bad.register_implementation(prims.neg, op)
    x = torch.randn(3, requires_grad=True)
    # sub's VJP negates the cotangent: only the backward trace contains a neg
    report = fulmen.verify(lambda t: (t.exp() - t).sum(), x, executors=[bad, "torch"])
    assert not report.ok and report.first_bad_stage.startswith("backward"), str(report)
    assert "neg" in report.culprit_op
