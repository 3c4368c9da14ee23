"""The extension API: user executors with operators, implementations and checkers."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.extend import OperatorExecutor, get_executor, register_executor


def gelu_twice(x):
    return F.gelu(x) * 2


def _make_executor():
    calls = []
    myex = OperatorExecutor("myex")

    def my_gelu_impl(a, approximate="none"):
        calls.append(a.dtype)
        return 0.5 * a * (1 + torch.erf(a / 2**0.5))

    my_gelu = myex.register_operator("my_gelu", like=F.gelu, fn=my_gelu_impl)
    myex.register_implementation(
        F.gelu, my_gelu, checker=lambda a, approximate="none": a.dtype == torch.float32
    )
    register_executor(myex)
    return myex, calls


def test_user_executor_claims_float32_gelu_only():
    myex, calls = _make_executor()
    jfn = fulmen.jit(gelu_twice, executors=[myex, "torch"])

    x32 = torch.randn(5)
    torch.testing.assert_close(jfn(x32), gelu_twice(x32))
    assert calls == [torch.float32]
    assert "myex.my_gelu(x)" in str(fulmen.last_traces(jfn)[-1])

    x64 = torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(jfn(x64), gelu_twice(x64))
    assert calls == [torch.float32]  # the checker declined the float64 call site
    final = str(fulmen.last_traces(jfn)[-1])
    assert "myex" not in final and "torch.nn.functional.gelu(x)" in final


def test_executor_operator_called_directly_and_printed_trace_runs_standalone():
    myex, calls = _make_executor()

    def uses_op(x):
        return myex.my_gelu(x) + 1

    jfn = fulmen.jit(uses_op, executors=[myex])
    x = torch.randn(3)
    torch.testing.assert_close(jfn(x), F.gelu(x) + 1)
    source = str(fulmen.last_traces(jfn)[-1])
    assert "myex = get_executor('myex')" in source
    namespace = {}
    exec(compile(source, "<standalone>", "exec"), namespace)
    torch.testing.assert_close(namespace["computation"](x), F.gelu(x) + 1)


def test_operator_of_unlisted_executor_is_a_clear_error():
    myex, _ = _make_executor()

    def uses_op(x):
        return myex.my_gelu(x)

    with pytest.raises(fulmen.FulmenError, match="not in the executor list"):
        fulmen.jit(uses_op, executors=["torch"])(torch.randn(2))


def test_implementation_with_fn_and_symbol_target_are_interchangeable():
    ex = OperatorExecutor("negex")
    seen = []

    @ex.implements(torch.neg)
    def _neg(a):
        seen.append("torch.neg")
        return -a

    jfn = fulmen.jit(lambda x: torch.neg(x) + 0, executors=[ex])
    x = torch.randn(3)
    torch.testing.assert_close(jfn(x), -x)
    assert seen == ["torch.neg"]


def test_registry_and_defaults():
    assert get_executor("torch") is fulmen.torch_ex
    assert fulmen.get_default_executors() == [get_executor("codegen"), fulmen.torch_ex]
    with pytest.raises(KeyError, match="registered"):
        get_executor("no_such_executor")
    assert get_executor("python") is fulmen.python_ex


def test_python_executor_runs_number_prims():
    from fulmen.ops import prims

    bsym_args = (2, 3)
    impl = fulmen.python_ex.implementation_for(prims.add)
    assert impl.checker(*bsym_args)
    assert impl.op.impl(*bsym_args) == 5
    assert not impl.checker(torch.ones(1), 3)
