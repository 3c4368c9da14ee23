"""Model-level differential fuzzing: random models (transformer blocks with masks, rotary, MoE
top-k routing; conv stages) in random calling contexts through `fulmen.jit` vs eager: every
output, buffer, KV-cache entry, gradient and optimizer update must agree, by a tight tolerance
or the float64 rule (`fulmen.accuracy`; checking: `model_check.py`, models: `models.py`,
strategies and explicit patterns: `model_cases.py`).

Which strategy produces which pattern of issue 18 (each is also an explicit `PATTERNS` case,
run by every executor list: `["torch"]`, decomposed to prims, `["codegen", "torch"]`):

    autocast around (bf16/fp16)     cases(): Context(autocast, fp16); Call(change="autocast")
    autocast inside / fp32 island   _attn: Attn(autocast_inside); _mlp: Mlp(fp32_island)
    bf16/fp16 weights               cases(): Context(bf16_weights, fp16)
    custom autograd.Function        _custom: Custom("scale" | "ste" | "linear")
    jit(DDP(model)) and             cases(): Context(ddp) - one-rank gloo group;
      DDP(jit(model)) train           fulmen.jit(DDP(model)) for odd seeds, else DDP(jit)
    jitted optimizer step + LR      cases(): Context(optimizer="sgd" | "adamw"): fulmen.jit(
      scheduler                       optimizer.step), StepLR stepped after it
    jit(loss_fn)(model, batch)      cases(): Context(call="argument"): a jitted function given
                                      the model as an argument (`model_check.model_as_argument`)
    KV cache between calls          cases(): Context(cache="dynamic"): transformers.
                                      DynamicCache grown by every attention, prefill + decode
    view on an intermediate         _layout: Layout("view") (strided intermediate, `.view`)
    strides read by Python          _layout: Layout("strides") (`is_contiguous()`/`stride()` of
                                      a strided intermediate, also after new sizes)
    gradient accumulation           cases(): Context(accumulate)
    torch.utils.checkpoint          _attn/_mlp/_moe/_stage: checkpoint=True
    buffer in-place updates         _stat: Stat() (running mean, step counter); batch norm;
                                      Call(change="buffer") writes buffers from outside
    changing shapes and state       cases(): Call(batch, length, padding) per call;
                                      Call(change=train/eval/flag/freeze/temperature/grad/
                                      hook/grad_hook)
    masks, branches, early exits    _attn: mask_if (value-dependent `if`), SeqModel(early_exit),
                                      Mlp(unpad) and Moe (data-dependent shapes)
    boolean / float / BERT masks,   _attn: Attn(mask="bool" | "float" | "bert"),
      left padding + rotary           Attn(positions_from_mask); SeqModel(left_pad)
    norms with and without affine   _norms: layer, layer_plain, layer_nobias, rms, rms_torch,
                                      rms_plain; _stage: batch, batch_plain, batch_cumulative
                                      (momentum=None), batch_nostats, group, group_plain,
                                      instance
    MoE top-k combines              _moe: Moe(combine="index_add" | "scatter_add" | "gather" |
                                      "scatter")
    EMA buffer, eval toggled        _stat: Ema() (lerp_ of a weight copy, used in eval)
    losses                          SeqModel/ConvModel(loss="ce" | "ce_tokens" | "ce_smooth"
                                      (label smoothing, class weights) | "nll" | "mse")
    traced stores on a module       seq_models(): Memory() (a buffer replaced each call)

A failure is shrunk by hypothesis, then by `minimize` (drops calls, blocks, contexts and flags
while the failure keeps its kind), then its first call's trace by statement deletion
(`fulmen.minimize`); the message holds the minimized case, a standalone repro and the path of
the minimized trace script.

`make test` runs the patterns and a few random cases per executor list (FULMEN_FUZZ_EXAMPLES
scales it); `make fuzz` runs large campaigns (`run_fuzz.py`). One campaign by hand:

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
    MIN_CALLS,
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

    # cold kernel builds cost seconds per model: the small budget builds fewer for codegen;
    # the decomposed list shares torch's kernels and runs every pattern, with fewer random cases
    small = config != "torch" and EXAMPLES < 10

    @settings(max_examples=EXAMPLES // 2 if small else EXAMPLES, deadline=None,
              derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(cases(MIN_CALLS.get(config, 1)))
    def run(case):
        failure = failure_of(case, executors)
        if failure is None:
            return
        if current_build_context().is_final:  # hypothesis has shrunk it: reduce further
            raise AssertionError(_report(case, failure, executors)) from failure
        raise failure

    patterns = PATTERNS
    if small and config == "codegen":
        patterns = PATTERNS[1:2]
    elif small and config == "dynamic":  # the first patterns whose calls change shape
        patterns = [case for case in PATTERNS if _shapes_change(case)][:3]
    for case in patterns:  # every pattern at least once
        run = example(case)(run)
    run()


def _shapes_change(case) -> bool:
    return len({(call.batch, call.length) for call in case.calls}) > 1


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
    @given(cases(MIN_CALLS.get(config, 1)))
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
