"""The sweep's checks for vision and audio heads (`hf_sweep --mapping image,segment,audio,ctc`).

Inputs come from the config: `pixel_values` of `num_channels` x `image_size` (of the vision
sub-config where there is one), a waveform `input_values` with a right-padded attention mask,
spectrogram `input_features` (`num_mel_bins` x twice `max_source_positions` frames, or frames x
`feature_size` with a right-padded attention mask), ids for a classifier of pixel ids (ImageGPT). Labels: a class per row
(image/audio classification), a class per pixel with a band of `ignore 255` (segmentation), four
tokens per row that are not the blank/pad (CTC). The checks:

- train: train() mode, a batch of 2 with labels, seeded RNG: the loss, the logits, every
  parameter's gradient and every buffer after the step (BatchNorm's running statistics);
- train-mode: train() mode under no_grad, a batch of 3: the logits and the buffers;
- eval: eval() mode under no_grad, a batch of 3; eval-other: a batch of 1 at three quarters of
  the resolution / length (where eager can run it);
- train-mode-channels-last: train() mode under no_grad, a batch of 2 of channels-last images;
- train-channels-last-model (image models): the train check of a channels-last copy of the
  model (its own jitted twin) on channels-last images, run first.

Every tensor's strides (on dimensions of size other than 1) must be eager's too. The float64
reference of each check is a copy of the model as it stands before the check
(running statistics change in train mode), built only when a value is not tightly equal.
"""

from __future__ import annotations

import copy

TASKS = ("image", "segment", "audio", "ctc")
IMAGE = 64       # image side when the config names none
WAVE = 3200      # waveform samples (10 frames of a 320-sample conv feature extractor)
FRAMES = 64      # spectrogram frames when the config fixes none
LABELS = 4       # CTC targets per row


def _vision(config):
    return getattr(config, "vision_config", None) or config


def _side(config) -> tuple[int, int]:
    size = getattr(_vision(config), "image_size", None) or IMAGE
    if isinstance(size, dict):
        size = size.get("height", IMAGE), size.get("width", IMAGE)
    return tuple(size[:2]) if isinstance(size, (list, tuple)) else (size, size)


# feature-vector widths a model's feature extractor stacks (its frames, delta-expanded and
# stacked in pairs: 4 mel vectors a frame), keyed by model type
FEATURE_STACK = {"granite_speech5_ctc": 4}


def _feature_width(config) -> int:
    """The width of one frame of `input_features` of frames x features: the feature projection's
    input (W2V-BERT's stacked frames), else the mel bins or feature size of the config or of its
    encoder sub-config (LASR's), times what the feature extractor stacks."""
    if getattr(config, "feature_projection_input_dim", None):
        return config.feature_projection_input_dim
    encoder = getattr(config, "encoder_config", None)
    width = getattr(config, "feature_size", None) or getattr(config, "num_mel_bins", None) \
        or getattr(encoder, "num_mel_bins", None) or 80
    return width * FEATURE_STACK.get(getattr(config, "model_type", None), 1)


def _generator(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


def _layout(got: list, want: list) -> str:
    """The first value whose strides (on dimensions of size other than 1) differ from eager's."""
    import torch

    for index, (a, e) in enumerate(zip(got, want)):
        if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor):
            strides = [tuple(s for n, s in zip(t.shape, t.stride()) if n != 1) for t in (a, e)]
            if strides[0] != strides[1]:
                return f"value {index} of shape {tuple(e.shape)}: strides {a.stride()}, " \
                       f"eager's {e.stride()}"
    return ""


class MediaCase:
    """One vision/audio model type: eager `model`, its jitted twin, the inputs of each check."""

    def __init__(self, model, config, task: str, channels_last: bool = False):
        import torch

        import fulmen

        if channels_last:  # weights (and, in `train`, images) channels-last
            model = copy.deepcopy(model).to(memory_format=torch.channels_last)
        self.model, self.config, self.task = model, config, task
        self.channels_last = channels_last
        self.twin = copy.deepcopy(model)
        self.jitted = fulmen.jit(self.twin)
        self.input_name = model.main_input_name

    # ---- inputs
    def _main_input(self, batch: int, scale: float, seed: int) -> dict:
        import torch

        g = _generator(seed)
        name, config = self.input_name, self.config
        if name == "input_ids":
            vocab = getattr(config, "vocab_size", None) or 100
            return dict(input_ids=torch.randint(0, min(vocab, 100), (batch, int(16 * scale)),
                                                generator=g))
        if name == "input_features":
            mels = getattr(config, "num_mel_bins", None)
            positions = getattr(config, "max_source_positions", None)
            if mels and positions:  # (batch, mel bins, frames) the encoder's positions fix
                return dict(input_features=torch.randn(batch, mels, 2 * positions, generator=g))
            width = _feature_width(config)
            frames = int(FRAMES * scale)
            mask = torch.ones(batch, frames, dtype=torch.long)
            mask[-1, frames * 3 // 4:] = 0
            return dict(input_features=torch.randn(batch, frames, width, generator=g),
                        attention_mask=mask)
        if name == "input_values" and getattr(config, "num_mel_bins", None) \
                and getattr(config, "max_length", None):  # a spectrogram of fixed length
            return dict(input_values=torch.randn(batch, config.max_length, config.num_mel_bins,
                                                 generator=g))
        if name == "input_values":
            length = int(WAVE * scale)
            mask = torch.ones(batch, length, dtype=torch.long)
            mask[-1, length * 3 // 4:] = 0
            return dict(input_values=torch.randn(batch, length, generator=g), attention_mask=mask)
        channels = getattr(_vision(config), "num_channels", None) or 3
        height, width = (int(s * scale) for s in _side(config))
        return {name: torch.randn(batch, channels, height, width, generator=g)}

    def _labels(self, batch: int, inputs: dict, seed: int):
        import torch

        g = _generator(seed)
        if self.task == "ctc":
            vocab = min(getattr(self.config, "vocab_size", None) or 32, 100)
            pad = getattr(self.config, "pad_token_id", None)
            labels = torch.randint(1, vocab, (batch, LABELS), generator=g)
            return labels.masked_fill(labels == pad, 1 if pad != 1 else 2)
        classes = max(getattr(self.config, "num_labels", 2), 2)
        if self.task == "segment":
            _, _, height, width = inputs[self.input_name].shape
            labels = torch.randint(0, classes, (batch, height, width), generator=g)
            labels[:, : height // 8] = 255  # ignored (semantic_loss_ignore_index)
            return labels
        return torch.randint(0, classes, (batch,), generator=g)

    # ---- checks: each returns (eager's values, a function giving fulmen's, a reference)
    def _compare(self, inputs: dict, train: bool, grad: bool):
        import torch

        from fulmen.tools.accuracy import to_float64

        def run(call, module, inputs):
            module.train(train)
            module.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            with torch.set_grad_enabled(grad):
                out = call(**inputs)
            logits = out.logits if hasattr(out, "logits") else out[0]
            values = [logits.detach()]
            if grad:
                out.loss.backward()
                values = [out.loss.detach(), *values]
                values += [p.grad if p.grad is not None else f"no grad: {name}"
                           for name, p in module.named_parameters()]
            return values + [b.detach().clone() for b in module.buffers()]

        before = copy.deepcopy(self.model)
        try:
            want = run(self.model, self.model, inputs)
        except Exception:  # eager failed (the check is skipped) after updating buffers, maybe
            self.model.load_state_dict(before.state_dict())
            raise

        def reference():
            model = to_float64(before)
            return run(model, model, to_float64(inputs))

        return want, lambda: run(self.jitted, self.twin, inputs), reference, _layout

    def train(self):
        import torch

        inputs = self._main_input(2, 1.0, 1)
        if self.channels_last:
            inputs = {k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v
                      for k, v in inputs.items()}
        return self._compare(dict(inputs, labels=self._labels(2, inputs, 2)), True, True)

    def forward(self, train: bool, batch: int, scale: float = 1.0, channels_last: bool = False):
        import torch

        inputs = self._main_input(batch, scale, 3 + batch)
        if channels_last:
            inputs = {k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v
                      for k, v in inputs.items()}
        return self._compare(inputs, train, False)

    def checks(self) -> list:
        """(name, check) pairs, in the order they run; an image model's also trains a
        channels-last copy of itself (a twin of its own) on channels-last images."""
        extra = []
        if self.task in ("image", "segment") and self.input_name == "pixel_values":
            twin = MediaCase(self.model, self.config, self.task, channels_last=True)
            extra = [("train-channels-last-model", twin.train)]
        return extra + [("train", self.train),
                ("train-mode", lambda: self.forward(True, 3)),
                ("eval", lambda: self.forward(False, 3)),
                ("eval-other", lambda: self.forward(False, 1, 0.75)),
                ("train-mode-channels-last", lambda: self.forward(True, 2, 1.0, True))]
