"""The sweep's checks for draft ("assistant") models that read the target model's keys and values
(`hf_sweep --mapping causal` on a class whose forward takes `shared_kv_states`: Gemma-4's
assistants).

Such a model is never called with ids: transformers' assisted generation
(`generation/candidate_generator.py`) calls it, under `no_grad` and with `use_cache=False`, once
per drafted token with `inputs_embeds` (the target's embedding of the last token next to the
target's last hidden state: twice `backbone_hidden_size` wide, one position), the target's 2-D
`attention_mask`, `position_ids` of that one position and `shared_kv_states`: per attention kind,
the keys and values of the target's last layer of that kind, (batch, key/value heads, length,
head size). Here the keys and values are random, of the shapes the model's own attention layers
of each kind have; the drafting loop feeds each step's argmax token's embedding and the returned
`last_hidden_state` to the next step, as transformers does.

- draft-6 / draft-9: four drafting steps over 6 and 9 target positions, a left-padded batch of
  2: the logits and the last hidden states of every step.
"""

from __future__ import annotations

import copy

STEPS = 4


def takes_shared_kv(model) -> bool:
    """Whether `model`'s forward reads a target model's `shared_kv_states`."""
    import inspect

    return "shared_kv_states" in inspect.signature(model.forward).parameters


def _kv_shapes(model) -> dict:
    """Per attention kind: (key/value heads, head size) of the model's first layer of that kind."""
    shapes = {}
    for module in model.modules():
        kind = getattr(module, "layer_type", None)
        if kind is not None and hasattr(module, "head_dim") and hasattr(module, "q_proj") \
                and kind not in shapes:
            heads = module.q_proj.out_features // module.head_dim
            shapes[kind] = (heads // module.num_key_value_groups, module.head_dim)
    return shapes


class AssistantCase:
    """One draft model: eager `model`, its jitted twin, the drafting checks."""

    def __init__(self, model, config):
        import fulmen

        self.model, self.config = model, config
        self.twin = copy.deepcopy(model)
        self.jitted = fulmen.jit(self.twin)

    def _draft(self, call, length: int, seed: int, dtype=None):
        """The drafting loop of `call` (the logits and last hidden states of every step)."""
        import torch

        g = torch.Generator().manual_seed(seed)
        width = self.config.backbone_hidden_size
        kv = {kind: tuple(torch.randn(2, heads, length, size, generator=g, dtype=dtype)
                          for _ in range(2))
              for kind, (heads, size) in _kv_shapes(self.model).items()}
        table = torch.randn(self.config.get_text_config().vocab_size, width, generator=g,
                            dtype=dtype)  # the target's input embeddings
        hidden = torch.randn(2, 1, width, generator=g, dtype=dtype)
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, : length // 3] = 0
        token = torch.tensor([[5], [7]])
        out = []
        with torch.no_grad():
            for step in range(STEPS):
                result = call(inputs_embeds=torch.cat([table[token], hidden], dim=-1),
                              attention_mask=mask,
                              position_ids=torch.tensor([[length - 1 + step]]),
                              shared_kv_states=kv, use_cache=False)
                token = result.logits.argmax(dim=-1)
                hidden = result.last_hidden_state
                out += [result.logits, hidden]
        return out

    def checks(self) -> list:
        """(name, make) pairs for `hf_sweep._check`."""
        import torch

        from fulmen.tools.accuracy import to_float64

        def draft(length: int, seed: int):
            def make():
                self.model.eval()
                self.twin.eval()
                want = self._draft(self.model, length, seed)
                return (want, lambda: self._draft(self.jitted, length, seed),
                        lambda: self._draft(to_float64(copy.deepcopy(self.model)), length, seed,
                                            torch.float64))
            return make

        return [("draft-6", draft(6, 1)), ("draft-9", draft(9, 2))]
