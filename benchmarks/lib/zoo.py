"""The model zoo: HuggingFace families of every kind, and CNNs, built from configs with random weights.

Dense and mixture-of-experts decoders, encoders, encoder-decoders, vision transformers, speech and
CNNs, each at two sizes: `size`, about a user's model on one GPU (4 layers, hidden 768-1024, real
sequence and image sizes, a batch for a step of tens of milliseconds on an H200), and `tiny`
(2 layers, hidden 32-64, 8-16 tokens, 32-pixel images) for CPU runs through the Triton interpreter.
Each family's batch gives an output with `.loss` (token labels, class labels, CTC transcripts,
target sequences); `dropout` sets its hidden dropout (and stochastic depth), attention dropout stays
0 as in benchmarks.lib.hf_models; randomness that is not dropout (wav2vec2's SpecAugment masking,
layer drop) is off, so a dropout-free step is deterministic and comparable with eager.

timm's CNNs (ResNet with BatchNorm, ConvNeXt) are families only where `import timm` works (on the
GPU machine); they return logits, so they are wrapped to return a cross-entropy `.loss`.
benchmarks.zoo measures the zoo; tests/models/test_zoo.py guards it at the tiny size.
"""
from __future__ import annotations

import dataclasses
import importlib.util

import torch
from torch import nn

from benchmarks.lib.hf_models import DATA_SEED, FAMILIES, Family, Size

DECODER = Size(1024, 4, 16, 4, 2816, 32000, 8, 1024)
DECODER_TINY = Size(64, 2, 4, 2, 96, 100, 2, 16)
MOE = dataclasses.replace(DECODER, ffn=1408, experts=8)
MOE_TINY = dataclasses.replace(DECODER_TINY, ffn=48, experts=4)
ENCODER = Size(768, 4, 12, 12, 3072, 30522, 32, 512)
ENCODER_TINY = Size(64, 2, 4, 4, 128, 100, 2, 16)
SEQ2SEQ = Size(768, 4, 12, 12, 3072, 32128, 16, 512)  # 4 encoder and 4 decoder layers; targets seq / 4
SEQ2SEQ_TINY = Size(64, 2, 4, 4, 128, 100, 2, 16)
VIT = Size(768, 4, 12, 12, 3072, 0, 64, 0, image=224, classes=1000)
VIT_TINY = Size(64, 2, 4, 4, 128, 0, 2, 0, image=32, classes=10)
CNN = Size(0, 4, 0, 0, 0, 0, 128, 0, image=224, classes=1000)
CNN_TINY = Size(0, 2, 0, 0, 0, 0, 2, 0, image=32, classes=10)
SPEECH = Size(768, 4, 12, 12, 3072, 32, 16, 32000)  # seq: audio samples (2 s at 16 kHz)
SPEECH_TINY = Size(64, 2, 4, 4, 128, 16, 2, 160)
WHISPER = Size(768, 4, 12, 12, 3072, 51865, 8, 3000)  # seq: mel frames (whisper's 30 s)
WHISPER_TINY = Size(64, 2, 4, 4, 128, 100, 2, 16)
MEL_BINS = 80
SAMPLES_PER_CHARACTER = 1280  # a CTC transcript's: 4 frames of wav2vec2's 320 samples
TINY_CONV = dict(conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3))  # 10 samples per frame
MAX_TARGET = 128  # an encoder-decoder's longest labels


def _target_length(size: Size) -> int:
    """An encoder-decoder's label length: a quarter of the source, 4 to MAX_TARGET."""
    return min(max(size.seq // 4, 4), MAX_TARGET)


# -- batches --------------------------------------------------------------------------------------
def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(DATA_SEED)


def seq2seq_batch(size: Size, device: torch.device) -> dict:
    """Source token ids and shorter target ids as labels (the model shifts them into its decoder)."""
    generator = _generator()
    ids = torch.randint(3, size.vocab, (size.batch, size.seq), generator=generator)
    labels = torch.randint(3, size.vocab, (size.batch, _target_length(size)), generator=generator)
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def image_batch(size: Size, device: torch.device) -> dict:
    """Normal pixels and a class label per image."""
    generator = _generator()
    pixels = torch.randn(size.batch, 3, size.image, size.image, generator=generator)
    labels = torch.randint(0, size.classes, (size.batch,), generator=generator)
    return {"pixel_values": pixels.to(device), "labels": labels.to(device)}


def ctc_batch(size: Size, device: torch.device) -> dict:
    """`size.seq` samples of raw audio and a transcript of characters other than the blank (0)."""
    generator = _generator()
    audio = torch.randn(size.batch, size.seq, generator=generator)
    characters = max(size.seq // SAMPLES_PER_CHARACTER, 4)
    labels = torch.randint(1, size.vocab, (size.batch, characters), generator=generator)
    return {"input_values": audio.to(device), "labels": labels.to(device)}


def whisper_batch(size: Size, device: torch.device) -> dict:
    """Log-mel features of `size.seq` frames and target token ids as labels."""
    generator = _generator()
    features = torch.randn(size.batch, MEL_BINS, size.seq, generator=generator)
    labels = torch.randint(3, size.vocab, (size.batch, _target_length(size)), generator=generator)
    return {"input_features": features.to(device), "labels": labels.to(device)}


# -- configs --------------------------------------------------------------------------------------
def _hf(name: str):
    import transformers

    return getattr(transformers, name)


def _decoder(config_class: str, dropout_fields: tuple[str, ...] = (), **fixed):
    """A decoder's config: the Size's shape under the usual field names, `dropout` into
    `dropout_fields`, token ids inside the vocabulary, and `fixed` fields."""
    def config(size: Size, dropout: float):
        fields = dict(hidden_size=size.hidden, num_hidden_layers=size.layers, num_attention_heads=size.heads,
                      num_key_value_heads=size.kv_heads, intermediate_size=size.ffn, vocab_size=size.vocab,
                      max_position_embeddings=max(size.seq, 128), bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
        fields.update({name: dropout for name in dropout_fields})
        fields.update(fixed)
        return _hf(config_class)(**fields)
    return config


def _gemma2(size: Size, dropout: float):
    # head_dim is a field of its own (256 by default): width / heads as in the other decoders
    return _decoder("Gemma2Config", head_dim=size.hidden // size.heads,
                    query_pre_attn_scalar=size.hidden // size.heads)(size, dropout)


def _opt(size: Size, dropout: float):
    return _hf("OPTConfig")(hidden_size=size.hidden, num_hidden_layers=size.layers, num_attention_heads=size.heads,
                            ffn_dim=size.ffn, vocab_size=size.vocab, max_position_embeddings=max(size.seq, 128),
                            word_embed_proj_dim=size.hidden, dropout=dropout, attention_dropout=0.0,
                            layerdrop=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2)


def _bloom(size: Size, dropout: float):
    return _hf("BloomConfig")(hidden_size=size.hidden, n_layer=size.layers, n_head=size.heads,
                              vocab_size=size.vocab, hidden_dropout=dropout, attention_dropout=0.0,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _falcon(size: Size, dropout: float):
    return _hf("FalconConfig")(hidden_size=size.hidden, num_hidden_layers=size.layers,
                               num_attention_heads=size.heads, num_kv_heads=size.kv_heads,
                               new_decoder_architecture=True, ffn_hidden_size=size.ffn, vocab_size=size.vocab,
                               max_position_embeddings=max(size.seq, 128), hidden_dropout=dropout,
                               attention_dropout=0.0, bos_token_id=1, eos_token_id=2)


def _qwen2_moe(size: Size, dropout: float):
    return _decoder("Qwen2MoeConfig", moe_intermediate_size=size.ffn, shared_expert_intermediate_size=size.ffn,
                    num_experts=size.experts, num_experts_per_tok=2, decoder_sparse_step=1,
                    mlp_only_layers=[])(size, dropout)


def _encoder(config_class: str, **fixed):
    """A BERT-like encoder's config: hidden dropout `dropout`, attention dropout 0."""
    def config(size: Size, dropout: float):
        fields = dict(hidden_size=size.hidden, num_hidden_layers=size.layers, num_attention_heads=size.heads,
                      intermediate_size=size.ffn, vocab_size=size.vocab, max_position_embeddings=max(512, size.seq + 2),
                      hidden_dropout_prob=dropout, attention_probs_dropout_prob=0.0)
        fields.update(fixed)
        return _hf(config_class)(**fields)
    return config


def _deberta_v2(size: Size, dropout: float):
    # DeBERTa-v3's attention: relative positions, content-to-position and position-to-content terms
    return _encoder("DebertaV2Config", relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=256,
                    max_relative_positions=-1, position_biased_input=False, share_att_key=True,
                    norm_rel_ebd="layer_norm")(size, dropout)


def _electra(size: Size, dropout: float):
    return _encoder("ElectraConfig", embedding_size=size.hidden)(size, dropout)


def _albert(size: Size, dropout: float):
    return _encoder("AlbertConfig", embedding_size=max(size.hidden // 4, 16), classifier_dropout_prob=dropout,
                    hidden_act="gelu_new")(size, dropout)


def _distilbert(size: Size, dropout: float):
    return _hf("DistilBertConfig")(dim=size.hidden, n_layers=size.layers, n_heads=size.heads, hidden_dim=size.ffn,
                                   vocab_size=size.vocab, max_position_embeddings=max(512, size.seq),
                                   dropout=dropout, attention_dropout=0.0)


def _t5(size: Size, dropout: float):
    return _hf("T5Config")(d_model=size.hidden, d_kv=size.hidden // size.heads, d_ff=size.ffn, num_layers=size.layers,
                           num_decoder_layers=size.layers, num_heads=size.heads, vocab_size=size.vocab,
                           dropout_rate=dropout, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


def _bart_like(config_class: str, **fixed):
    """BART, mBART, Pegasus: encoder and decoder of `size.layers` each, hidden dropout `dropout`."""
    def config(size: Size, dropout: float):
        fields = dict(d_model=size.hidden, encoder_layers=size.layers, decoder_layers=size.layers,
                      encoder_attention_heads=size.heads, decoder_attention_heads=size.heads,
                      encoder_ffn_dim=size.ffn, decoder_ffn_dim=size.ffn, vocab_size=size.vocab,
                      max_position_embeddings=max(size.seq, 128), dropout=dropout, attention_dropout=0.0,
                      activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
        fields.update(fixed)
        return _hf(config_class)(**fields)
    return config


def _whisper(size: Size, dropout: float):
    return _hf("WhisperConfig")(d_model=size.hidden, encoder_layers=size.layers, decoder_layers=size.layers,
                                encoder_attention_heads=size.heads, decoder_attention_heads=size.heads,
                                encoder_ffn_dim=size.ffn, decoder_ffn_dim=size.ffn, vocab_size=size.vocab,
                                num_mel_bins=MEL_BINS, max_source_positions=size.seq // 2,
                                max_target_positions=MAX_TARGET, dropout=dropout,
                                attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
                                decoder_layerdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None)


def _wav2vec2(size: Size, dropout: float):
    tiny = size.hidden < 256
    return _hf("Wav2Vec2Config")(hidden_size=size.hidden, num_hidden_layers=size.layers,
                                 num_attention_heads=size.heads, intermediate_size=size.ffn, vocab_size=size.vocab,
                                 **(TINY_CONV if tiny else {}), num_conv_pos_embeddings=16 if tiny else 128,
                                 num_conv_pos_embedding_groups=4 if tiny else 16, hidden_dropout=dropout,
                                 activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=dropout,
                                 final_dropout=dropout, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0,
                                 ctc_loss_reduction="mean", pad_token_id=0)


def _vit_like(config_class: str, **fixed):
    """ViT, DeiT, BEiT: 16-pixel patches (8 at the tiny size), `dropout` in the hidden states."""
    def config(size: Size, dropout: float):
        fields = dict(hidden_size=size.hidden, num_hidden_layers=size.layers, num_attention_heads=size.heads,
                      intermediate_size=size.ffn, image_size=size.image, patch_size=16 if size.image >= 128 else 8,
                      num_labels=size.classes, hidden_dropout_prob=dropout, attention_probs_dropout_prob=0.0)
        fields.update(fixed)
        return _hf(config_class)(**fields)
    return config


def _beit(size: Size, dropout: float):
    return _vit_like("BeitConfig", use_relative_position_bias=True, drop_path_rate=dropout)(size, dropout)


def _swin(size: Size, dropout: float):
    """Shifted windows: 4 stages of one block (2 at the tiny size), width doubling per stage."""
    tiny = size.image < 128
    return _hf("SwinConfig")(image_size=size.image, patch_size=2 if tiny else 4, embed_dim=size.hidden // 2 if tiny else 128,
                             depths=[1] * size.layers, num_heads=[size.heads * 2 ** i // 4 or 1 for i in range(size.layers)]
                             if tiny else [4, 8, 16, 32], window_size=4 if tiny else 7, num_labels=size.classes,
                             hidden_dropout_prob=dropout, attention_probs_dropout_prob=0.0, drop_path_rate=dropout)


def _resnet(size: Size, dropout: float):
    tiny = size.image < 128
    return _hf("ResNetConfig")(embedding_size=16 if tiny else 64, hidden_sizes=[16, 32] if tiny else [256, 512, 1024, 2048],
                               depths=[1] * size.layers, layer_type="basic" if tiny else "bottleneck",
                               num_labels=size.classes)


def _convnext(size: Size, dropout: float):
    tiny = size.image < 128
    return _hf("ConvNextConfig")(hidden_sizes=[16, 32] if tiny else [96, 192, 384, 768], depths=[1] * size.layers,
                                 num_stages=size.layers, image_size=size.image, num_labels=size.classes,
                                 drop_path_rate=dropout)


def _mobilenet_v2(size: Size, dropout: float):
    tiny = size.image < 128
    return _hf("MobileNetV2Config")(depth_multiplier=0.25 if tiny else 1.0, image_size=size.image,
                                    num_labels=size.classes, classifier_dropout_prob=dropout)


# -- timm -----------------------------------------------------------------------------------------
class LogitsToLoss(nn.Module):
    """A classifier that returns logits, returning transformers' output with a cross-entropy `.loss`."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.classifier = classifier

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor):
        from transformers.modeling_outputs import ImageClassifierOutput

        logits = self.classifier(pixel_values)
        return ImageClassifierOutput(loss=nn.functional.cross_entropy(logits.float(), labels), logits=logits)


def _timm(model_name: str, tiny_kwargs: dict):
    def construct(size: Size, dropout: float) -> nn.Module:
        import timm

        kwargs = tiny_kwargs if size.image < 128 else {}
        rate = {"drop_path_rate": dropout} if "convnext" in model_name else {}
        return LogitsToLoss(timm.create_model(model_name, pretrained=False, num_classes=size.classes,
                                              drop_rate=dropout, **rate, **kwargs))
    return construct


# -- the families ---------------------------------------------------------------------------------
def _family(name, model_class, layers, size, tiny, config, inputs=None) -> Family:
    return Family(name, model_class, layers, size, tiny, config, inputs)


KINDS = {
    "dense decoder": [
        FAMILIES["gpt2"], FAMILIES["llama"],
        _family("mistral", "MistralForCausalLM", "model.layers", DECODER, DECODER_TINY, _decoder("MistralConfig")),
        _family("qwen2", "Qwen2ForCausalLM", "model.layers", DECODER, DECODER_TINY, _decoder("Qwen2Config")),
        _family("gemma2", "Gemma2ForCausalLM", "model.layers", DECODER, DECODER_TINY, _gemma2),
        _family("phi3", "Phi3ForCausalLM", "model.layers", DECODER, DECODER_TINY,
                _decoder("Phi3Config", ("resid_pdrop", "embd_pdrop"))),
        _family("opt", "OPTForCausalLM", "model.decoder.layers", DECODER, DECODER_TINY, _opt),
        _family("bloom", "BloomForCausalLM", "transformer.h", DECODER, DECODER_TINY, _bloom),
        _family("gpt_neox", "GPTNeoXForCausalLM", "gpt_neox.layers", DECODER, DECODER_TINY,
                _decoder("GPTNeoXConfig", ("hidden_dropout",), attention_dropout=0.0)),
        _family("falcon", "FalconForCausalLM", "transformer.h", DECODER, DECODER_TINY, _falcon),
        _family("stablelm", "StableLmForCausalLM", "model.layers", DECODER, DECODER_TINY,
                _decoder("StableLmConfig", ("hidden_dropout",), attention_dropout=0.0)),
    ],
    "moe decoder": [
        _family("mixtral", "MixtralForCausalLM", "model.layers", MOE, MOE_TINY,
                lambda size, dropout: _decoder("MixtralConfig", num_local_experts=size.experts,
                                               num_experts_per_tok=2)(size, dropout)),
        _family("qwen2_moe", "Qwen2MoeForCausalLM", "model.layers", MOE, MOE_TINY, _qwen2_moe),
        _family("olmoe", "OlmoeForCausalLM", "model.layers", MOE, MOE_TINY,
                lambda size, dropout: _decoder("OlmoeConfig", num_experts=size.experts,
                                               num_experts_per_tok=2)(size, dropout)),
    ],
    "encoder": [
        FAMILIES["bert"],
        _family("roberta", "RobertaForMaskedLM", "roberta.encoder.layer", ENCODER, ENCODER_TINY,
                _encoder("RobertaConfig", pad_token_id=1, bos_token_id=0, eos_token_id=2)),
        _family("deberta_v2", "DebertaV2ForMaskedLM", "deberta.encoder.layer", ENCODER, ENCODER_TINY, _deberta_v2),
        _family("electra", "ElectraForMaskedLM", "electra.encoder.layer", ENCODER, ENCODER_TINY,
                _electra),
        # one group of layers shared by every layer: the group is wrapped once and called `layers` times
        _family("albert", "AlbertForMaskedLM", "albert.encoder.albert_layer_groups", ENCODER, ENCODER_TINY, _albert),
        _family("distilbert", "DistilBertForMaskedLM", "distilbert.transformer.layer", ENCODER, ENCODER_TINY,
                _distilbert),
    ],
    "encoder-decoder": [
        _family("t5", "T5ForConditionalGeneration", ("encoder.block", "decoder.block"), SEQ2SEQ, SEQ2SEQ_TINY, _t5,
                seq2seq_batch),
        _family("bart", "BartForConditionalGeneration", ("model.encoder.layers", "model.decoder.layers"), SEQ2SEQ,
                SEQ2SEQ_TINY, _bart_like("BartConfig", pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                         decoder_start_token_id=2), seq2seq_batch),
        _family("mbart", "MBartForConditionalGeneration", ("model.encoder.layers", "model.decoder.layers"), SEQ2SEQ,
                SEQ2SEQ_TINY, _bart_like("MBartConfig", pad_token_id=1, bos_token_id=0, eos_token_id=2),
                seq2seq_batch),
        _family("pegasus", "PegasusForConditionalGeneration", ("model.encoder.layers", "model.decoder.layers"),
                SEQ2SEQ, SEQ2SEQ_TINY, _bart_like("PegasusConfig", pad_token_id=0, eos_token_id=1,
                                                  decoder_start_token_id=0), seq2seq_batch),
    ],
    "vision transformer": [
        _family("vit", "ViTForImageClassification", "vit.layers", VIT, VIT_TINY, _vit_like("ViTConfig"),
                image_batch),
        _family("deit", "DeiTForImageClassification", "deit.layers", VIT, VIT_TINY, _vit_like("DeiTConfig"),
                image_batch),
        _family("beit", "BeitForImageClassification", "beit.layers", VIT, VIT_TINY, _beit, image_batch),
        _family("swin", "SwinForImageClassification", "swin.encoder.layers",
                dataclasses.replace(VIT, hidden=1024), dataclasses.replace(VIT_TINY, layers=2), _swin, image_batch),
    ],
    "speech": [
        _family("wav2vec2", "Wav2Vec2ForCTC", "wav2vec2.encoder.layers", SPEECH, SPEECH_TINY, _wav2vec2, ctc_batch),
        _family("whisper", "WhisperForConditionalGeneration", ("model.encoder.layers", "model.decoder.layers"),
                WHISPER, WHISPER_TINY, _whisper, whisper_batch),
    ],
    "cnn": [
        _family("resnet", "ResNetForImageClassification", "resnet.encoder.stages", CNN, CNN_TINY, _resnet,
                image_batch),
        _family("convnext", "ConvNextForImageClassification", "convnext.encoder.stages", CNN, CNN_TINY, _convnext,
                image_batch),
        _family("mobilenet_v2", "MobileNetV2ForImageClassification", "mobilenet_v2.layer", CNN,
                CNN_TINY, _mobilenet_v2, image_batch),
    ],
}
if importlib.util.find_spec("timm") is not None:  # the GPU machine's: optional families
    KINDS["cnn"] += [
        Family("timm_resnet", "timm resnet26 (BatchNorm2d)", None, CNN, CNN_TINY, None, image_batch,
               construct=_timm("resnet26", {})),
        Family("timm_convnext", "timm convnext_atto (LayerNorm2d)", None, CNN, CNN_TINY, None, image_batch,
               construct=_timm("convnext_atto", {})),
    ]

ZOO: dict[str, Family] = {family.name: family for families in KINDS.values() for family in families}
KIND: dict[str, str] = {family.name: kind for kind, families in KINDS.items() for family in families}
