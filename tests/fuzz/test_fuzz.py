"""Differential fuzzing: random programs through fulmen.jit vs eager, forward and backward,
and each program once more ending with in-place updates of its inputs (directly and through a
view), whose write-backs must reach the caller's tensors.

`make test` runs FULMEN_FUZZ_EXAMPLES (default 200) programs per executor configuration;
`make fuzz` runs many more (`run_fuzz.py`). A program eager rejects (a broadcasting mismatch)
is skipped.
"""

import dataclasses
import os
import zlib

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings

import fulmen
from fulmen.tools.accuracy import check_accuracy
from fulmen.transforms import decompose_to_prims
from tests.fuzz.programs import BINARY, UNARY, Program, Resize, Step, programs

EXAMPLES = int(os.environ.get("FULMEN_FUZZ_EXAMPLES", "200"))
CONFIGS = {
    "torch": {"executors": ["torch"]},
    "decomposed": {"executors": ["torch"], "transforms": [decompose_to_prims]},
    "codegen": {"executors": ["codegen", "torch"]},
    # symbolic sizes from the first call, the same jitted function then called at other sizes
    "dynamic": {"executors": ["torch"], "dynamic": True},
    "dynamic_codegen": {"executors": ["codegen", "torch"], "dynamic": True},
}
SHAPE_CALLS = {"dynamic", "dynamic_codegen"}  # configs whose programs draw `Program.calls`
TOLERANCE = {  # (rtol, atol): half precision differs in rounding of intermediates
    torch.float32: (1e-4, 1e-5), torch.float64: (1e-7, 1e-7),
    torch.float16: (2e-2, 2e-2), torch.bfloat16: (8e-2, 8e-2),
}


def _close(actual, expected, dtype, what, reference=None, low_precision=False):
    """Within the dtype's tolerance of eager's result, or else (given `reference()`, the
    float64 result) as accurate as eager's by the float64 rule: rounding that eager does
    too (a gradient through `.to(float16)`) can move results past a fixed tolerance."""
    rtol, atol = TOLERANCE[dtype]
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")
    except AssertionError as error:
        wide = reference() if reference is not None else None
        if wide is None or not check_accuracy(actual, expected, wide, low_precision or None):
            raise error from None


def _low_precision(program: Program) -> bool:
    return program.dtype in (torch.float16, torch.bfloat16) or any(
        step.op in ("bf16_round", "fp16_round") for step in program.steps)


def _reference(program: Program, inputs: list, cotangent=None):
    """`program` run on float64 copies of `inputs`: its output and, given a cotangent, the
    gradients of its inputs (zeros where unused)."""
    wide = [x.detach().double().requires_grad_(x.requires_grad) for x in inputs]
    out, _ = program.run(*wide)
    if cotangent is None:
        return out.detach()
    grads = torch.autograd.grad(out, wide, cotangent.double(), allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, wide)]


# prim-level autodiff (every op decomposed before the split) differentiates maximum(x, y) and
# 1 / (1 + exp(-x)) as such (relu's decomposition keeps eager's tie: NOTE [relu at zero]): eager's subgradients at ties and the overflow-safe backward forms
# of relu, clamp, sigmoid... are rules of the torch-level ops, so that config gets normal values
EDGE_VALUES = {"torch", "codegen", "dynamic", "dynamic_codegen"}


def _rejects(fn, *args) -> bool:
    """Whether eager raises on `fn(*args)` (shapes do not broadcast, no last dim to normalise)."""
    try:
        fn(*args)
    except (RuntimeError, IndexError):
        return True
    return False


def _calls(program: Program) -> list[Program]:
    """The program at its own sizes, then at each of `program.calls`'s (one jitted function
    serves them all)."""
    return [program] + [program.resized(resize) for resize in program.calls]


def check_program(program: Program, config: dict) -> None:
    """`program` through `fulmen.jit(**config)` vs eager, forward and backward; with
    `program.calls`, the same jitted function is called at every size in turn, and where eager
    rejects a call's shapes, fulmen must raise too (a trace reused where it does not apply)."""
    jfn = fulmen.jit(lambda *xs: program.run(*xs)[0], **config)
    for index, call in enumerate(_calls(program)):
        _check_call(call, jfn, index, bool(program.calls))


def _check_call(program: Program, jfn, index: int, alternating: bool) -> None:
    requires_grad = program.dtype in (torch.float32, torch.float64)
    eager_inputs = program.make_inputs(index, requires_grad)
    try:
        expected, _ = program.run(*eager_inputs)
    except (RuntimeError, IndexError):  # eager rejects it
        if alternating:
            jit_inputs = program.make_inputs(index, requires_grad)
            assert _rejects(jfn, *jit_inputs), f"call {index} at {program.input_shapes}: " \
                "eager raises, fulmen returned a result"
        return
    jit_inputs = program.make_inputs(index, requires_grad)
    actual = jfn(*jit_inputs)
    where = f"call {index} at {program.input_shapes}: " if alternating else ""
    low = _low_precision(program)
    _close(actual, expected, program.dtype, where + "forward",
           lambda: _reference(program, eager_inputs), low)
    if requires_grad and expected.requires_grad:
        cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1),
                                dtype=expected.dtype)
        eager_grads = torch.autograd.grad(expected, eager_inputs, cotangent, allow_unused=True)
        jit_grads = torch.autograd.grad(actual, jit_inputs, cotangent, allow_unused=True)
        wide = []

        def reference(index):
            if not wide:
                wide.append(_reference(program, eager_inputs, cotangent))
            return wide[0][index]

        for i, (e, a) in enumerate(zip(eager_grads, jit_grads)):
            if e is None or a is None:
                assert (e is None or not e.any()) and (a is None or not a.any()), \
                    where + "grad presence"
                continue
            _close(a, e, program.dtype, where + "gradient", lambda i=i: reference(i), low)


def _mutating(program: Program):
    def fn(*xs):
        out = program.run(*xs)[0]
        xs[0].add_(out.mean().to(xs[0].dtype))  # an input updated in place: a write-back
        if xs[-1].ndim:
            xs[-1][..., :1].mul_(2)  # through a view of an input
        return out

    return fn


def check_mutation(program: Program, config: dict) -> None:
    """The program, then in-place updates of its inputs: outputs and inputs as eager's (with
    `program.calls`, one jitted function at every size in turn)."""
    jfn = fulmen.jit(_mutating(program), **config)
    for index, call in enumerate(_calls(program)):
        eager_inputs = [x.detach() for x in call.make_inputs(index, False)]
        jit_inputs = [x.detach() for x in call.make_inputs(index, False)]
        where = f"call {index} at {call.input_shapes}: " if program.calls else ""
        try:
            expected = _mutating(call)(*eager_inputs)
        except (RuntimeError, IndexError):
            if program.calls:
                assert _rejects(jfn, *jit_inputs), where + "eager raises, fulmen returned"
            continue
        actual = jfn(*jit_inputs)
        _close(actual, expected, call.dtype, where + "forward of the mutating program")
        for i, (a, e) in enumerate(zip(jit_inputs, eager_inputs)):
            _close(a, e, call.dtype, f"{where}input {i} after in-place updates")


def sweep() -> list[Program]:
    """Every op once, whatever the random draw: unary ops on a transposed input (strided
    kernel reads), binary ops against a row that broadcasts, each followed by one more op (a
    fusion region of several prims), with gradients in float32."""
    unary = [Program(((4, 5),), torch.float32, (True,), (Step(op, (0,)), Step("scale", (1,))))
             for op in sorted(UNARY)]
    binary = [Program(((4, 5), (1, 5)), torch.float32, (True, False),
                      (Step(op, (0, 1)), Step("scale", (2,)))) for op in sorted(BINARY)]
    return unary + binary


def sweep_calls() -> list[Program]:
    """The sweep, each program called again at other sizes: larger, equal sizes, sizes 0 and
    1 (the broadcast row stays 1), then the first sizes."""
    calls = (Resize(four=7, five=2), Resize(four=3, five=3), Resize(four=0, five=1), Resize())
    return [dataclasses.replace(program, calls=calls) for program in sweep()]


def _budget(config: str) -> int:
    """Random programs per config in `make test`: kernel builds dominate codegen's time."""
    return {"codegen": EXAMPLES // 2, "dynamic_codegen": max(EXAMPLES // 16, 4)}.get(
        config, EXAMPLES)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_random_programs_match_eager(config, request):
    if "codegen" in config:
        request.getfixturevalue("codegen_eager")  # check the kernels, not the torch fallback

    @settings(max_examples=_budget(config), deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(programs(calls=config in SHAPE_CALLS))
    def run(program):
        if config not in EDGE_VALUES:
            program = dataclasses.replace(program, values="normal")
        check_program(program, CONFIGS[config])
        # and the mutating variant for a quarter of them
        if "codegen" not in config or zlib.crc32(repr(program).encode()) % 4 == 0:
            check_mutation(program, CONFIGS[config])

    # every op at least once per executor list (symbolic kernels: only the random programs)
    examples = {"dynamic": sweep_calls(), "dynamic_codegen": []}.get(config, sweep())
    for program in examples:
        run = example(program)(run)
    run()


def test_random_programs_match_eager_at_the_default_partition(monkeypatch):
    """The partition users get (`FULMEN_FUSE_TINY=0`: regions of a few small ops stay on torch,
    an op only part of whose prims were fused is restored whole), which the rest of the suite
    (conftest sets `FULMEN_FUSE_TINY=1` to check kernels on small tensors) mostly does not run:
    a small budget of codegen programs, with their in-place variants."""
    from fulmen.executors.codegen import set_compile_policy

    monkeypatch.setenv("FULMEN_FUSE_TINY", "0")
    previous = set_compile_policy("eager")

    @settings(max_examples=max(EXAMPLES // 16, 8), deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(programs())
    def run(program):
        check_program(program, CONFIGS["codegen"])
        check_mutation(program, CONFIGS["codegen"])

    try:
        run()
    finally:
        set_compile_policy(previous.mode, previous.hot_calls)
