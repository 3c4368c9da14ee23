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


class _Outer(torch.nn.Module):
    def __init__(self, frozen):
        super().__init__()
        self.frozen = frozen
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.frozen(x).relu())


def test_a_frozen_scripted_module_and_one_as_a_submodule():
    """A `torch.jit.freeze`-d module keeps no `training` flag (its weights are constants, it is
    always in eval mode): the guard's read of every module's flag raised AttributeError on the
    first call. Values equal eager's across a retrace for a new shape (whose explanation names
    each module's flag), compiled, for the frozen module alone and as a submodule."""
    torch.manual_seed(0)
    frozen = torch.jit.freeze(torch.jit.script(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()))
    for model in (frozen, _Outer(frozen)):
        jm = fulmen.jit(model)
        for rows in (4, 4, 6):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(jm(x), model(x))
        assert fulmen.compile_stats(jm).eager_calls == 0


def test_non_strict_torch_export_of_a_jitted_module_names_the_way_out():
    """Non-strict `torch.export` (the default) of a jitted module read `forward.__code__`
    (AttributeError with no way out) and, past it, named the parameters twice (KeyError):
    the error says to export the original module, and that export equals eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    jm = fulmen.jit(model)
    x = torch.randn(4, 8)
    torch.testing.assert_close(jm(x), model(x))
    try:
        torch.export.export(jm, (x,))
    except AttributeError as error:
        assert "jitted._orig_mod" in str(error)
    else:
        raise AssertionError("non-strict export of a jitted module raised nothing")
    exported = torch.export.export(jm._orig_mod, (x,))
    torch.testing.assert_close(exported.module()(x), model(x))
    assert getattr(jm.forward, "__code__", None) is None  # `hasattr` callers see no code
