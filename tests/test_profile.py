"""fulmen.profile: a row per statement of the execution traces, totals that add up (no timing
asserts), and the jitted function left as it was."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.tools.profile import CATEGORIES, _compiled_functions


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _statement_lines(trace) -> list[str]:
    lines = []
    for line in trace.source().splitlines():
        code = line.strip()
        if line.startswith("  ") and not line.startswith("   ") and code \
                and not code.startswith(("#", "return")):
            lines.append(code.split("  # ")[0])
    return lines


def test_profile_training_step_has_every_statement_and_adds_up():
    torch.manual_seed(0)
    jmodel = fulmen.jit(Net())
    x = torch.randn(8, 16)
    prof = fulmen.profile(jmodel, x, steps=3, warmup=2)

    forward = fulmen.last_traces(jmodel)[-1]
    backward = fulmen.last_backward_traces(jmodel)[-1]
    by_phase = {"forward": _statement_lines(forward), "backward": _statement_lines(backward)}
    for phase, lines in by_phase.items():
        rows = sorted(row.statement for row in prof.rows if row.phase == phase)
        assert rows == sorted(lines), phase
    assert {row.category for row in prof.rows} <= set(CATEGORIES) - {"host overhead"}
    assert any(row.category == "matmul" for row in prof.rows)
    assert any(row.category == "free (del)" for row in prof.rows)
    assert all(row.seconds >= 0 for row in prof.rows)
    assert [row.seconds for row in prof.rows] == sorted((r.seconds for r in prof.rows),
                                                        reverse=True)

    assert set(prof.totals) == set(CATEGORIES)
    assert abs(sum(prof.totals.values()) - prof.step_seconds) <= 1e-9 + 1e-6 * prof.step_seconds
    statements = sum(row.seconds for row in prof.rows)
    assert abs(statements + prof.totals["host overhead"] - prof.step_seconds) < 1e-9
    assert abs(sum(row.share for row in prof.rows) - statements / prof.step_seconds) < 1e-6

    assert any("test_profile.py" in row.source for row in prof.rows)
    by_source = prof.by_source(limit=None)
    assert "x + self.down(F.gelu(self.up(self.norm(x))))" in by_source
    table = str(prof)
    assert "| fused kernel |" in table and "| host overhead |" in table
    assert "backward" in table and "forward" in table

    # the compiled functions run their own code again, and still agree with eager
    expected = Net()
    expected.load_state_dict(jmodel.state_dict())
    torch.testing.assert_close(jmodel(x), expected(x))
    compiled = _compiled_functions(jmodel._jit)
    assert len(compiled) == 2
    assert all("_fulmen_clock" not in fn.__code__.co_names for fn in compiled)


def test_profile_inference_and_fused_kernels():
    def fn(x, y):
        return torch.tanh(x * y + 1).sum(dim=1) * 2

    jfn = fulmen.jit(fn)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        prof = fulmen.profile(jfn, x, y, steps=2, warmup=3)
    assert prof.rows and all(row.phase == "forward" for row in prof.rows)
    assert any(row.category == "fused kernel" for row in prof.rows)
    assert prof.plain_step_seconds > 0


def test_profile_lists_only_what_the_call_runs():
    jfn = fulmen.jit(lambda x: (x * 2).sin() + x.cos())
    jfn(torch.randn(3))  # another specialisation, compiled but not run by the profiled call
    prof = fulmen.profile(jfn, torch.randn(5, 2), steps=2, warmup=1)
    trace = fulmen.last_traces(jfn)[-1]
    assert sorted(row.statement for row in prof.rows) == sorted(_statement_lines(trace))


def test_profile_of_a_whole_training_step_with_its_loss_and_optimizer():
    torch.manual_seed(0)
    jmodel = fulmen.jit(Net())
    optimizer = torch.optim.SGD(jmodel.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    calls = []

    def train_step():
        calls.append(1)
        optimizer.zero_grad()
        F.mse_loss(jmodel(x), y).backward()  # the loss and the optimizer run outside the traces
        optimizer.step()

    before = jmodel.up.weight.detach().clone()
    prof = fulmen.profile(jmodel, step=train_step, steps=2, warmup=1)
    assert len(calls) == 1 + 1 + 2 * 2  # warm-up, the step after the kernels, plain + timed
    assert not torch.equal(before, jmodel.up.weight)  # the optimizer stepped
    forward = fulmen.last_traces(jmodel)[-1]
    backward = fulmen.last_backward_traces(jmodel)[-1]
    for phase, trace in (("forward", forward), ("backward", backward)):
        rows = sorted(row.statement for row in prof.rows if row.phase == phase)
        assert rows == sorted(_statement_lines(trace)), phase
    assert prof.clock == "wall" and "wall time" in str(prof)
    assert abs(sum(prof.totals.values()) - prof.step_seconds) <= 1e-9 + 1e-6 * prof.step_seconds
    assert all("_fulmen_clock" not in fn.__code__.co_names
               for fn in _compiled_functions(jmodel._jit))


def test_profile_in_cpu_time_leaves_out_waiting():
    import time

    jfn = fulmen.jit(lambda x: (x * 2).sin() + x.cos())
    x = torch.randn(4, 4)

    def step():
        jfn(x)
        time.sleep(0.05)  # waiting: wall time, not CPU time

    wall = fulmen.profile(jfn, step=step, steps=1, warmup=1)
    cpu = fulmen.profile(jfn, step=step, steps=1, warmup=1, clock="cpu")
    assert wall.step_seconds >= 0.05 and wall.totals["host overhead"] >= 0.05
    assert cpu.step_seconds < 0.05 and cpu.clock == "cpu" and "CPU time" in cpu.table()
    assert sorted(row.statement for row in cpu.rows) == sorted(row.statement for row in wall.rows)
    assert cpu.rows and all(row.seconds >= 0 for row in cpu.rows)


def test_profile_arguments_are_checked():
    jfn = fulmen.jit(lambda x: x + 1)
    x = torch.randn(3)
    with pytest.raises(ValueError, match="clock"):
        fulmen.profile(jfn, x, clock="gpu")
    with pytest.raises(ValueError, match="step="):
        fulmen.profile(jfn, x, step=lambda: jfn(x))
