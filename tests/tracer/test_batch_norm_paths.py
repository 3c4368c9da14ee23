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
