"""Sweep of litgpt's model families through `fulmen.jit` (long-running; not part of `make test`).

One config per architecture family of `litgpt.config.configs` (configs grouped by what changes
the program: norm and MLP classes, residual layout, grouped-query attention, biases, partial
rotary, sliding windows, soft-capping, extra norms, experts, rope adjustments), shrunk with
`Config.from_name(name, n_layer=2, n_embd=64, ...)` (one sliding and one global layer where the
family has both), random weights; in a child process per config:

- train: a forward and backward at two lengths (cross entropy on the logits): the loss, the
  logits and every parameter's gradient vs eager by fulmen's float64 accuracy rule;
- decode: KV-cache decoding as litgpt's `generate` drives it (`set_kv_cache`, a prefill with
  `input_pos`, then one token at a time): every step's logits, the greedy tokens and the caches;

with compiles and eager calls counted. Output: the table of `tests/sweeps/runner.py`.

    python -m tests.sweeps.litgpt_sweep --jobs 2
    python -m tests.sweeps.litgpt_sweep --types Gemma-2-2b,Qwen3-0.6B
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings

from tests.sweeps.runner import result_line, run_cases

VOCAB = 96


def _signature(c) -> tuple:
    return (c.norm_class_name, c.mlp_class_name, c.parallel_residual, c.shared_attention_norm,
            c.n_query_groups == c.n_head, c.n_query_groups == 1, c.bias, c.attn_bias,
            c.rotary_percentage < 1, c.sliding_window_size is not None,
            c.attention_logit_softcapping is not None, c.final_logit_softcapping is not None,
            c.post_attention_norm, c.post_mlp_norm, c.norm_qk, c.n_expert > 0,
            c.scale_embeddings, c.rope_adjustments is not None, c.rope_indices is not None,
            c.lm_head_bias, c.attention_scores_scalar is not None, c.rope_condense_ratio != 1)


def family_configs() -> list[str]:
    """The first config name of each family (by `_signature`), in litgpt's order."""
    from litgpt.config import Config, configs

    first = {}
    for entry in configs:
        first.setdefault(_signature(Config.from_name(entry["name"])), entry["name"])
    return list(first.values())


def tiny(name: str):
    """litgpt's config `name`, shrunk (two layers: one sliding, one global where it has both)."""
    from litgpt.config import Config

    base = Config.from_name(name)
    groups = base.n_head if base.n_query_groups == base.n_head else \
        1 if base.n_query_groups == 1 else 2
    overrides = dict(n_layer=2, n_embd=64, n_head=4, head_size=16, n_query_groups=min(groups, 4),
                     vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=64,
                     intermediate_size=128)
    if base.n_expert:
        overrides.update(n_expert=4, n_expert_per_token=2, moe_intermediate_size=64)
    if base.sliding_window_size is not None:
        overrides.update(sliding_window_size=8, sliding_window_indices=[1, 0])
    if base.rope_indices is not None:
        overrides.update(rope_indices=[1, 0])
    return Config.from_name(name, **overrides)


def _train(model, call, ids, targets):
    import torch

    model.train()
    model.zero_grad(set_to_none=True)
    logits = call(ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return [loss.detach(), logits.detach(),
            *[p.grad if p.grad is not None else f"no grad: {n}" for n, p in model.named_parameters()]]


def _decode(model, call, prompt, steps: int, tokens=None):
    """Prefill then `steps` single-token calls; feeds `tokens` (eager's) when given."""
    import torch

    model.eval()
    model.set_kv_cache(batch_size=prompt.shape[0], max_seq_length=32,
                       dtype=next(model.parameters()).dtype)
    out, chosen = [], []
    with torch.no_grad():
        logits = call(prompt, input_pos=torch.arange(prompt.shape[1]))
        out.append(logits[:, -1])
        for step in range(steps):
            token = logits[:, -1:].argmax(-1)
            chosen.append(token)
            feed = tokens[step] if tokens is not None else token
            logits = call(feed, input_pos=torch.tensor([prompt.shape[1] + step]))
            out.append(logits[:, -1])
    caches = [b.detach().clone() for n, b in model.named_buffers() if "kv_cache" in n]
    model.clear_kv_cache()
    return out, chosen, caches


def check_config(name: str) -> str:
    """The RESULT line of one litgpt config (the child's work)."""
    import torch
    from litgpt.model import GPT

    import fulmen
    from fulmen.tools.accuracy import assert_accurate, to_float64

    try:
        config = tiny(name)
        torch.manual_seed(0)
        model = GPT(config)
    except Exception as error:
        return result_line("SKIP", f"config/model: {type(error).__name__}: {error}"[:200])
    twin, reference = copy.deepcopy(model), to_float64(copy.deepcopy(model))
    jitted = fulmen.jit(twin)
    notes, wrong, error = [], False, False
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for length in (10, 17):
            ids = torch.randint(0, VOCAB, (2, length), generator=gen)
            targets = torch.randint(0, VOCAB, (2, length), generator=gen)
            want = _train(model, model, ids, targets)
            try:
                got = _train(twin, jitted, ids, targets)
                assert_accurate(got, want, lambda i=ids, t=targets: _train(reference, reference, i, t),
                                what=f"train-{length}")
            except AssertionError as failure:
                wrong = True
                notes.append(str(failure).splitlines()[0][:200])
            except Exception as failure:
                error = True
                notes.append(f"train-{length}: {type(failure).__name__}: {failure}"[:200])
        prompt = torch.randint(0, VOCAB, (2, 6), generator=gen)
        want, tokens, caches = _decode(model, model, prompt, 6)
        try:
            got, got_tokens, got_caches = _decode(twin, jitted, prompt, 6, tokens)
            assert_accurate(got, want, lambda: _decode(reference, reference, prompt, 6, tokens)[0],
                            what="decode logits")
            assert all(torch.equal(a, b) for a, b in zip(got_tokens, tokens)), "decode tokens"
            assert_accurate(got_caches, caches,
                            lambda: _decode(reference, reference, prompt, 6, tokens)[2],
                            what="decode caches")
        except AssertionError as failure:
            wrong = True
            notes.append(str(failure).splitlines()[0][:200])
        except Exception as failure:
            error = True
            notes.append(f"decode: {type(failure).__name__}: {failure}"[:200])
    stats = fulmen.compile_stats(jitted)
    if stats.eager_calls:
        notes += sorted({str(w.message)[:160] for w in caught
                         if str(w.message).startswith("fulmen")})[:2]
    status = "WRONG" if wrong else "ERROR" if error else "OK"
    return result_line(status, "; ".join(notes), compiles=stats.cache_misses,
                       eager_calls=stats.eager_calls)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="", help="comma-separated config names "
                        "(default: one per family)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(check_config(args.one), flush=True)
        return 0
    names = [t for t in args.types.split(",") if t] or family_configs()
    results = run_cases("tests.sweeps.litgpt_sweep", names, [], args.jobs, args.timeout, args.out)
    return 1 if any(r["status"] in ("WRONG", "ERROR") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
