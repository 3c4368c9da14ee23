"""HF transformers models called as users call them: tiny configs, random weights, no downloads.

Each model gets a batch of 2 with an attention mask that left-pads one row, `use_cache=False`,
`labels=` (the loss is computed inside the model) and `return_dict=True`; under `fulmen.jit` the
logits, the loss and the gradient of every parameter are as accurate as eager's by the float64
rule (`fulmen.accuracy`: the same model run in float64 is the reference).

transformers' `masking_utils` asks value-dependent questions about the mask on every call
(`if (mask[:, -1] == 0).all():`, `padding_mask.all()`, `x in tensor`): those it asks only of
tensors that are not traced get fulmen's "traced" answer (`tracer/library_flags.py`), the others
are graph breaks (issue 14).
"""

import copy
import os

import pytest
import torch

import fulmen
from fulmen.tools.accuracy import assert_accurate, to_float64

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
T = transformers

VOCAB, BATCH, SEQ, TARGET = 96, 2, 8, 5


def _decoder(config_name: str, model_name: str, **overrides):
    """A tiny decoder-only causal LM with the common config names."""
    kwargs = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                  max_position_embeddings=64)
    kwargs.update(overrides)
    return lambda: getattr(T, model_name)(getattr(T, config_name)(**kwargs))


def _encoder(config_name: str, model_name: str, **overrides):
    """A tiny BERT-style masked LM."""
    kwargs = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                  intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64)
    kwargs.update(overrides)
    return lambda: getattr(T, model_name)(getattr(T, config_name)(**kwargs))


def _seq2seq(config_name: str, model_name: str, **overrides):
    """A tiny BART-style encoder-decoder."""
    kwargs = dict(encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                  vocab_size=VOCAB, max_position_embeddings=64)
    kwargs.update(overrides)
    return lambda: getattr(T, model_name)(getattr(T, config_name)(**kwargs))


MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# name: (kind, factory); kinds pick the inputs (see `_inputs`)
MODELS = {
    # decoder-only causal LMs
    "gpt2": ("causal", lambda: T.GPT2LMHeadModel(T.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=64))),
    "gptj": ("causal", lambda: T.GPTJForCausalLM(T.GPTJConfig(
        n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=64, rotary_dim=4))),
    "gpt_neox": ("causal", _decoder("GPTNeoXConfig", "GPTNeoXForCausalLM")),
    "llama": ("causal", _decoder("LlamaConfig", "LlamaForCausalLM")),
    "mistral": ("causal", _decoder("MistralConfig", "MistralForCausalLM", sliding_window=4)),
    "mixtral": ("causal", _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                                   num_experts_per_tok=2)),
    "qwen2": ("causal", _decoder("Qwen2Config", "Qwen2ForCausalLM")),
    "qwen2_moe": ("causal", _decoder("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4,
                                     shared_expert_intermediate_size=32, **MOE)),
    "qwen3": ("causal", _decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=8)),
    "qwen3_moe": ("causal", _decoder("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4,
                                     head_dim=8, **MOE)),
    "gemma": ("causal", _decoder("GemmaConfig", "GemmaForCausalLM", head_dim=8)),
    "gemma2": ("causal", _decoder("Gemma2Config", "Gemma2ForCausalLM", head_dim=8,
                                  sliding_window=4)),
    "gemma3": ("causal", _decoder("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8,
                                  sliding_window=4)),
    "gemma4": ("causal", _decoder(  # per-layer inputs, MoE beside the MLP, wider global heads
        "Gemma4TextConfig", "Gemma4ForCausalLM", head_dim=8, global_head_dim=16,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)),
    "phi": ("causal", _decoder("PhiConfig", "PhiForCausalLM")),
    "phi3": ("causal", _decoder("Phi3Config", "Phi3ForCausalLM", pad_token_id=0)),
    "olmo": ("causal", _decoder("OlmoConfig", "OlmoForCausalLM")),
    "olmo2": ("causal", _decoder("Olmo2Config", "Olmo2ForCausalLM")),
    "stablelm": ("causal", _decoder("StableLmConfig", "StableLmForCausalLM")),
    "starcoder2": ("causal", _decoder("Starcoder2Config", "Starcoder2ForCausalLM")),
    "cohere": ("causal", _decoder("CohereConfig", "CohereForCausalLM")),
    "granite": ("causal", _decoder("GraniteConfig", "GraniteForCausalLM")),
    "deepseek_v3": ("causal", _decoder(
        "DeepseekV3Config", "DeepseekV3ForCausalLM", num_key_value_heads=4, n_routed_experts=4,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, **MOE)),
    "llama4": ("causal", _decoder(  # complex-valued rotary embedding, MoE
        "Llama4TextConfig", "Llama4ForCausalLM", head_dim=8, intermediate_size_mlp=64,
        num_local_experts=4, num_experts_per_tok=1)),
    "hrm": ("causal", _decoder("HrmTextConfig", "HrmTextForCausalLM", head_dim=8,
                               num_layers_per_stack=1, H_cycles=2, L_cycles=2)),
    "ctrl": ("causal", lambda: T.CTRLLMHeadModel(T.CTRLConfig(  # scales by a numpy scalar
        n_layer=2, n_head=4, n_embd=32, dff=64, vocab_size=VOCAB, n_positions=64))),
    "bloom": ("causal", lambda: T.BloomForCausalLM(T.BloomConfig(
        n_layer=2, n_head=4, hidden_size=32, vocab_size=VOCAB))),
    "falcon": ("causal", lambda: T.FalconForCausalLM(T.FalconConfig(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=32, vocab_size=VOCAB))),
    "opt": ("causal", lambda: T.OPTForCausalLM(T.OPTConfig(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=32, ffn_dim=64,
        vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=32))),
    # encoders (masked LM)
    "bert": ("masked", _encoder("BertConfig", "BertForMaskedLM")),
    "roberta": ("masked", _encoder("RobertaConfig", "RobertaForMaskedLM", pad_token_id=0)),
    "deberta_v2": ("masked", _encoder(
        "DebertaV2Config", "DebertaV2ForMaskedLM", relative_attention=True,
        pos_att_type=["p2c", "c2p"], max_relative_positions=16)),
    "distilbert": ("masked", lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(
        n_layers=2, dim=32, n_heads=4, hidden_dim=64, vocab_size=VOCAB,
        max_position_embeddings=64))),
    "ibert": ("masked", _encoder("IBertConfig", "IBertForMaskedLM")),  # mean(axis=...)
    # encoder-decoders
    "bart": ("seq2seq", _seq2seq("BartConfig", "BartForConditionalGeneration")),
    "t5": ("seq2seq", lambda: T.T5ForConditionalGeneration(T.T5Config(
        num_layers=1, num_decoder_layers=1, d_model=32, d_kv=8, num_heads=4, d_ff=64,
        vocab_size=VOCAB, pad_token_id=0, decoder_start_token_id=0))),
    "whisper": ("speech", lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
        encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
        num_mel_bins=8, max_source_positions=8, max_target_positions=16, pad_token_id=0,
        decoder_start_token_id=1))),
    # vision
    "vit": ("image", lambda: T.ViTForImageClassification(T.ViTConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=3))),
    "swin": ("image", lambda: T.SwinForImageClassification(T.SwinConfig(
        image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=2, num_labels=3))),
    "clip": ("image-text", lambda: T.CLIPModel(T.CLIPConfig(
        text_config=dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                         intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16),
        vision_config=dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                           intermediate_size=64, image_size=16, patch_size=4),
        projection_dim=16))),
}

def _left_padded_mask(batch: int, length: int) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :3] = 0
    return mask


def _inputs(kind: str, model) -> dict:
    """The call a user makes: a left-padded batch, labels, no cache, a ModelOutput back."""
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    mask = _left_padded_mask(BATCH, SEQ)
    if kind == "causal":
        labels = ids.masked_fill(mask == 0, -100)
        return dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    if kind == "masked":
        return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    if kind == "seq2seq":
        return dict(input_ids=ids, attention_mask=mask, use_cache=False,
                    labels=torch.randint(3, VOCAB, (BATCH, TARGET)))
    if kind == "speech":
        config = model.config
        features = torch.randn(BATCH, config.num_mel_bins, 2 * config.max_source_positions)
        labels = torch.randint(3, VOCAB, (BATCH, TARGET))
        return dict(input_features=features, labels=labels,
                    decoder_attention_mask=_left_padded_mask(BATCH, TARGET), use_cache=False)
    size = model.config.vision_config.image_size if kind == "image-text" else model.config.image_size
    pixels = torch.randn(BATCH, 3, size, size)
    if kind == "image":
        return dict(pixel_values=pixels, labels=torch.tensor([0, 2]))
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, return_loss=True)


def _outputs(kind: str, out) -> dict:
    if kind == "image-text":
        return {"loss": out.loss, "logits_per_image": out.logits_per_image}
    return {"loss": out.loss, "logits": out.logits}


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_matches_eager(name):
    kind, make = MODELS[name]
    torch.manual_seed(0)
    model = make().eval()
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = _inputs(kind, model)

    expected = _outputs(kind, model(**inputs, return_dict=True))
    expected_grads = torch.autograd.grad(expected["loss"], params, allow_unused=True)
    actual = _outputs(kind, fulmen.jit(model)(**inputs, return_dict=True))
    reference = _Float64Run(kind, model, inputs)
    assert_accurate(actual, expected, reference.outputs, what="outputs")
    actual_grads = torch.autograd.grad(actual["loss"], params, allow_unused=True)

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for index, (param_name, param, want, got) in enumerate(zip(names, params, expected_grads,
                                                                actual_grads)):
        want = torch.zeros_like(param) if want is None else want
        got = torch.zeros_like(param) if got is None else got
        assert_accurate(got, want, lambda i=index: reference.grads()[i],
                        what=f"grad of {param_name}")


class _Float64Run:
    """The model and its inputs in float64 (run once, on first use): the accuracy reference."""

    def __init__(self, kind, model, inputs):
        self.kind, self.model, self.inputs, self._result = kind, model, inputs, None

    def _run(self):
        if self._result is None:
            wide = copy.deepcopy(self.model).double()
            torch.manual_seed(0)
            out = _outputs(self.kind, wide(**to_float64(self.inputs), return_dict=True))
            params = [p for p in wide.parameters() if p.requires_grad]
            grads = torch.autograd.grad(out["loss"], params, allow_unused=True)
            self._result = (out, [torch.zeros_like(p) if g is None else g
                                  for p, g in zip(params, grads)])
        return self._result

    def outputs(self):
        return self._run()[0]

    def grads(self):
        return self._run()[1]
