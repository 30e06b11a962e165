"""Small real architectures for tests: HuggingFace models from tiny configs, and plain PyTorch models.

Each builder returns (model, example_args, example_kwargs) with dropout off, so outputs are
deterministic and comparable with the flattened model.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

Built = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]

B, T, V = 2, 8, 96  # batch, sequence length, vocabulary


def _ids(seed: int = 0, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)


def _mask() -> torch.Tensor:
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -2:] = 0  # one padded row, so masks really matter
    return mask


def gpt2() -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=V, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = _ids()
    return GPT2LMHeadModel(cfg), (ids,), {"labels": ids, "use_cache": False}


def _decoder(config_cls: str, model_cls: str, **cfg: Any) -> Callable[[], Built]:
    def build() -> Built:
        import transformers

        config = getattr(transformers, config_cls)(**cfg)
        model = getattr(transformers, model_cls)(config)
        ids = _ids()
        return model, (ids,), {"attention_mask": _mask(), "labels": ids, "use_cache": False}

    build.__name__ = model_cls
    return build


_common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48)
llama = _decoder("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, max_position_embeddings=32, **_common)
mistral = _decoder("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, max_position_embeddings=32,
                   sliding_window=None, **_common)
qwen2 = _decoder("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, max_position_embeddings=32, **_common)
opt = _decoder("OPTConfig", "OPTForCausalLM", vocab_size=V, hidden_size=32, num_hidden_layers=3,
               num_attention_heads=4, ffn_dim=48, max_position_embeddings=32, word_embed_proj_dim=32,
               dropout=0.0, attention_dropout=0.0)
bloom = _decoder("BloomConfig", "BloomForCausalLM", vocab_size=V, hidden_size=32, n_layer=3, n_head=4,
                 hidden_dropout=0.0, attention_dropout=0.0)
gpt_neox = _decoder("GPTNeoXConfig", "GPTNeoXForCausalLM", max_position_embeddings=32,
                    hidden_dropout=0.0, attention_dropout=0.0, **_common)


def _encoder(config_cls: str, model_cls: str, **cfg: Any) -> Callable[[], Built]:
    def build() -> Built:
        import transformers

        config = getattr(transformers, config_cls)(**cfg)
        model = getattr(transformers, model_cls)(config)
        labels = torch.tensor([0, 1])
        return model, (_ids(),), {"attention_mask": _mask(), "labels": labels}

    build.__name__ = model_cls
    return build


_enc = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            classifier_dropout=0.0)
bert = _encoder("BertConfig", "BertForSequenceClassification", **_enc)
roberta = _encoder("RobertaConfig", "RobertaForSequenceClassification", pad_token_id=1, **_enc)
albert = _encoder("AlbertConfig", "AlbertForSequenceClassification", embedding_size=16,
                  **{**_enc, "num_hidden_layers": 4})
distilbert = _encoder("DistilBertConfig", "DistilBertForSequenceClassification", vocab_size=V, dim=32, n_layers=3,
                      n_heads=4, hidden_dim=48, max_position_embeddings=40, dropout=0.0, attention_dropout=0.0,
                      seq_classif_dropout=0.0)


def t5() -> Built:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    ids = _ids()
    return T5ForConditionalGeneration(cfg), (ids,), {"attention_mask": _mask(), "labels": _ids(1), "use_cache": False}


def bart() -> Built:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=32,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    return BartForConditionalGeneration(cfg), (_ids(),), {"attention_mask": _mask(), "labels": _ids(1), "use_cache": False}


def vit() -> Built:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=3,
                    num_attention_heads=4, intermediate_size=48, num_labels=5,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    pixels = torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    return ViTForImageClassification(cfg), (pixels,), {"labels": torch.tensor([1, 3])}


# ---- plain PyTorch --------------------------------------------------------------------------


def sequential() -> Built:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    return model, (torch.randn(B, 8),), {}


class AlexNetLike(nn.Module):
    """Features, then a flatten in forward, then a classifier: DeepSpeed users need a lambda for it."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def alexnet() -> Built:
    return AlexNetLike(), (torch.randn(B, 3, 16, 16),), {}


class MaskedBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.n1(hidden)
        hidden = hidden + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return hidden + self.ff(self.n2(hidden))


class MaskedTransformer(nn.Module):
    """Blocks take (hidden, mask): the tuple packing a DeepSpeed user writes by hand."""

    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, d)
        self.blocks = nn.ModuleList(MaskedBlock(d) for _ in range(n))
        self.head = nn.Linear(d, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=ids.device), diagonal=1)
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(h)


def masked_transformer() -> Built:
    return MaskedTransformer(), (_ids(),), {}


class UNetLike(nn.Module):
    """Long skip connections: early activations are live across many cuts."""

    def __init__(self) -> None:
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.down2 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.ReLU())
        self.bottom = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.up2 = nn.ConvTranspose2d(32, 8, 2, stride=2)
        self.up1 = nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(d1)
        b = self.bottom(d2)
        u2 = self.up2(torch.cat([b, d2], 1))
        return self.up1(torch.cat([u2, d1], 1))


def unet() -> Built:
    return UNetLike(), (torch.randn(B, 3, 16, 16),), {}


class KwargsModel(nn.Module):
    """A forward with keyword arguments and a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, bias: float = 0.5) -> dict[str, torch.Tensor]:
        for layer in self.layers:
            x = torch.tanh(layer(x)) * scale + bias
        return {"logits": self.out(x), "hidden": x}


def kwargs_model() -> Built:
    return KwargsModel(), (torch.randn(B, 8),), {"scale": torch.rand(B, 1), "bias": 0.25}


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
        )
        self.head = nn.Linear(8 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).flatten(1))


def batchnorm() -> Built:
    return BatchNormNet().train(), (torch.randn(4, 3, 8, 8),), {}


HF = {
    "gpt2": gpt2, "llama": llama, "mistral": mistral, "qwen2": qwen2, "opt": opt, "bloom": bloom,
    "gpt_neox": gpt_neox, "bert": bert, "roberta": roberta, "albert": albert, "distilbert": distilbert,
    "t5": t5, "bart": bart, "vit": vit,
}
PLAIN = {
    "sequential": sequential, "alexnet": alexnet, "masked_transformer": masked_transformer, "unet": unet,
    "kwargs_model": kwargs_model, "batchnorm": batchnorm,
}
ALL = {**HF, **PLAIN}


def build(name: str, seed: int = 0) -> Built:
    torch.manual_seed(seed)
    model, args, kwargs = ALL[name]()
    for module in model.modules():  # config names for dropout vary; tests compare runs exactly
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model, args, kwargs
