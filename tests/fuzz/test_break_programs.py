"""Differential fuzzing of graph breaks: random programs with 0-3 value-dependent constructs
(`if h.sum() > c:`, `.item()` feeding a Python loop count, boolean-mask indexing) run through one
jitted function on several inputs that take different branches; forward values and gradients
must equal eager's on every call. `make fuzz` runs more examples (FULMEN_FUZZ_EXAMPLES)."""

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fulmen

EXAMPLES = max(10, int(os.environ.get("FULMEN_FUZZ_EXAMPLES", "200")) // 5)

_UNARY = {
    "tanh": torch.tanh,
    "sin": torch.sin,
    "relu": torch.relu,
    "scale": lambda h: h * 1.5 - 0.25,
    "square": lambda h: h * h * 0.5,
}


def _apply(step, h):
    kind = step[0]
    if kind == "unary":
        return _UNARY[step[1]](h)
    if kind == "branch":  # value-dependent `if`
        _, threshold, then_op, else_op = step
        if h.sum() > threshold:
            return _UNARY[then_op](h)
        return _UNARY[else_op](h)
    if kind == "loop":  # .item() feeding a Python loop count
        for _ in range(int(h.abs().sum().item() * 2) % 3):
            h = h * 0.9 + 0.1
        return h
    if kind == "mask":  # boolean-mask indexing: a data-dependent shape
        return h + h[h > step[1]].sum() * 0.1
    raise AssertionError(kind)


_steps = st.one_of(
    st.tuples(st.just("unary"), st.sampled_from(sorted(_UNARY))),
    st.tuples(st.just("branch"), st.floats(-1, 1), st.sampled_from(sorted(_UNARY)),
              st.sampled_from(sorted(_UNARY))),
    st.tuples(st.just("loop")),
    st.tuples(st.just("mask"), st.floats(-0.5, 0.5)),
)


def _program(steps):
    def fn(x, w):
        h = x * w
        for step in steps:
            h = _apply(step, h)
        return h
    return fn


def _run(fn, x, w):
    x = x.clone().requires_grad_()
    out = fn(x, w)
    out.sum().backward()
    return out.detach(), x.grad


STEPS = st.lists(_steps, min_size=1, max_size=6)
SEEDS = st.lists(st.integers(0, 99), min_size=3, max_size=3)


def check_break_program(steps, seeds) -> None:
    """Run the program of `steps` jitted and eagerly on inputs from `seeds` (each call may
    take other branches); raise AssertionError where values or gradients differ."""
    breaks = sum(step[0] != "unary" for step in steps)
    if breaks > 3:
        steps = [s for s in steps if s[0] == "unary"] + [s for s in steps if s[0] != "unary"][:3]
    fn = _program(steps)
    jfn = fulmen.jit(fn)
    w = torch.linspace(-1, 1, 6)
    for seed in seeds:
        x = torch.randn(6, generator=torch.Generator().manual_seed(seed))
        out, grad = _run(jfn, x, w)
        ref, ref_grad = _run(fn, x, w)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(steps=STEPS, seeds=SEEDS)
def test_programs_with_breaks_match_eager(steps, seeds):
    check_break_program(steps, seeds)
