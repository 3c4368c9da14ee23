"""`fulmen.verify`: find the first compilation stage, and the first statement in it, whose
results diverge from eager PyTorch.

Every fulmen trace is runnable Python, so each stage can be run on the same inputs:

1. run `fn` eagerly (and, when inputs require grad, its gradients for a fixed random cotangent);
2. compile it with `fulmen.jit`, then run every forward stage (and every backward stage, on the
   final forward's residuals) with the trace interpreter, comparing each with eager;
3. in the first diverging stage, compare every statement's outputs with the values the previous
   stage computed under the same names (SSA names survive passes); a statement without a
   counterpart (a fusion region) is compared with its own subsymbols run by torch;
4. write a standalone repro script for that statement: a fusion in it is fused again by its
   executor from its region (`rebuild_fusion`), so the script runs in a fresh process.

Tolerances are per dtype: `torch.testing.assert_close`'s values (x10 for gradients), and never
tighter than one unit in the last place of the dtype, also when `rtol` is given (a 1-ulp
bfloat16 difference is rounding, not a divergence). Rounding differences can grow through a
program (a sum that cancels, bfloat16 everywhere); so `fn` is also run in float64 where it can
be, and a stage's result outside the tolerance still agrees when it passes the float64 rule of
`fulmen.accuracy` (error vs float64 at most 2x eager's, 3x for float16/bfloat16, plus a small
floor; the rule of `torch._dynamo`'s accuracy checks).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from fulmen.core import Trace
from fulmen.core.interpret import interpret
from fulmen.jit import _jitted, jit
from fulmen.tools.divergence import _locate
from fulmen.tools.minimize import minimize_program, write_script
from fulmen.tools.tolerances import _compare


@dataclass
class StageCheck:
    """One stage compared with eager: `max_error` is the largest |actual - expected| seen."""

    stage: str
    ok: bool
    max_error: float
    detail: str = ""


@dataclass
class VerifyReport:
    """The result of `fulmen.verify`; `str(report)` is the human-readable account.

    `first_bad_stage` and `culprit` (the statement, as printed) are None when everything agrees;
    `repro_path` is the script reproducing the culprit's mismatch on its own.
    """

    stages: list[StageCheck] = field(default_factory=list)
    first_bad_stage: str | None = None
    culprit: str | None = None
    culprit_op: str | None = None
    repro_path: str | None = None
    minimized_failure: str | None = None
    minimized_path: str | None = None
    minimized_report: VerifyReport | None = None

    @property
    def ok(self) -> bool:
        return self.first_bad_stage is None

    def __str__(self) -> str:
        lines = ["fulmen.verify: " + ("all stages agree with eager" if self.ok else
                                      f"first divergence in stage '{self.first_bad_stage}'")]
        for check in self.stages:
            mark = "ok " if check.ok else "BAD"
            lines.append(f"  [{mark}] {check.stage:<44} max |error| {check.max_error:.3g}"
                         + (f"  {check.detail}" if check.detail else ""))
        if self.culprit:
            lines.append(f"  first diverging statement (op {self.culprit_op}):\n    {self.culprit}")
        if self.repro_path:
            lines.append(f"  repro script: {self.repro_path}")
        if self.minimized_path:
            lines.append(f"  minimized program ({self.minimized_failure}): "
                         f"{self.minimized_path}")
        if self.minimized_report is not None and not self.minimized_report.ok:
            inner = str(self.minimized_report).replace("\n", "\n  ")
            lines.append(f"  on the minimized program: {inner}")
        return "\n".join(lines)


def check_repro(actual, expected) -> int:
    """What a repro script ends with: print the largest difference between the region's and
    the reference's outputs; return the exit status (1 when they differ beyond the dtype's
    tolerance, 0 otherwise)."""
    ok, worst, detail = _compare(actual, expected, None, None)
    print("max |region - reference| =", worst, detail)
    return 0 if ok else 1


def _clone(tree):
    def copy(leaf):
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().clone().requires_grad_(leaf.requires_grad)
        return leaf

    return pytree.tree_map(copy, tree)


def _stage_output(trace: Trace, value):
    return value[0] if trace.name == "forward" else value


def _float64_run(fn, args, kwargs):
    """`(inputs requiring grad, outputs)` of `fn` run on float64 copies of its floating inputs,
    or None when there are none below float64 or `fn` does not compute in float64 then (it
    holds lower-precision tensors of its own, or fails)."""
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not any(t.is_floating_point() and t.dtype != torch.float64 for t in leaves):
        return None

    def widen(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.detach().double().requires_grad_(leaf.requires_grad)
        return leaf

    wide_args, wide_kwargs = pytree.tree_map(widen, (args, kwargs))
    try:
        outputs = fn(*wide_args, **wide_kwargs)
    except Exception:
        return None
    if not all(o.dtype == torch.float64 for o in pytree.tree_leaves(outputs)
               if isinstance(o, torch.Tensor) and o.is_floating_point()):
        return None
    grad_inputs = [t for t in pytree.tree_leaves((wide_args, wide_kwargs))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
    return grad_inputs, outputs


def verify(fn, *args, executors=None, rtol: float | None = None, atol: float | None = None,
           repro_dir: str | None = None, minimize: bool = False, against=None,
           **kwargs) -> VerifyReport:
    """Compile `fn` and check every stage against eager on `(args, kwargs)`.

    Returns a `VerifyReport` (never raises for a mismatch). Inputs are cloned, so `fn` sees
    fresh copies in each run. `repro_dir` defaults to a new temporary directory.

    `minimize=True` also compares the whole compiled program with eager (or, given `against`,
    with the program compiled for the executors `against`: a cross-executor check) by the
    float64 rule, and when it fails shrinks the traced program statement by statement while
    the failure keeps its kind (`fulmen.minimize`), writes it as a standalone script
    (`minimized_path`) and verifies the minimized program stage by stage
    (`minimized_report`: the pass and the statement).

    Example:
        >>> report = fulmen.verify(f, x, y, executors=[myex, "torch"])
        >>> print(report)
    """
    report = VerifyReport()
    eager_args, eager_kwargs = _clone((args, kwargs))
    expected = fn(*eager_args, **eager_kwargs)
    grad_inputs = [t for t in pytree.tree_leaves((eager_args, eager_kwargs))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
    wants_grad = torch.is_grad_enabled() and bool(grad_inputs)
    with torch.random.fork_rng(devices=[]):  # the compiled run draws what eager drew
        wide = _float64_run(fn, *_clone((args, kwargs)))
    reference = _detached(wide[1]) if wide is not None else None

    jit_args, jit_kwargs = _clone((args, kwargs))
    jfn = jit(fn, executors=executors)
    compiled = jfn(*jit_args, **jit_kwargs)
    machinery = _jitted(jfn)
    entry = list(machinery._cache.values())[-1]
    leaves = pytree.tree_leaves((jit_args, jit_kwargs))
    state = [slot.get() for slot in machinery._state_slots]
    inputs = [leaves[i] for i in entry.tensor_positions] + state + list(entry.captured)
    traces = list(entry.traces)
    if entry.tree:  # a program with graph breaks: its segments hold the captured tensors
        values = dict(zip(entry.fn.arg_names, inputs)) | _tree_constants(entry.fn.root)
        inputs = [values[name] for name in traces[0].arg_names]

    previous = None
    with torch.no_grad():
        for trace in traces:
            value, _ = interpret(trace, *inputs)
            ok, worst, detail = _compare(_stage_output(trace, value), expected, rtol, atol,
                                         reference=reference)
            report.stages.append(StageCheck(trace.provenance, ok, worst, detail))
            if not ok and report.first_bad_stage is None:
                report.first_bad_stage = trace.provenance
                _locate(report, previous, trace, lambda _: inputs, rtol, atol, repro_dir)
            previous = trace

    if entry.tree:
        _verify_tree(report, compiled, expected, leaves, grad_inputs if wants_grad else [],
                     rtol, atol, reference, wide)
    elif wants_grad:
        _verify_backward(report, machinery, traces, inputs, expected, grad_inputs,
                         rtol, atol, repro_dir, wide)
    if minimize and not kwargs:
        _minimize(report, fn, args, executors, against, repro_dir)
    return report


def _tree_constants(node) -> dict[str, torch.Tensor]:
    """The captured tensors (closures, globals) of every segment of a trace tree, by name."""
    if node is None:
        return {}
    constants = dict(node.constants)
    for child in node.children.values():
        constants |= _tree_constants(child)
    return constants


def _minimize(report, fn, args, executors, against, repro_dir) -> None:
    """Shrink a failing program and verify the small one (see `verify`)."""
    small = minimize_program(fn, *_clone(args), executors=executors, against=against)
    if small is None:
        return
    directory = repro_dir or tempfile.mkdtemp(prefix="fulmen_verify_")
    report.minimized_failure = str(small.failure)
    report.minimized_path = write_script(small, os.path.join(directory, "fulmen_minimized.py"))
    if report.first_bad_stage is None:
        report.first_bad_stage = f"whole program ({small.failure.kind})"
    try:
        report.minimized_report = verify(small.trace.python_callable(), *small.inputs,
                                         executors=executors, repro_dir=directory)
    except Exception:  # noqa: BLE001 - e.g. the failure is an error of the compiled run
        report.minimized_report = None


def _detached(tree):
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def _verify_backward(report, machinery, forwards: list[Trace], inputs, expected, grad_inputs,
                     rtol, atol, repro_dir, wide=None) -> None:
    """Run every backward stage on the forward's residuals; compare input gradients. Residuals
    are taken by name from the values of every forward stage (an early backward stage may read
    a value that a later forward stage computes inside a fusion)."""
    backward_traces = machinery._stats.last_backward_traces
    if not backward_traces:
        return
    cotangents, eager_grads = _input_grads(expected, grad_inputs)
    reference = _float64_grads(wide, cotangents, grad_inputs)
    with torch.no_grad():
        forward_env = {}
        for forward in forwards:
            forward_env.update(interpret(forward, *inputs)[1])

        def backward_inputs(trace: Trace) -> list:
            residuals = [forward_env[n] for n in trace.arg_names if n in forward_env]
            return residuals + cotangents

        previous = None
        for trace in backward_traces:
            # stages may differ in which forward values they take (rematerialization): feed each
            # its arguments by name from the forward's values, then the cotangents in order
            grads, _ = interpret(trace, *backward_inputs(trace))
            actual = [g for g, x in zip(grads, inputs)
                      if isinstance(x, torch.Tensor) and x.requires_grad]
            actual = [torch.zeros_like(x) if g is None else g for g, x in zip(actual, grad_inputs)]
            ok, worst, detail = _compare(actual, eager_grads, rtol, atol, scale=10.0,
                                         reference=reference)
            stage = f"backward: {trace.provenance}"
            report.stages.append(StageCheck(stage, ok, worst, detail))
            if not ok and report.first_bad_stage is None:
                report.first_bad_stage = stage
                _locate(report, previous, trace, backward_inputs, rtol, atol, repro_dir)
            previous = trace


def _input_grads(outputs, grad_inputs) -> tuple[list, list]:
    """Seeded random cotangents for the outputs that require grad, and the gradients of
    `grad_inputs` they give (zeros where unused)."""
    generator = torch.Generator().manual_seed(0)
    out_leaves = [o for o in pytree.tree_leaves(outputs)
                  if isinstance(o, torch.Tensor) and o.requires_grad]
    cotangents = [torch.randn(o.shape, generator=generator, dtype=o.dtype) for o in out_leaves]
    grads = torch.autograd.grad(out_leaves, grad_inputs, cotangents, allow_unused=True)
    return cotangents, [torch.zeros_like(x) if g is None else g
                        for g, x in zip(grads, grad_inputs)]


def _verify_tree(report, compiled, expected, jit_leaves, grad_inputs, rtol, atol,
                 reference, wide) -> None:
    """A program with graph breaks: its compiled segments (each with its own backward) are no
    stage of the traced program, so check the compiled call's outputs and input gradients."""
    stages = [("compiled segments (graph breaks)", _detached(compiled), expected, reference,
               1.0)]
    if grad_inputs:
        cotangents, eager_grads = _input_grads(expected, grad_inputs)
        _, grads = _input_grads(compiled, [t for t in jit_leaves if isinstance(t, torch.Tensor)
                                           and t.requires_grad])
        stages.append(("backward: compiled segments (graph breaks)", grads, eager_grads,
                       _float64_grads(wide, cotangents, grad_inputs), 10.0))
    for stage, actual, wanted, wide_reference, scale in stages:
        ok, worst, detail = _compare(actual, wanted, rtol, atol, scale=scale,
                                     reference=wide_reference)
        report.stages.append(StageCheck(stage, ok, worst, detail))
        if not ok and report.first_bad_stage is None:
            report.first_bad_stage = stage


def _float64_grads(wide, cotangents, grad_inputs) -> list | None:
    """The float64 run's input gradients for the same cotangents (zeros where unused), or
    None without a float64 run that matches the inputs requiring grad."""
    if wide is None:
        return None
    wide_inputs, outputs = wide
    out_leaves = [o for o in pytree.tree_leaves(outputs)
                  if isinstance(o, torch.Tensor) and o.requires_grad]
    if len(wide_inputs) != len(grad_inputs) or len(out_leaves) != len(cotangents):
        return None
    grads = torch.autograd.grad(out_leaves, wide_inputs, [c.double() for c in cotangents],
                                allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, wide_inputs)]


__all__ = ["StageCheck", "VerifyReport", "check_repro", "verify"]
