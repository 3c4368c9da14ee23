"""Sweep of transformers' auto mappings through `fulmen.jit` (long-running; not part of `make test`).

For every model type of a mapping (default: the causal LM and seq2seq LM mappings) it builds a
tiny config with random weights (`tests/sweeps/tiny_config.py`; a type whose config cannot be
built, whose model fails eagerly or has more than `--max-params` parameters is skipped with the
reason) and, in a child process with a timeout, compares `fulmen.jit(model)` with eager:

- train: one step with labels on a right-padded batch (attention_mask): the loss, the logits and
  every parameter's gradient;
- eval: logits under `no_grad` at two lengths (right padding);
- generate: greedy and sampled (fixed seed) `generate` of a left-padded batch with `use_cache`:
  the tokens equal eager's;

(`--mapping masked` / `classify`, the masked LM and sequence classification mappings: train with
labels on every third real token / one label per row, then eval right-padded at 9 and
left-padded at 14; a classifier's config without a pad token gets one, each row ends with the
eos token when the config has one; `--mapping image` / `segment` / `audio` / `ctc`, the image
classification, semantic segmentation, audio classification and CTC mappings: the checks of
`tests/sweeps/hf_media.py`, in train() and eval() modes at two batch sizes and resolutions; a
causal draft model reading a target's `shared_kv_states`: the drafting loop of
`tests/sweeps/hf_assistant.py`)

counting compiles (`compile_stats(...).cache_misses`) and calls that ran eagerly
(`eager_calls`). Values are compared with fulmen's float64 accuracy rule
(`fulmen/tools/accuracy.py`: a result tightly equal to eager's passes, otherwise it must be as
close to a float64 run of the same model as eager's is). A type is WRONG when any value or token
differs, ERROR when fulmen raised where eager did not, SKIP when eager cannot run it at all.

    python -m tests.sweeps.hf_sweep                           # both mappings, one job
    python -m tests.sweeps.hf_sweep --types gpt2,bart --jobs 2
    python -m tests.sweeps.hf_sweep --mapping causal --out /tmp/causal.md
    python -m tests.sweeps.hf_sweep --mapping masked,classify --types bert,gpt2
    python -m tests.sweeps.hf_sweep --mapping image,segment,audio,ctc --types resnet,wav2vec2
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import traceback
import warnings

from tests.sweeps.hf_assistant import AssistantCase, takes_shared_kv
from tests.sweeps.hf_media import TASKS as MEDIA_TASKS
from tests.sweeps.hf_media import MediaCase
from tests.sweeps.runner import result_line, run_cases

MAPPINGS = {"causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
            "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
            "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
            "classify": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
            "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
            "segment": "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES",
            "audio": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
            "ctc": "MODEL_FOR_CTC_MAPPING_NAMES"}
# the checks a mapping's models get: "lm" (train, eval, generate), "masked" (masked-token labels;
# train, eval right and left padded), "classify" (a label per row; the same checks), and the
# vision/audio tasks of `tests/sweeps/hf_media.py`
TASKS = {"masked": "masked", "classify": "classify", "image": "image", "segment": "segment",
         "audio": "audio", "ctc": "ctc"}
GENERATED = 8  # new tokens per generate call


def mapping_names(mapping: str) -> dict:
    """The model-type -> class-name dict of `mapping` (a key of MAPPINGS or an attribute name of
    `transformers.models.auto.modeling_auto`)."""
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, MAPPINGS.get(mapping, mapping)))


def _ids(shape, seed: int, low: int, high: int):
    import torch

    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed))


def _padded(length: int, seed: int, vocab: int, pad: int, side: str):
    """A batch of two rows of `length` ids; the second padded by a quarter on `side`."""
    ids = _ids((2, length), seed, 3, min(vocab, 100))
    mask = ids.new_ones(ids.shape)
    cut = max(1, length // 4)
    if side == "right":
        mask[1, length - cut:] = 0
    else:
        mask[1, :cut] = 0
    return ids.masked_fill(mask == 0, pad), mask


def _logits(out):
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[0] if isinstance(logits, (tuple, list)) else logits


class Case:
    """One model type: eager `model`, its jitted twin and a lazily built float64 copy."""

    def __init__(self, model, seq2seq: bool, vocab: int, pad: int, task: str = "lm",
                 eos: int | None = None):
        import fulmen

        self.model, self.seq2seq, self.vocab, self.pad = model, seq2seq, vocab, pad
        self.task, self.eos = task, eos
        # a decoder of audio codes (MusicGen) reads `num_codebooks` rows of ids per sequence,
        # (batch * codebooks, length), and its labels as (batch, length, codebooks)
        self.codebooks = getattr(model.config, "num_codebooks", None) if task == "lm" else None
        self.pristine = copy.deepcopy(model)
        self.twin = copy.deepcopy(model)
        self.jitted = fulmen.jit(self.twin)
        self._reference = None

    def reference(self):
        from fulmen.tools.accuracy import to_float64

        if self._reference is None:
            self._reference = to_float64(copy.deepcopy(self.pristine))
        return self._reference

    # ---- the inputs of each check
    def _text(self, length: int, seed: int, side: str):
        """Ids and mask; for classification each row's last real token is `eos` (encoder-decoder
        classifiers pool at it and need one per row)."""
        ids, mask = _padded(length, seed, self.vocab, self.pad, side)
        if self.task == "classify" and self.eos is not None:
            last = mask.cumsum(1).argmax(1) if side == "right" else ids.new_full((2,), length - 1)
            ids[ids.new_tensor([0, 1]), last] = self.eos
        return ids, mask

    def _codes(self, ids):
        """`ids` (batch, length) as the (batch * codebooks, length) rows of a codebook decoder:
        the row's ids, shifted within the vocabulary per codebook."""
        if not self.codebooks:
            return ids
        shift = ids.new_tensor(range(self.codebooks)).view(1, -1, 1)
        low = min(self.vocab, 100)
        codes = (ids.unsqueeze(1) - 3 + 7 * shift) % (low - 3) + 3
        return codes.masked_fill(ids.unsqueeze(1) == self.pad, self.pad).flatten(0, 1)

    def train_inputs(self):
        ids, mask = self._text(12, 1, "right")
        if self.task == "classify":
            return dict(input_ids=ids, attention_mask=mask, labels=ids.new_tensor([1, 0]))
        if self.task == "masked":  # every third real token is predicted
            keep = (mask == 1) & (ids.new_tensor(range(12)) % 3 == 0)
            return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(~keep, -100))
        if self.seq2seq:
            labels, lmask = _padded(7, 2, self.vocab, self.pad, "right")
            labels = labels.masked_fill(lmask == 0, -100)
        else:
            labels = ids.masked_fill(mask == 0, -100)
        if self.codebooks:
            codes = self._codes(ids)
            labels = codes.view(2, self.codebooks, -1).transpose(1, 2)
            return dict(input_ids=codes, attention_mask=mask,
                        labels=labels.masked_fill(mask.unsqueeze(-1) == 0, -100))
        return dict(input_ids=ids, attention_mask=mask, labels=labels)

    def eval_inputs(self, length: int, side: str = "right"):
        ids, mask = self._text(length, 10 + length, side)
        inputs = dict(input_ids=self._codes(ids), attention_mask=mask)
        if self.seq2seq and self.task == "lm":
            inputs["decoder_input_ids"] = _ids((2, length // 2), 3, 3, min(self.vocab, 100))
        return inputs

    def generate_inputs(self, sample: bool):
        ids, mask = _padded(6, 4, self.vocab, self.pad, "left")
        extra = dict(num_return_sequences=1) if self.codebooks else {}  # MusicGen's generate
        return dict(input_ids=self._codes(ids), attention_mask=mask, max_new_tokens=GENERATED,
                    do_sample=sample, pad_token_id=self.pad, use_cache=True, **extra)

    # ---- the checks: each returns (eager's values, a function giving fulmen's, a reference)
    def train(self):
        inputs = self.train_inputs()

        def step(call, module, inputs):
            import torch

            module.train()
            module.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            out = call(**inputs)
            out.loss.backward()
            grads = [p.grad if p.grad is not None else f"no grad: {name}"
                     for name, p in module.named_parameters()]
            return [out.loss.detach(), _logits(out).detach(), *grads]

        from fulmen.tools.accuracy import to_float64

        want = step(self.model, self.model, inputs)
        return (want, lambda: step(self.jitted, self.twin, inputs),
                lambda: step(self.reference(), self.reference(), to_float64(inputs)))

    def eval(self, length: int, side: str = "right"):
        import torch

        inputs = self.eval_inputs(length, side)

        def run(call, module):
            module.eval()
            with torch.no_grad():
                return _logits(call(**inputs))

        want = run(self.model, self.model)
        return (want, lambda: run(self.jitted, self.twin),
                lambda: run(self.reference(), self.reference()))

    def generate(self, sample: bool):
        import torch

        kwargs = self.generate_inputs(sample)

        def run(call, module):
            module.eval()
            torch.manual_seed(1)
            return call.generate(**kwargs)

        return run(self.model, self.model), lambda: run(self.jitted, self.twin), None


def _short(error: BaseException) -> str:
    """The error's type and first line, and its cause's where the error only wraps it (a
    config's validator)."""
    text = f"{type(error).__name__}: {error}".splitlines()
    cause = error.__cause__
    if cause is not None and text and text[0].rstrip().endswith(":"):
        text = [f"{text[0]} {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"]
    return text[0][:200] if text else type(error).__name__


def _check(name: str, make) -> tuple[str, str]:
    """Run one check: ('eager', why) when eager fails, ('error', why) when fulmen raises,
    ('wrong', what) when a value differs, ('ok', ''). `make` gives eager's values, a function
    giving fulmen's and the float64 reference (None: compared exactly), and may add a fourth, a
    function of (fulmen's, eager's) naming a layout that differs ('' when none does)."""
    import torch

    from fulmen.tools.accuracy import assert_accurate

    try:
        want, got_fn, reference, *layout = make()
    except Exception as error:  # eager cannot run this check
        return "eager", _short(error)
    try:
        got = got_fn()
    except Exception as error:
        if os.environ.get("SWEEP_TRACEBACK"):
            traceback.print_exc()
        return "error", _short(error)
    try:
        if reference is None:  # tokens
            if not torch.equal(got, want):
                return "wrong", f"tokens {got.tolist()} vs eager's {want.tolist()}"
        else:
            assert_accurate(got, want, reference, what=name)
    except AssertionError as error:
        return "wrong", str(error).splitlines()[0][:200]
    differs = layout[0](got, want) if layout else ""
    return ("wrong", differs) if differs else ("ok", "")


def _built(cls, config, mapping: str):
    """`cls(config)`; a causal LM head that refuses a config without `is_decoder` (Reformer) is
    built with it set, as its users are told to."""
    import torch

    try:
        return cls(config)
    except (AssertionError, ValueError) as error:
        if mapping != "causal" or "is_decoder" not in str(error) or config.is_decoder:
            raise
    config.is_decoder = True
    torch.manual_seed(0)
    return cls(config)


def check_type(model_type: str, mapping: str, max_params: float) -> str:
    """The RESULT line of one model type (the child's work)."""
    import torch

    from tests.sweeps.tiny_config import config_for, model_class, text_vocab, tiny_config

    class_name = mapping_names(mapping)[model_type]
    try:
        cls = model_class(class_name)
        config = config_for(cls, tiny_config(model_type))
        torch.manual_seed(0)
        model = _built(cls, config, mapping)
    except Exception as error:
        return result_line("SKIP", f"config/model: {_short(error)}")
    params = sum(p.numel() for p in model.parameters())
    if params > max_params:
        return result_line("SKIP", f"{params / 1e6:.1f}M parameters")
    task = TASKS.get(mapping, "lm")
    if task == "lm" and takes_shared_kv(model):  # a draft model (`tests/sweeps/hf_assistant.py`)
        case = AssistantCase(model, config)
        return _outcome(case.jitted, case.checks())
    if task in MEDIA_TASKS:
        case = MediaCase(model, config, task)
        return _outcome(case.jitted, case.checks())
    text = config.get_text_config(decoder=True)
    pad = getattr(text, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < text_vocab(config) else 0
    if task == "classify" and getattr(text, "pad_token_id", None) is None:
        text.pad_token_id = pad  # batched classification needs one (as its users set it)
    eos = getattr(text, "eos_token_id", None)
    eos = eos if isinstance(eos, int) and 0 <= eos < text_vocab(config) else None
    case = Case(model, bool(getattr(config, "is_encoder_decoder", False)), text_vocab(config), pad,
                task, eos)
    checks = [("train", case.train), ("eval-9", lambda: case.eval(9))]
    if task == "lm":
        checks += [("eval-14", lambda: case.eval(14)),
                   ("generate-greedy", lambda: case.generate(False)),
                   ("generate-sampled", lambda: case.generate(True))]
    else:
        checks += [("eval-14-left", lambda: case.eval(14, "left"))]
    return _outcome(case.jitted, checks)


def _outcome(jitted, checks) -> str:
    """Run `checks` ((name, make) pairs) and give the RESULT line: the status, the notes, the
    compiles and eager calls of `jitted`."""
    import fulmen

    outcomes = {}
    fallbacks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, make in checks:
            outcomes[name] = _check(name, make)
    fallbacks = sorted({str(w.message)[:160] for w in caught if str(w.message).startswith("fulmen")})
    stats = fulmen.compile_stats(jitted)
    counts = dict(compiles=stats.cache_misses, eager_calls=stats.eager_calls)
    kinds = [kind for kind, _ in outcomes.values()]
    notes = [f"{name}: {why}" for name, (kind, why) in outcomes.items() if kind != "ok"]
    if stats.eager_calls:
        notes += [f"fallback: {text}" for text in fallbacks[:2]]
    if "wrong" in kinds:
        status = "WRONG"
    elif "error" in kinds:
        status = "ERROR"
    elif all(kind == "eager" for kind in kinds):
        status = "SKIP"
    else:
        status = "OK"
    return result_line(status, "; ".join(notes), **counts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mapping", default="causal,seq2seq",
                        help="comma-separated: causal, seq2seq, masked, classify, image, segment, "
                             "audio, ctc, or a "
                             "*_MAPPING_NAMES attribute (checked as a language model)")
    parser.add_argument("--types", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per type")
    parser.add_argument("--max-params", type=float, default=3e6)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        warnings.filterwarnings("ignore", category=FutureWarning)
        print(check_type(args.one, args.mapping, args.max_params), flush=True)
        return 0
    wanted = [t for t in args.types.split(",") if t]
    failed = False
    for mapping in args.mapping.split(","):
        names = mapping_names(mapping)
        types = [t for t in names if not wanted or t in wanted]
        if not types:
            continue
        print(f"\n## {mapping} ({len(types)} types)\n", flush=True)
        out = f"{args.out}.{mapping}" if args.out and "," in args.mapping else args.out
        results = run_cases("tests.sweeps.hf_sweep", types,
                            ["--mapping", mapping, "--max-params", str(args.max_params)],
                            args.jobs, args.timeout, out)
        failed |= any(r["status"] in ("WRONG", "ERROR") for r in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
