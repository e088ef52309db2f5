"""The model zoo: Hugging Face architectures from tiny configs built in code (no downloads), as users train them.

    for arch in ARCHITECTURES.values():
        model = arch.build(seed=0)               # a fresh model, deterministic weights, no dropout
        with arch.autocast():                    # bfloat16 autocast for the mixed-precision entry
            loss = arch.loss(model, arch.batch(step))  # a scalar through the model's own loss

Each entry names the family it stands for (decoder with learned or rotary positions, grouped-query attention,
sliding window, mixture of experts, encoder, encoder-decoder, vision, speech with a CTC loss, tied embeddings, a
frozen base with adapters, constant position embeddings, modules returning sizes beside tensors, outputs that are views
of one another: key/value caches, pooled tokens, transposed logits; attention whose gradients cancel; random draws in
the forward). Configs use the arguments both pinned ``transformers`` versions (4.46 on the ort lane, 5.x on the modern
one) accept.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

VOCAB = 96
SEQ = 12
BATCH = 2
AUDIO = 400


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """One architecture of the zoo: how to build it, feed it and take its loss."""

    name: str
    family: str
    make: Callable[[Any], torch.nn.Module]  # transformers module -> model
    inputs: str = "causal"  # causal | masked | seq2seq | image | audio | pixels (no labels) | image-text
    # An attention mask of ones, as a tokenizer gives: where the model's program without one differs between
    # eager and torch.compile (transformers 4.46's T5 makes one only when not compiling).
    attention_mask: bool = False
    precision: str = "float32"  # "bfloat16": the forward under torch.autocast("cpu", dtype=torch.bfloat16)
    # The forward draws random numbers (dropout on, random masking): each backend draws from its own generator
    # (ORT's kernels, inductor's seeds), so only eager and ``aot_eager`` compilation draw the same numbers.
    draws: bool = False
    # The model has only eager attention (MPT: transformers 5 breaks when the config asks for sdpa).
    eager_attention: bool = False

    def build(self, seed: int = 0, attention: str = "eager") -> torch.nn.Module:
        import transformers

        torch.manual_seed(seed)
        model = self.make(transformers)
        _set_attention(model, "eager" if self.eager_attention else attention)
        model.train()
        return model

    def autocast(self, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        """Where the forward runs: under autocast to ``precision`` on ``device``'s type unless it is float32."""
        if self.precision == "float32":
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=getattr(torch, self.precision))

    def batch(self, step: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 + step)
        if self.inputs in ("image", "pixels", "image-text"):
            pixels = torch.randn(BATCH, 3, 16, 16, generator=generator)
            labels = torch.randint(0, 4, (BATCH,), generator=generator)
            batch = {"pixel_values": pixels, "labels": labels} if self.inputs == "image" else {"pixel_values": pixels}
            if self.inputs == "image-text":  # CLIP's contrastive loss over the batch's image-text pairs
                batch.update(input_ids=torch.randint(4, VOCAB, (BATCH, SEQ), generator=generator), return_loss=True)
        elif self.inputs == "audio":  # 400 samples: 39 frames after the feature encoder; 8 characters each
            audio = torch.randn(BATCH, AUDIO, generator=generator)
            batch = {"input_values": audio, "labels": torch.randint(1, VOCAB // 3, (BATCH, 8), generator=generator)}
        else:
            tokens = torch.randint(4, VOCAB, (BATCH, SEQ), generator=generator)
            batch = {"input_ids": tokens, "labels": tokens.clone()}
            if self.inputs == "seq2seq":
                batch["labels"] = torch.randint(4, VOCAB, (BATCH, SEQ // 2), generator=generator)
            if self.attention_mask:
                batch["attention_mask"] = torch.ones_like(tokens)
        return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}

    @staticmethod
    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        output = model(**batch)
        return output["loss"] if isinstance(output, dict) or hasattr(output, "keys") else output[0]


def _set_attention(model: torch.nn.Module, attention: str) -> None:
    # ``from_config(attn_implementation=...)`` differs between the pinned versions; the config field is common.
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            try:
                config._attn_implementation = attention
            except Exception:  # pragma: no cover - a version that refuses: keep its default
                pass


_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, use_cache=False, attention_dropout=0.0)


def _gpt2(t: Any) -> torch.nn.Module:
    return t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=64,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                          bos_token_id=1, eos_token_id=2))


def _llama(t: Any) -> torch.nn.Module:
    return t.LlamaForCausalLM(t.LlamaConfig(**_DECODER, num_key_value_heads=2))


def _mistral(t: Any) -> torch.nn.Module:
    return t.MistralForCausalLM(t.MistralConfig(**_DECODER, num_key_value_heads=2, sliding_window=4))


def _qwen2(t: Any) -> torch.nn.Module:
    return t.Qwen2ForCausalLM(t.Qwen2Config(**_DECODER, num_key_value_heads=2, tie_word_embeddings=True))


def _mixtral(t: Any) -> torch.nn.Module:
    return t.MixtralForCausalLM(t.MixtralConfig(**_DECODER, num_key_value_heads=2, num_local_experts=4,
                                                num_experts_per_tok=2, router_jitter_noise=0.0))


def _gpt_neox(t: Any) -> torch.nn.Module:
    return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.5,
                                                max_position_embeddings=64, use_cache=False, hidden_dropout=0.0,
                                                attention_dropout=0.0))


def _opt(t: Any) -> torch.nn.Module:
    return t.OPTForCausalLM(t.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                        num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64,
                                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                        layerdrop=0.0, use_cache=False))


def _bert(t: Any) -> torch.nn.Module:
    return t.BertForMaskedLM(t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _roberta(t: Any) -> torch.nn.Module:
    return t.RobertaForMaskedLM(t.RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=64,
                                                max_position_embeddings=64, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0))


def _t5(t: Any) -> torch.nn.Module:
    return t.T5ForConditionalGeneration(t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                                   relative_attention_num_buckets=8, decoder_start_token_id=0,
                                                   pad_token_id=0, use_cache=False))


def _bart(t: Any) -> torch.nn.Module:
    return t.BartForConditionalGeneration(t.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2,
                                                       decoder_layers=2, encoder_attention_heads=4,
                                                       decoder_attention_heads=4, encoder_ffn_dim=64,
                                                       decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                                                       attention_dropout=0.0, activation_dropout=0.0,
                                                       pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                                       decoder_start_token_id=2, use_cache=False))


def _vit(t: Any) -> torch.nn.Module:
    return t.ViTForImageClassification(t.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=64, num_labels=4, hidden_dropout_prob=0.0,
                                                   attention_probs_dropout_prob=0.0))


def _phi3(t: Any) -> torch.nn.Module:
    return t.Phi3ForCausalLM(t.Phi3Config(**_DECODER, num_key_value_heads=2, pad_token_id=0, resid_pdrop=0.0,
                                          embd_pdrop=0.0))


def _gemma(t: Any) -> torch.nn.Module:
    return t.GemmaForCausalLM(t.GemmaConfig(**_DECODER, num_key_value_heads=1, head_dim=8))


def _wav2vec2(t: Any) -> torch.nn.Module:
    # CTC speech recognition: a convolutional feature encoder, a convolutional position embedding (weight norm) and
    # a transformer encoder; the loss is CTC summed over the batch (transformers' default): about 200 here.
    return t.Wav2Vec2ForCTC(t.Wav2Vec2Config(
        vocab_size=VOCAB // 3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0,
        pad_token_id=0, ctc_loss_reduction="sum"))


def _llama_lora(t: Any) -> torch.nn.Module:
    import peft

    base = t.LlamaForCausalLM(t.LlamaConfig(**{**_DECODER, "num_hidden_layers": 1}, num_key_value_heads=2))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(base, config)  # the base frozen, the adapters trainable


def _pegasus(t: Any) -> torch.nn.Module:
    return t.PegasusForConditionalGeneration(t.PegasusConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1,
                                                             decoder_layers=1, encoder_attention_heads=4,
                                                             decoder_attention_heads=4, encoder_ffn_dim=64,
                                                             decoder_ffn_dim=64, max_position_embeddings=64,
                                                             dropout=0.0, attention_dropout=0.0,
                                                             activation_dropout=0.0, pad_token_id=0,
                                                             eos_token_id=1, decoder_start_token_id=0,
                                                             use_cache=False))


def _swin(t: Any) -> torch.nn.Module:
    return t.SwinForImageClassification(t.SwinConfig(image_size=16, patch_size=2, num_channels=3, embed_dim=16,
                                                     depths=[1, 1], num_heads=[2, 2], window_size=2, mlp_ratio=2.0,
                                                     num_labels=4, hidden_dropout_prob=0.0,
                                                     attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
                                                     # set, not found by the first loss: no recompile at step 1
                                                     problem_type="single_label_classification"))



def _gpt2_cache(t: Any) -> torch.nn.Module:
    # GPT-2's default: each block returns its key and value (transformers 4.46: tuples, two views of one projection).
    return t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=64,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=True,
                                          bos_token_id=1, eos_token_id=2))


def _dinov2(t: Any) -> torch.nn.Module:
    # Dinov2Model's pooler_output is sequence_output[:, 0]: a view of its last_hidden_state.
    return t.Dinov2ForImageClassification(t.Dinov2Config(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                                         num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
                                                         num_labels=4, hidden_dropout_prob=0.0,
                                                         attention_probs_dropout_prob=0.0, drop_path_rate=0.0))


def _clip_config(t: Any, **init: float) -> Any:
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, attention_dropout=0.0, eos_token_id=2, **init)
    vision = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, attention_dropout=0.0, **init)
    return t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16, **init)


def _clip(t: Any) -> torch.nn.Module:
    # CLIPModel's logits_per_image is logits_per_text.t(): its root returns two views of one tensor.
    return t.CLIPModel(_clip_config(t))


def _clip_tiny_init(t: Any) -> torch.nn.Module:
    # Weights 100x smaller than CLIP's default: the attention scores are nearly uniform and their gradient nearly
    # cancels, so the q/k projections' gradients are tiny beside the gradient entering the attention.
    return t.CLIPModel(_clip_config(t, initializer_factor=0.01))


def _bloom(t: Any) -> torch.nn.Module:
    return t.BloomForCausalLM(t.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                                            hidden_dropout=0.0, attention_dropout=0.0))


def _mpt(t: Any) -> torch.nn.Module:
    return t.MptForCausalLM(t.MptConfig(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64,
                                        vocab_size=VOCAB, resid_pdrop=0.0, emb_pdrop=0.0))


def _vit_mae(t: Any) -> torch.nn.Module:
    # Masked autoencoding: random patch masking (torch.rand, argsort) in the forward, and dropout on.
    return t.ViTMAEForPreTraining(t.ViTMAEConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                                 decoder_hidden_size=32, decoder_num_hidden_layers=1,
                                                 decoder_num_attention_heads=4, decoder_intermediate_size=64,
                                                 mask_ratio=0.75, hidden_dropout_prob=0.1,
                                                 attention_probs_dropout_prob=0.1))

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in (
    Architecture(name="gpt2", family="decoder, learned positions, tied embeddings", make=_gpt2),
    Architecture(name="llama", family="decoder, rotary, grouped-query attention", make=_llama),
    Architecture(name="llama-bf16", family="decoder, bf16 autocast (mixed precision)", make=_llama,
                 precision="bfloat16"),
    Architecture(name="mistral", family="decoder, rotary, sliding window", make=_mistral),
    Architecture(name="qwen2", family="decoder, rotary, tied embeddings", make=_qwen2),
    Architecture(name="gemma", family="decoder, rotary, multi-query attention", make=_gemma),
    Architecture(name="phi3", family="decoder, rotary, fused qkv", make=_phi3),
    Architecture(name="mixtral", family="decoder, mixture of experts", make=_mixtral),
    Architecture(name="gpt_neox", family="decoder, partial rotary, parallel residual", make=_gpt_neox),
    Architecture(name="opt", family="decoder, learned positions", make=_opt),
    Architecture(name="bert", family="encoder (masked LM)", make=_bert, inputs="masked"),
    Architecture(name="roberta", family="encoder (masked LM)", make=_roberta, inputs="masked"),
    Architecture(name="t5", family="encoder-decoder, relative positions", make=_t5, inputs="seq2seq",
                 attention_mask=True),
    Architecture(name="bart", family="encoder-decoder, learned positions", make=_bart, inputs="seq2seq"),
    Architecture(name="vit", family="vision transformer", make=_vit, inputs="image"),
    Architecture(name="llama_lora", family="frozen base + LoRA adapters (peft)", make=_llama_lora),
    Architecture(name="pegasus", family="encoder-decoder, constant sinusoidal positions", make=_pegasus,
                 inputs="seq2seq"),
    Architecture(name="swin", family="vision, shifted windows; modules return sizes beside tensors", make=_swin,
                 inputs="image"),
    Architecture(name="gpt2_cache", family="decoder returning its key/value cache (use_cache=True)", make=_gpt2_cache),
    Architecture(name="dinov2", family="vision, pooled output a view of the hidden states", make=_dinov2,
                 inputs="image"),
    Architecture(name="clip", family="image-text contrastive; transposed logits (views)", make=_clip,
                 inputs="image-text"),
    Architecture(name="clip_tiny_init", family="image-text, tiny init: attention gradients cancel",
                 make=_clip_tiny_init, inputs="image-text"),
    Architecture(name="bloom", family="decoder, ALiBi, key/value cache tuples", make=_bloom),
    Architecture(name="mpt", family="decoder, ALiBi, key/value cache tuples", make=_mpt, eager_attention=True),
    Architecture(name="vit_mae", family="masked autoencoder: random masking and dropout in the forward", make=_vit_mae,
                 inputs="pixels", draws=True),
)}

# Trained long enough for rounding noise to grow (tests/test_zoo_noise.py): a loss of about 200 and SGD at 1e-2.
LONG_TRAINED = Architecture(name="wav2vec2", family="speech, CTC loss (summed: about 200)", make=_wav2vec2,
                            inputs="audio")
