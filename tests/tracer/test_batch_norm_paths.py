"""Training-mode batch norm's running statistics computed in the trace (the path CUDA takes,
where eager runs cuDNN's kernel: NOTE [batch norm running statistics]), forced on the CPU and
compared with eager's."""

import copy

import pytest
import torch
import torch.nn as nn

import fulmen
from fulmen.tracer import batch_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_running_statistics_computed_in_the_trace_are_eagers(monkeypatch, dtype):
    # the unbiased variance (n - 1) goes into running_var, the biased one normalises; for a
    # bfloat16 input the statistics are taken in float32 (eager's kernel accumulates in float)
    monkeypatch.setattr(batch_norm, "_kernel_takes", lambda *args: False)
    torch.manual_seed(0)
    eager = nn.BatchNorm1d(6, momentum=0.3)
    compiled = copy.deepcopy(eager)
    jbn = fulmen.jit(compiled, executors=["torch"])
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    for step in range(3):
        x = (torch.randn(4, 6, 3) * 3 + 5 * step).to(dtype)  # a mean bfloat16 rounds coarsely
        torch.testing.assert_close(jbn(x), eager(x), **tolerance)
        for name, buffer in eager.named_buffers():
            torch.testing.assert_close(dict(compiled.named_buffers())[name], buffer,
                                       rtol=1e-5, atol=1e-6)


class _CheckpointedBlock(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.linear, self.norm, self.reentrant = nn.Linear(4, 6), nn.BatchNorm1d(6), reentrant

    def block(self, x):
        return torch.relu(self.norm(self.linear(x)))

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_running_statistics_in_a_checkpointed_region_update_as_in_eager(reentrant):
    # eager's backward recomputes the region and updates the statistics again
    # (num_batches_tracked += 2 per step); the compiled call did once
    torch.manual_seed(0)
    eager = _CheckpointedBlock(reentrant)
    compiled = copy.deepcopy(eager)
    jblock = fulmen.jit(compiled)
    for _ in range(2):
        x = torch.randn(5, 4, requires_grad=reentrant)
        expected, actual = eager(x), jblock(x)
        torch.testing.assert_close(actual, expected)
        expected.square().sum().backward()
        actual.square().sum().backward()
        for name, buffer in eager.named_buffers():
            torch.testing.assert_close(dict(compiled.named_buffers())[name], buffer)
        for name, param in eager.named_parameters():
            torch.testing.assert_close(dict(compiled.named_parameters())[name].grad, param.grad)
    with torch.no_grad():  # no backward, no recomputation: compiled
        torch.testing.assert_close(jblock(x), eager(x))
