"""Train a small GPT on real text with fulmen, and check it against eager PyTorch.

The text is the Python standard library's own source (found with `sysconfig`, so every machine
has it), tokenised by bytes. The model is litgpt's GPT with a tiny config. The script prints the
forward execution trace and the backward trace, trains with a progress bar, compares the first
steps' losses with an eager run from the same seed, times both models' steps taking turns on
the same batches, and saves a loss plot.

    python examples/train_gpt.py --steps 200 --executors torch
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sysconfig
import time

import torch
import torch.nn.functional as F

import fulmen


def load_text(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's .py files, up to `max_bytes`, as an int64 tensor."""
    stdlib = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(path, "rb") as handle:
            data = handle.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def make_model(layers: int, width: int, heads: int, context: int):
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(block_size=context, vocab_size=256, padded_vocab_size=256, n_layer=layers,
                    n_head=heads, n_embd=width, rotary_percentage=0.25, parallel_residual=True,
                    bias=True, norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP")
    return GPT(config)


def batches(tokens: torch.Tensor, batch: int, context: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - context - 1, (batch,), generator=generator)
        rows = torch.stack([tokens[s: s + context + 1] for s in starts.tolist()])
        yield rows[:, :-1], rows[:, 1:]


class Trainer:
    """One model with its AdamW optimizer; `step` runs one timed training step."""

    def __init__(self, model, lr: float):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
        """Forward, cross-entropy, backward and optimizer step on one batch of (batch, context)
        int64 tokens. Returns (loss, wall time of the step in seconds)."""
        start = time.perf_counter()
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        seconds = time.perf_counter() - start
        return loss.item(), seconds


def train(trainer: Trainer, steps: int, data, progress: bool, label: str):
    losses, times = [], []
    iterator = range(steps)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = iterator = tqdm(iterator, desc=label, unit="step")
    for _ in iterator:
        inputs, targets = next(data)
        loss, seconds = trainer.step(inputs, targets)
        losses.append(loss)
        times.append(seconds)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{inputs.numel() / seconds:,.0f}")
    return losses, times


def interleaved_times(trainers: list[Trainer], data, rounds: int) -> list[list[float]]:
    """Step times in seconds of each trainer over `rounds` batches, the trainers taking turns on
    each batch, so that every one of them is timed under the same machine load."""
    times: list[list[float]] = [[] for _ in trainers]
    for _ in range(rounds):
        inputs, targets = next(data)
        for trainer, record in zip(trainers, times):
            record.append(trainer.step(inputs, targets)[1])
    return times


def print_head(title: str, source: str, lines: int) -> None:
    """The start of a printed trace, without the block of input type comments."""
    body = source.splitlines()
    start = next(i for i, line in enumerate(body) if line.startswith("def "))
    end = start + 1
    while end < len(body) and (body[end].startswith('  # ') and '"' in body[end] or not body[end]):
        end += 1
    shown = body[: start + 1] + [f"  # ... {end - start - 1} input type comments ..."] + \
        body[end: end + lines]
    print(f"\n{'=' * 20} {title} ({len(body)} lines; the first {lines} statements' lines)")
    print("\n".join(shown))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--check-steps", type=int, default=10,
                        help="steps also run eagerly to compare losses and time")
    parser.add_argument("--timed-steps", type=int, default=30,
                        help="steps timed at the end, eager and fulmen taking turns")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--executors", default=None,
                        help="comma-separated priority list, e.g. codegen,torch "
                             "(default: codegen,torch when codegen is available)")
    parser.add_argument("--plot", default="loss.png")
    parser.add_argument("--trace-lines", type=int, default=40)
    opts = parser.parse_args()

    if opts.executors:
        executors = opts.executors.split(",")
    else:
        executors = ["torch"]
        try:
            fulmen.get_executor("codegen")
            executors = ["codegen", "torch"]
        except KeyError:
            pass
    tokens = load_text(4_000_000)
    print(f"text: {len(tokens):,} bytes of the standard library; executors: {executors}")

    torch.manual_seed(0)
    model = make_model(opts.layers, opts.width, opts.heads, opts.context)
    eager_model = make_model(opts.layers, opts.width, opts.heads, opts.context)
    eager_model.load_state_dict(model.state_dict())
    jmodel = fulmen.jit(model, executors=executors)
    print(f"model: litgpt GPT, {sum(p.numel() for p in model.parameters()):,} parameters")

    eager, compiled = Trainer(eager_model, opts.lr), Trainer(jmodel, opts.lr)
    eager_losses, _ = train(eager, opts.check_steps, batches(tokens, opts.batch, opts.context, 1),
                            False, "eager")
    losses, times = train(compiled, opts.steps, batches(tokens, opts.batch, opts.context, 1),
                          True, "fulmen")
    eager_times, fulmen_times = interleaved_times(
        [eager, compiled], batches(tokens, opts.batch, opts.context, 2), opts.timed_steps)

    print_head("forward execution trace", str(fulmen.last_traces(jmodel)[-1]), opts.trace_lines)
    print_head("backward trace", str(fulmen.last_backward_traces(jmodel)[-1]), opts.trace_lines)

    checked = min(opts.check_steps, len(losses))
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[:checked], eager_losses[:checked]))
    print(f"\nfirst {checked} losses, fulmen vs eager (same seed): worst relative difference "
          f"{worst:.2e} -> {'agree' if worst < 1e-3 else 'DISAGREE'}")
    # both warmed up (eager by its checked steps, fulmen by its training), then timed in turns
    fulmen_ms = 1e3 * statistics.median(fulmen_times)
    eager_ms = 1e3 * statistics.median(eager_times)
    print(f"time per step (median of {opts.timed_steps} steps each, taking turns): fulmen "
          f"{fulmen_ms:.1f} ms, eager {eager_ms:.1f} ms (ratio {fulmen_ms / eager_ms:.2f}); first "
          f"fulmen step (traces and compiles) {times[0]:.2f} s")
    print(f"loss: {losses[0]:.3f} -> {sum(losses[-10:]) / len(losses[-10:]):.3f} "
          f"(mean of the last 10 steps)")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(6, 3.5))
        axis.plot(losses, label="fulmen")
        axis.plot(eager_losses, "--", label="eager (check)")
        axis.set_xlabel("step")
        axis.set_ylabel("cross-entropy")
        axis.legend()
        figure.tight_layout()
        figure.savefig(opts.plot, dpi=100)
        print(f"loss plot: {opts.plot}")
    except ImportError:
        print("matplotlib is not installed: no plot")
    if worst >= 1e-3:
        raise SystemExit("fulmen and eager losses disagree")


if __name__ == "__main__":
    main()
