"""Model-level differential fuzzing: random models (transformer blocks with masks, rotary, MoE
top-k routing; conv stages) in random calling contexts (train/eval, no_grad, autocast around
and inside, bf16 weights, checkpoint, gradient accumulation, custom autograd.Function, buffer
updates, changing shapes and state) through `fulmen.jit` vs eager: every output, buffer and
gradient must agree, by a tight tolerance or the float64 rule (`tests/fuzz/model_check.py`;
models: `models.py`, generator and explicit patterns: `model_cases.py`).

A failure is shrunk by hypothesis, then by `minimize` (drops calls, blocks, contexts and flags
while the failure keeps its kind); the message holds the minimized case and a standalone repro.

`make test` runs a few examples per executor list; FULMEN_FUZZ_EXAMPLES scales it (`make
fuzz`). A campaign that keeps going after failures and tallies them:

    .venv/bin/python -m tests.fuzz.test_models 300 torch
"""

import os
import sys
import tempfile
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis.control import current_build_context

from tests.fuzz.model_cases import PATTERNS, cases
from tests.fuzz.model_check import (
    CONFIGS,
    InvalidCase,
    failure_of,
    minimize,
    repro,
    trace_repro,
)

EXAMPLES = max(2, int(os.environ.get("FULMEN_FUZZ_EXAMPLES", "200")) // 50)
EXECUTORS = list(CONFIGS)  # torch; decomposed to prims first; codegen kernels ahead of torch


def _report(case, failure, executors) -> str:
    """The failure, its case minimized (hypothesis, then `minimize`), a repro of the case and,
    where the first call fails by itself, its trace minimized by statement deletion."""
    small = minimize(case, executors, failure.kind)
    final = failure_of(small, executors) or failure
    text = (f"{final}\n\nminimized case:\n{small!r}\n\nstandalone repro "
            f"(python -c from the repository root):\n{repro(small, executors)}")
    found = trace_repro(small, executors, tempfile.mkdtemp(prefix="fulmen_fuzz_"))
    if found is not None:
        minimized, path = found
        text += (f"\n\nthe first call's trace, minimized ({minimized.failure}); script "
                 f"{path}:\n{minimized.trace}")
    return text


@pytest.mark.parametrize("config", EXECUTORS)
def test_random_models_match_eager(config, request):
    if config == "codegen":
        request.getfixturevalue("codegen_eager")  # the generated kernels, not torch's fallback
    executors = config

    # cold kernel builds cost seconds per model: the small budget builds fewer for codegen
    small = config == "codegen" and EXAMPLES < 10

    @settings(max_examples=EXAMPLES // 2 if small else EXAMPLES, deadline=None,
              derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(cases())
    def run(case):
        failure = failure_of(case, executors)
        if failure is None:
            return
        if current_build_context().is_final:  # hypothesis has shrunk it: reduce further
            raise AssertionError(_report(case, failure, executors)) from failure
        raise failure

    for case in PATTERNS[1:2] if small else PATTERNS:  # every pattern of issue 18 at least once
        run = example(case)(run)
    run()


def campaign(examples: int, config: str) -> None:
    """Run `examples` cases without stopping at failures; print a tally and one minimized
    repro per failure kind."""
    executors = config
    if config == "codegen":
        from fulmen.executors.codegen import set_compile_policy

        set_compile_policy("eager")
    found, kinds = [], Counter()
    start = time.time()

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def run(case):
        try:
            failure = failure_of(case, executors)
        except InvalidCase as invalid:
            kinds["invalid (generator bug)"] += 1
            print(f"INVALID {invalid}\n  {case!r}", flush=True)
            return
        kinds["ok" if failure is None else failure.kind] += 1
        if failure is not None:
            print(f"FAIL {failure.kind}: {str(failure)[:300]}\n  {case!r}", flush=True)
            found.append((case, failure))

    run()
    print(f"\n{sum(kinds.values())} cases in {time.time() - start:.0f} s ({config}): "
          f"{dict(kinds)}")
    seen = set()
    for case, failure in found:
        if failure.kind in seen:
            continue
        seen.add(failure.kind)
        print("\n" + "=" * 80 + "\n" + _report(case, failure, executors))


if __name__ == "__main__":
    campaign(int(sys.argv[1]) if len(sys.argv) > 1 else 100,
             sys.argv[2] if len(sys.argv) > 2 else "torch")
