"""End to end: a training step and an inference forward of real models, eager vs fulmen vs
torch.compile, all in the same run, on 1 and 2 threads (issue 21).

Models (tiny configs by default, `--size small` for larger ones; random weights, no downloads):
HF Llama, HF GPT-2, HF BERT and HF T5 (the installed transformers, called with `labels=` and
an attention mask that right-pads one row; T5's decoder inputs come from the labels), litgpt
pythia-14m (its own config, a short sequence), litgpt's Llama architecture at the tiny sizes
(litgpt-llama), 8 x (Linear(16, 16) + ReLU) on a (4, 16) input, and `make demo`'s model (demo:
examples/train_gpt.py's litgpt GPT at its default sizes, one batch of random bytes; not in the
default list).

- training step: `zero_grad`, forward, loss (HF: computed by the model from `labels`; others: a
  cross entropy / mean square on the output), `backward`, `AdamW.step` - the optimizer is eager
  for every callable, only the model is compiled.
- inference: forward under `torch.no_grad()`.

Every callable is warmed up until its codegen regions are hot and their kernels built (and
torch.compile has compiled); then rounds take `--number` steps of each callable in turn and the
median over rounds is reported, so load changes on a shared machine hit every callable alike.
Times are ms per step; ratios below 1 mean fulmen is faster. The table also gives the ratios in
process CPU time (`time.process_time`), which other load on a shared machine disturbs far less
than wall time.

`--steady-heap` runs with glibc's heap kept (`ab.STEADY_HEAP`: no trimming of its top, a fixed mmap
threshold of 32 MiB). By default glibc gives freed memory back to the system and moves its mmap
threshold as blocks are freed, so a large block (pythia-14m's 25 MiB logits, their gradient, the
lm_head and embedding gradients, AdamW's temporaries) comes back as fresh pages that fault on
first touch: 6,000-40,000 page faults per training step, how many depending on the order of
earlier allocations and frees, which differs between eager and fulmen and between runs
(pythia-14m's lm_head weight gradient: 22 ms with no faults, 28-48 ms with 6,288). Eager and
fulmen pay them alike, but not equally often: pythia-14m's training ratio was 0.82-0.86 by
default and 0.98-1.01 with a steady heap in the same session. The steady heap compares the
computations; the default, what a user gets.

`--phases` times each phase of the training step instead (forward and loss, backward, optimizer;
process CPU time, first thread count): where a gap to eager or torch.compile lies. `--profile`
prints `fulmen.profile` of fulmen's training step instead (CPU time): which statements of its
traces the time goes to (`--models demo --profile --steady-heap`).

Run: `python benchmarks/e2e.py [--models llama,gpt2] [--threads 1,2] [--no-compile] [--size small]
[--steady-heap] [--phases | --profile]`
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# `python benchmarks/e2e.py` puts benchmarks/ first on sys.path, not the checkout, so `import
# fulmen` would find the installed (editable) package, which may be another worktree's code:
# time the fulmen this file belongs to
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fulmen  # noqa: E402
from fulmen.executors.codegen import wait_for_kernels  # noqa: E402
from fulmen.jit import JittedModule  # noqa: E402
from fulmen.tools.profile import execution_traces  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZES = {
    "tiny": dict(hidden=64, layers=2, heads=4, inter=256, vocab=1024, batch=2, seq=64),
    "small": dict(hidden=256, layers=4, heads=8, inter=1024, vocab=8192, batch=4, seq=128),
}


@dataclass
class Case:
    """A model and how to call it: `call(fn)` runs one forward and returns the loss."""

    name: str
    model: torch.nn.Module
    call: Callable
    infer: Callable


def _hf_inputs(size: dict, vocab: int):
    ids = torch.randint(3, vocab, (size["batch"], size["seq"]))
    mask = torch.ones_like(ids)
    mask[-1, -size["seq"] // 4:] = 0  # one right-padded row
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _hf_case(name: str, model, size: dict) -> Case:
    ids, mask, labels = _hf_inputs(size, model.config.vocab_size)
    extra = {"use_cache": False} if name != "bert" else {}
    decoder = {"decoder_input_ids": model._shift_right(labels)} if name == "t5" else {}

    def call(fn):
        return fn(input_ids=ids, attention_mask=mask, labels=labels, **extra).loss

    def infer(fn):
        return fn(input_ids=ids, attention_mask=mask, **decoder, **extra).logits

    return Case(name, model, call, infer)


def make_cases(size_name: str, names: list[str]) -> list[Case]:
    import transformers as T

    size = SIZES[size_name]
    h, n, heads, inter, vocab = (size[k] for k in ("hidden", "layers", "heads", "inter", "vocab"))
    factories = {
        "llama": lambda: _hf_case("llama", T.LlamaForCausalLM(T.LlamaConfig(
            hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
            num_key_value_heads=heads // 2, intermediate_size=inter, vocab_size=vocab,
            max_position_embeddings=512)), size),
        "gpt2": lambda: _hf_case("gpt2", T.GPT2LMHeadModel(T.GPT2Config(
            n_embd=h, n_layer=n, n_head=heads, vocab_size=vocab, n_positions=512)), size),
        "bert": lambda: _hf_case("bert", T.BertForMaskedLM(T.BertConfig(
            hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
            intermediate_size=inter, vocab_size=vocab, max_position_embeddings=512)), size),
        "t5": lambda: _hf_case("t5", T.T5ForConditionalGeneration(T.T5Config(
            d_model=h, d_kv=h // heads, d_ff=inter, num_layers=n, num_heads=heads,
            vocab_size=vocab, decoder_start_token_id=0)), size),
        "pythia-14m": lambda: _pythia(size),
        "litgpt-llama": lambda: _litgpt_llama(size),
        "linear-relu": _linear_relu,
        "demo": _demo,
    }
    cases = []
    for name in names:
        torch.manual_seed(0)
        cases.append(factories[name]())
    return cases


def _pythia(size: dict) -> Case:
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config.from_name("pythia-14m")
    model = GPT(config)
    ids = torch.randint(0, config.padded_vocab_size, (size["batch"], size["seq"]))

    def call(fn):
        logits = fn(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))

    return Case("pythia-14m", model, call, lambda fn: fn(ids))


def _litgpt_llama(size: dict) -> Case:
    """litgpt's Llama architecture (RMSNorm, rotary, grouped queries, SwiGLU MLP) at the tiny
    sizes of the HF models."""
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config.from_name(
        "Llama-2-7b-hf", n_layer=size["layers"], n_embd=size["hidden"], n_head=size["heads"],
        n_query_groups=size["heads"] // 2, intermediate_size=size["inter"],
        vocab_size=size["vocab"], padded_vocab_size=size["vocab"], block_size=512)
    model = GPT(config)
    ids = torch.randint(0, config.padded_vocab_size, (size["batch"], size["seq"]))

    def call(fn):
        logits = fn(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))

    return Case("litgpt-llama", model, call, lambda fn: fn(ids))


def _demo() -> Case:
    """`make demo`'s model (examples/train_gpt.py at its default sizes: litgpt's GPT with
    layer norms, a partial rotary and a parallel residual) on one batch of random bytes."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                        "train_gpt.py")
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.make_model(layers=2, width=128, heads=4, context=128)
    ids = torch.randint(0, 256, (8, 129))
    inputs, targets = ids[:, :-1], ids[:, 1:]

    def call(fn):
        logits = fn(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return Case("demo (train_gpt)", model, call, lambda fn: fn(inputs))


def _linear_relu() -> Case:
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(4, 16)
    return Case("8x(Linear+ReLU) 4x16", model, lambda fn: fn(x).pow(2).mean(), lambda fn: fn(x))


def _warm(fn, step, calls: int = 6) -> None:
    for _ in range(calls):
        step()
    if isinstance(fn, JittedModule):
        wait_for_kernels(*execution_traces(fn))
    step()


def step_functions(case: Case):
    """`(train_step, infer_step)` for `case`, each taking the callable to run (the model, or it
    jitted or compiled): a training step (forward, loss, backward, an AdamW step on the
    model's parameters) and a no-grad forward."""
    optimizer = torch.optim.AdamW(case.model.parameters(), lr=1e-4, foreach=True)

    def train_step(fn):
        optimizer.zero_grad(set_to_none=True)
        case.call(fn).backward()
        optimizer.step()

    def infer_step(fn):
        with torch.no_grad():
            case.infer(fn)

    return train_step, infer_step


def _candidates(model, compile_too: bool) -> dict:
    """`{label: callable}`: the model itself (eager), `fulmen.jit` of it and, with
    `compile_too`, `torch.compile` of it, with a fresh dynamo cache."""
    # HF models share one decorated `forward` wrapper (one code object): torch.compile's
    # per-code recompile limit would otherwise be spent by the earlier models (grad mode x
    # threads x train/eval each), and later ones would silently run eagerly
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64
    candidates = {"eager": model, "fulmen": fulmen.jit(model)}
    if compile_too:
        candidates["torch.compile"] = torch.compile(model)
    return candidates


def measure(case: Case, threads_list: list[int], number: int, repeat: int,
            compile_too: bool) -> list[dict]:
    """Rows `{model, mode, threads, eager, fulmen, torch.compile}` in ms per step."""
    model = case.model
    candidates = _candidates(model, compile_too)
    train_step, infer_step = step_functions(case)
    model.eval()
    with torch.no_grad():  # the compiled callables agree with eager before anything is timed
        expected = case.infer(model)
        for label, fn in list(candidates.items()):
            try:
                actual = case.infer(fn)
            except Exception as error:  # torch.compile failing (fulmen failing is an error)
                if label != "torch.compile":
                    raise
                print(f"{case.name} torch.compile failed: {type(error).__name__}: "
                      f"{str(error)[:200]}", flush=True)
                del candidates[label]
                continue
            torch.testing.assert_close(actual, expected, rtol=1e-3, atol=1e-3,
                                       msg=lambda m, label=label: f"{case.name} {label}: {m}")
    rows = []
    for mode, step in (("training step", train_step), ("inference", infer_step)):
        for threads in threads_list:
            torch.set_num_threads(threads)
            model.train(mode == "training step")
            running = dict(candidates)
            for label, fn in candidates.items():
                try:
                    _warm(fn, lambda fn=fn, step=step: step(fn))
                except Exception as error:  # e.g. torch.compile failing: report, go on
                    print(f"{case.name} {mode} {label} failed: {type(error).__name__}: "
                          f"{str(error)[:200]}", flush=True)
                    del running[label]
            times: dict[str, list[float]] = {label: [] for label in running}
            cpu: dict[str, list[float]] = {label: [] for label in running}
            for _ in range(repeat):
                for label, fn in running.items():
                    start, start_cpu = time.perf_counter(), time.process_time()
                    for _ in range(number):
                        step(fn)
                    times[label].append((time.perf_counter() - start) / number)
                    cpu[label].append((time.process_time() - start_cpu) / number)
            row = {"model": case.name, "mode": mode, "threads": threads}
            row.update({label: statistics.median(values) * 1e3 for label, values in times.items()})
            row.update({f"{label} cpu": statistics.median(values) * 1e3
                        for label, values in cpu.items()})
            rows.append(row)
            print(row, flush=True)
    model.eval()
    return rows


def phase_rows(case: Case, threads: int, repeat: int, compile_too: bool) -> list[dict]:
    """Process CPU ms per training-step phase (forward and loss, backward, optimizer step) of
    eager, fulmen and torch.compile, medians over `repeat` rounds taking one step of each in
    turn: which phase a gap between them lies in (issue 21's attribution)."""
    torch.set_num_threads(threads)
    model = case.model
    candidates = _candidates(model, compile_too)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    phases = ("forward+loss", "backward", "optimizer")
    times = {label: {phase: [] for phase in phases} for label in candidates}

    def step(fn, record=None):
        marks = [time.process_time()]
        optimizer.zero_grad(set_to_none=True)
        loss = case.call(fn)
        marks.append(time.process_time())
        loss.backward()
        marks.append(time.process_time())
        optimizer.step()
        marks.append(time.process_time())
        if record is not None:
            for phase, start, end in zip(phases, marks, marks[1:]):
                record[phase].append(end - start)

    model.train()
    for fn in candidates.values():
        _warm(fn, lambda fn=fn: step(fn))
    for _ in range(repeat):
        for label, fn in candidates.items():
            step(fn, times[label])
    model.eval()
    return [{"model": case.name, "callable": label, "threads": threads,
             **{phase: statistics.median(values) * 1e3 for phase, values in record.items()}}
            for label, record in times.items()]


def profile_case(case: Case, threads: int, steps: int) -> None:
    """Print `fulmen.profile` of fulmen's training step on `case` (process CPU time, medians of
    `steps` steps): the statements of its forward and backward traces, by the traces' names,
    behind a gap that `--phases` finds (the loss, autograd engine and optimizer are in its host
    overhead row)."""
    torch.set_num_threads(threads)
    jfn = fulmen.jit(case.model)
    train_step, _ = step_functions(case)
    case.model.train()
    _warm(jfn, lambda: train_step(jfn))
    print(f"## {case.name}\n")
    print(fulmen.profile(jfn, step=lambda: train_step(jfn), clock="cpu", steps=steps), "\n")
    case.model.eval()


def print_phases(rows: list[dict]) -> None:
    """The table of `phase_rows`."""
    print("| model | callable | threads | forward+loss CPU ms | backward CPU ms "
          "| optimizer CPU ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['model']} | {row['callable']} | {row['threads']} "
              f"| {row['forward+loss']:.3f} | {row['backward']:.3f} | {row['optimizer']:.3f} |")


def _ratio(row: dict, label: str, suffix: str = "") -> str:
    value, base = row.get(f"fulmen{suffix}"), row.get(f"{label}{suffix}")
    return f"{value / base:.2f}" if value and base else "-"


def print_table(rows: list[dict]) -> None:
    """Wall-clock ms per step and ratios; then the same ratios in process CPU time, which a
    loaded shared machine disturbs far less (with 1 thread, CPU time is the work done; with
    more threads it sums them)."""
    print("| model | mode | threads | eager ms | fulmen ms | torch.compile ms | fulmen / eager "
          "| fulmen / torch.compile | CPU time: fulmen / eager | CPU time: fulmen / "
          "torch.compile |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        compiled = row.get("torch.compile")
        fulmen_ms = row.get("fulmen", float("nan"))
        compiled_ms = f"{compiled:.3f}" if compiled else "-"
        print(f"| {row['model']} | {row['mode']} | {row['threads']} | {row['eager']:.3f} "
              f"| {fulmen_ms:.3f} | {compiled_ms} | {_ratio(row, 'eager')} "
              f"| {_ratio(row, 'torch.compile')} | {_ratio(row, 'eager', ' cpu')} "
              f"| {_ratio(row, 'torch.compile', ' cpu')} |")


MODELS = ("llama", "gpt2", "bert", "t5", "pythia-14m", "litgpt-llama", "linear-relu")


def main() -> None:
    """Parse the arguments, measure every model, print the table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}, demo")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--number", type=int, default=3, help="steps per timed sample")
    parser.add_argument("--repeat", type=int, default=9, help="timed rounds (median)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--phases", action="store_true",
                        help="instead: CPU time per training-step phase (forward and loss, "
                             "backward, optimizer) of each callable, first thread count only")
    parser.add_argument("--profile", action="store_true",
                        help="instead: fulmen.profile of fulmen's training step (CPU time, "
                             "first thread count): its trace statements, slowest first")
    parser.add_argument("--steady-heap", action="store_true",
                        help="keep glibc's heap: no page faults from memory given back")
    opts = parser.parse_args()
    from ab import STEADY_HEAP  # benchmarks/ is the script directory

    if opts.steady_heap and any(os.environ.get(k) != v for k, v in STEADY_HEAP.items()):
        # glibc reads them at process start: run again in a process that has them
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **STEADY_HEAP})
    threads_list = [int(t) for t in opts.threads.split(",")]
    initial_threads = torch.get_num_threads()
    start = time.perf_counter()
    rows = []
    for case in make_cases(opts.size, opts.models.split(",")):
        if opts.profile:
            profile_case(case, threads_list[0], opts.repeat * opts.number)
        elif opts.phases:
            rows += phase_rows(case, threads_list[0], opts.repeat * opts.number,
                               not opts.no_compile)
        else:
            rows += measure(case, threads_list, opts.number, opts.repeat, not opts.no_compile)
    torch.set_num_threads(initial_threads)
    if opts.profile:
        return
    print(f"End to end, {opts.size} configs: {platform.machine()}, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f} at the end, "
          f"{time.perf_counter() - start:.0f} s; medians of {opts.repeat} alternating rounds of "
          f"{opts.number} steps; fulmen from {Path(fulmen.__file__).parent}"
          f"{'; steady heap' if opts.steady_heap else ''}\n")
    print_phases(rows) if opts.phases else print_table(rows)


if __name__ == "__main__":
    main()
