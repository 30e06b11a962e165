"""Models nobody on this team wrote, each as a tiny factory: what a new user would bring.

Every function here is a factory a job can name (``tests/zoo.py:mixtral``): it returns the model with
example inputs of one micro-batch, and takes ``batch_size`` where the user's would. HuggingFace
models come from tiny configs with their defaults (the default experts implementation for MoE, the
cache left on), so the job must cope as a user's would. Models of packages that do not fit the test
extra (timm's ConvNeXt, litgpt's GPT, karpathy's nanoGPT) are written here in their shape: the same
layouts and buffers, none of their code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

B, T, V = 2, 8, 96  # rows per micro-batch, tokens per row, vocabulary


def _ids(batch_size: int, seed: int = 0, vocab: int = V, length: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch_size, length), generator=g)


def _decoder(config_cls: str, model_cls: str, batch_size: int, **cfg: Any) -> tuple[nn.Module, tuple, dict]:
    import transformers

    config = getattr(transformers, config_cls)(vocab_size=V, hidden_size=32, num_hidden_layers=3,
                                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                               **cfg)
    model = getattr(transformers, model_cls)(config)
    ids = _ids(batch_size)
    return model, (ids,), {"labels": ids}  # no use_cache: the user's factory does not say it


# ---- HuggingFace: MoE decoders with their default experts kernels, Gemma, Whisper ----------------


def mixtral(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    """Mixtral, router auxiliary loss included in its loss (``output_router_logits``)."""
    return _decoder("MixtralConfig", "MixtralForCausalLM", batch_size, intermediate_size=48, num_local_experts=4,
                    num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)


def qwen2_moe(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    """Qwen2-MoE: routed experts plus a gated shared expert."""
    return _decoder("Qwen2MoeConfig", "Qwen2MoeForCausalLM", batch_size, intermediate_size=48,
                    moe_intermediate_size=24, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                    decoder_sparse_step=1, mlp_only_layers=[])


def qwen3_moe(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    return _decoder("Qwen3MoeConfig", "Qwen3MoeForCausalLM", batch_size, intermediate_size=48, head_dim=8,
                    moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                    mlp_only_layers=[])


def jamba(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    """Jamba: Mamba layers (torch's own scan, no CUDA kernels) and an attention layer, MoE on every other
    layer, the router's auxiliary loss in its loss: the hybrid Mamba/attention kind of decoder."""
    return _decoder("JambaConfig", "JambaForCausalLM", batch_size, intermediate_size=48, num_experts=4,
                    num_experts_per_tok=2, attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2,
                    expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                    use_mamba_kernels=False, output_router_logits=True, router_aux_loss_coef=0.1)


def deepseek_v3(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    """DeepSeek-V3: multi-head latent attention (low-rank q and kv, a rope part of each head), a dense first
    layer, then routed experts in groups plus a shared expert: the MLA kind of decoder."""
    import transformers

    config = transformers.DeepseekV3Config(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                           num_key_value_heads=4, max_position_embeddings=32, intermediate_size=48,
                                           moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                                           n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                                           q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                           v_head_dim=8, head_dim=8)  # fmt: skip
    ids = _ids(batch_size)
    return transformers.DeepseekV3ForCausalLM(config), (ids,), {"labels": ids}


def llama(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    return _decoder("LlamaConfig", "LlamaForCausalLM", batch_size, intermediate_size=48)


def gemma(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    """Gemma: embeddings scaled by sqrt(hidden), RMSNorm of (1 + weight), tied head."""
    return _decoder("GemmaConfig", "GemmaForCausalLM", batch_size, intermediate_size=48, head_dim=8)


def gemma3(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    """Gemma 3 (text): the embedding scale is a non-persistent buffer; sliding and global layers."""
    return _decoder("Gemma3TextConfig", "Gemma3ForCausalLM", batch_size, intermediate_size=48, head_dim=8,
                    sliding_window=4)


def whisper(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    """Whisper: log-mel features into a convolutional encoder, a text decoder trained on labels."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=V, num_mel_bins=8, encoder_layers=2, decoder_layers=2, d_model=32,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
                           max_source_positions=16, max_target_positions=16, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, decoder_start_token_id=1, dropout=0.0)
    features = torch.randn(batch_size, 8, 32, generator=torch.Generator().manual_seed(0))
    return WhisperForConditionalGeneration(config), (features,), {"labels": _ids(batch_size, 1)}


# ---- nanoGPT's shape: forward(idx, targets) -> (logits, loss) --------------------------------------


class _NanoBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's layout: wte/wpe, blocks ``h``, ln_f, a head tied to wte; returns ``(logits, loss)``."""

    def __init__(self, d: int = 32, layers: int = 3, heads: int = 4, block: int = 32) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, d), wpe=nn.Embedding(block, d), drop=nn.Dropout(0.0),
            h=nn.ModuleList(_NanoBlock(d, heads) for _ in range(layers)), ln_f=nn.LayerNorm(d),
        ))  # fmt: skip
        self.lm_head = nn.Linear(d, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        pos = torch.arange(idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def nanogpt(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    ids = _ids(batch_size)
    return NanoGPT(), (ids,), {"targets": _ids(batch_size, 1)}


# ---- litgpt's shape: rotary caches as non-persistent buffers the root's reset_parameters replaces ---


class _RopeAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.heads = heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class _LitBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn = _RopeAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 3 * d, bias=False), nn.SiLU(), nn.Linear(3 * d, d, bias=False))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), cos, sin)
        return x + self.mlp(self.norm_2(x))


class LitGPT(nn.Module):
    """litgpt's GPT layout: the rotary tables ``cos``/``sin`` are non-persistent buffers made by a
    property setter in ``__init__``, and the root's ``reset_parameters`` assigns new tensors to them."""

    def __init__(self, d: int = 32, layers: int = 3, heads: int = 4, block: int = 32) -> None:
        super().__init__()
        self.head_size, self.block_size = d // heads, block
        self.lm_head = nn.Linear(d, V, bias=False)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, d), h=nn.ModuleList(_LitBlock(d, heads) for _ in range(layers)), ln_f=nn.RMSNorm(d),
        ))  # fmt: skip
        self.max_seq_length = block

    @property
    def max_seq_length(self) -> int:
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self._max_seq_length = value
        if not hasattr(self, "cos"):
            cos, sin = self.rope_cache()
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        elif value != self.cos.size(0):
            self.cos, self.sin = self.rope_cache(device=self.cos.device)

    def rope_cache(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        theta = 1.0 / (10000 ** (torch.arange(0, self.head_size, 2, device=device).float() / self.head_size))
        angles = torch.outer(torch.arange(self._max_seq_length, device=device).float(), theta).repeat(1, 2)
        return torch.cos(angles), torch.sin(angles)

    def reset_parameters(self) -> None:
        self.cos, self.sin = self.rope_cache(device=self.cos.device)  # new tensors, as litgpt's does

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        return self.lm_head(self.transformer.ln_f(x))


def litgpt(batch_size: int = B) -> tuple[nn.Module, tuple]:
    """litgpt's GPT returns logits; a job trains it with --loss cross_entropy against next tokens."""
    return LitGPT(), (_ids(batch_size),)


# ---- CNNs: BatchNorm (ResNet's basic block), ConvNeXt's permuted channels-last blocks, AlexNet ------


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNetLike(nn.Module):
    """ResNet's stem and basic blocks with BatchNorm (running statistics updated in training)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layers = nn.Sequential(_BasicBlock(8, 8, 1), _BasicBlock(8, 16, 2), _BasicBlock(16, 16, 1))
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1))


def resnet(batch_size: int = 4) -> dict[str, Any]:
    images = torch.randn(batch_size, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    return {"model": ResNetLike(), "args": (images,), "loss": F.cross_entropy}


class _ConvNeXtBlock(nn.Module):
    """Depthwise conv, then LayerNorm and the MLP on channels-last (permuted) activations, scaled."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)  # (N, C, H, W) -> (N, H, W, C)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)  # back to (N, C, H, W), channels-last in memory


class _LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of (N, C, H, W): permute to channels-last and back, as timm's does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtLike(nn.Module):
    """ConvNeXt's layout: a patchify stem, stages of permuted blocks, LayerNorm2d-then-conv
    downsampling (its first op permutes what it receives, so the gradient it sends back is a
    permuted, non-contiguous tensor); the input runs in channels-last memory format, as timm's
    users run it."""

    def __init__(self, dims: tuple[int, ...] = (8, 16), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 2, stride=2), _LayerNorm2d(dims[0]))
        self.stages = nn.Sequential(*[_ConvNeXtBlock(dims[0]) for _ in range(3)],
                                    nn.Sequential(_LayerNorm2d(dims[0]), nn.Conv2d(dims[0], dims[1], 2, stride=2)),
                                    _ConvNeXtBlock(dims[1]))
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x.contiguous(memory_format=torch.channels_last)))
        return self.head(x.mean(dim=(2, 3)))


def convnext(batch_size: int = B) -> dict[str, Any]:
    images = torch.randn(batch_size, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    return {"model": ConvNeXtLike(), "args": (images,), "loss": F.cross_entropy}


class AlexNet(nn.Module):
    """The DeepSpeed pipeline tutorial's CIFAR AlexNet, in its shape (5 convolutions, 3 linear)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 24, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(24, 32, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(32, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )  # fmt: skip
        self.classifier = nn.Sequential(nn.Linear(16 * 2 * 2, 32), nn.ReLU(inplace=True), nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def alexnet() -> tuple[nn.Module, tuple]:
    """No batch_size argument: the micro-batch is the example's, 8 rows, as the tutorial's factory has it."""
    return AlexNet(), (torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)


ZOO = {
    "llama": llama, "jamba": jamba, "deepseek_v3": deepseek_v3, "mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "gemma": gemma, "gemma3": gemma3,
    "whisper": whisper, "nanogpt": nanogpt, "litgpt": litgpt, "resnet": resnet, "convnext": convnext,
    "alexnet": alexnet,
}
# what each trains with in a job: the model's own loss, or cross-entropy of its logits against the data's targets
LOSS = {"alexnet": "cross_entropy", "litgpt": "cross_entropy"}

__all__ = ["ZOO", "LOSS", *ZOO, "NanoGPT", "LitGPT", "ResNetLike", "ConvNeXtLike", "AlexNet"]
