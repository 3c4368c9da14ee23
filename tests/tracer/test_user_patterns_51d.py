"""User patterns probed in session 51 (h51probe3, second round): TorchScript functions and
frozen modules inside jitted code, `torch.export` of a jitted module; each compared with eager
PyTorch."""

import warnings

import torch

import fulmen


@torch.jit.script
def _scaled(x):
    return x * 2


_CLOSED = torch.ones(3)


def test_a_script_function_called_by_jitted_code_runs_the_call_eagerly():
    """The TorchScript interpreter reaches no `__torch_function__`: a `torch.jit.script`-ed
    function called from jitted code was handed fulmen's traced tensors (RuntimeError), and on a
    closed-over tensor its result would be baked in. The call runs eagerly with a warning that
    names the function; later updates of the closed-over tensor are seen."""
    def on_argument(x):
        return _scaled(x) + 1

    def on_closed(x):
        return x + _scaled(_CLOSED)

    x = torch.randn(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for fn in (on_argument, on_closed):
            jf = fulmen.jit(fn)
            torch.testing.assert_close(jf(x), fn(x))
            _CLOSED.add_(1)
            torch.testing.assert_close(jf(x), fn(x))
            assert fulmen.compile_stats(jf).eager_calls == 2
    assert any("TorchScript function _scaled" in str(w.message) for w in caught)
    torch.testing.assert_close(_scaled(x), x * 2)  # outside a trace: TorchScript's own call
