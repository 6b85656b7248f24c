"""A small GPT built from a config, for the demo, the tests and the benchmarks.

Nothing is downloaded: the model is defined here and initialized from a seed. It has what
makes ZeRO interesting: tied input/output embeddings (one parameter, two users), LayerNorm,
``scaled_dot_product_attention`` and GELU MLPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0  # after the embeddings, on attention weights, after each residual branch (training only)


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """``F.dropout`` where ``p`` > 0; at 0 the value itself (dropout at p = 0 traces a copy)."""
    return F.dropout(x, p) if p > 0 else x


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        # no qkv bias: a key bias has an exactly-zero gradient (softmax ignores it), and Adam
        # turns the rounding noise in that gradient into lr-sized updates
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # qkv's output rows are head-major ((head, q|k|v, head_dim)), and the head count is read
        # from the output's width: column-wise tensor parallelism (a contiguous block of qkv's
        # rows per rank) then gives each rank whole heads, and the same code runs on its share
        b, t, c = x.shape
        head_dim = c // self.n_head
        qkv = self.qkv(x).view(b, t, -1, 3, head_dim)
        q, k, v = (z.transpose(1, 2) for z in qkv.unbind(3))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return _dropout(self.proj(y.transpose(1, 2).flatten(2)), p)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + _dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.dropout if self.training else 0.0)


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(tokens, targets)`` returns the mean cross-entropy."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialization: keeps the first losses near ln(vocab_size)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = _dropout(self.wte(tokens) + self.wpe(pos), self.cfg.dropout if self.training else 0.0)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def random_batch(cfg: GPTConfig, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and next-token targets (``targets`` is ``tokens`` shifted by one)."""
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


@dataclass(frozen=True)
class ResNetConfig:
    """A ResNet-18-style CNN, small by default so it trains fast on CPU.

    ResNet-18 itself is ``widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2)`` on 224x224 images."""

    in_channels: int = 3
    num_classes: int = 10
    widths: tuple[int, ...] = (8, 16)
    blocks: tuple[int, ...] = (1, 1)
    image_size: int = 8


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual; a strided 1x1 conv + BatchNorm
    projects the shortcut when the shape changes (ResNet's "option B")."""

    def __init__(self, in_ch: int, out_ch: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """``forward(images, labels)`` returns the mean cross-entropy (logits without labels)."""

    def __init__(self, cfg: ResNetConfig = ResNetConfig()):
        super().__init__()
        self.cfg = cfg
        self.stem = nn.Sequential(
            nn.Conv2d(cfg.in_channels, cfg.widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(cfg.widths[0]), nn.ReLU()
        )
        layers, in_ch = [], cfg.widths[0]
        for i, (width, count) in enumerate(zip(cfg.widths, cfg.blocks)):
            for j in range(count):
                layers.append(BasicBlock(in_ch, width, 2 if i > 0 and j == 0 else 1))
                in_ch = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(in_ch, cfg.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.layers(self.stem(images))
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        if labels is None:
            return logits
        return F.cross_entropy(logits, labels)


def random_images(cfg: ResNetConfig, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (standard normal pixels) and random class labels."""
    images = torch.randn(batch, cfg.in_channels, cfg.image_size, cfg.image_size, generator=generator)
    return images, torch.randint(0, cfg.num_classes, (batch,), generator=generator)


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP,
    untied embeddings), optionally with mixture-of-experts MLPs: the shapes of Llama 3 and
    Mixtral without transformers installed (``zerofx plan``'s built-in models)."""

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    d_model: int = 64
    ffn_hidden: int = 176
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    n_experts: int = 0  # 0: dense MLPs
    experts_per_token: int = 2


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.n_head * self.head_dim, bias=False)
        self.kv = nn.Linear(cfg.d_model, 2 * cfg.n_kv_head * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # kv's rows are head-major ((kv head, k|v, head_dim)) and head counts are read from the
        # projections' widths, so column-wise tensor parallelism gives each rank whole heads
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k, v = (z.transpose(1, 2) for z in self.kv(x).view(b, t, -1, 2, self.head_dim).unbind(3))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate and up rows interleave (gate_j, up_j), so a column-wise split keeps pairs together
        gate, up = self.gate_up(x).unflatten(-1, (-1, 2)).unbind(-1)
        return self.down(F.silu(gate) * up)


class ExpertChoiceMoE(nn.Module):
    """Mixture of experts with expert-choice routing (Zhou et al., 2022): each expert takes the
    ``tokens · experts_per_token / n_experts`` tokens that score it highest, so every shape is
    fixed by the batch (no data-dependent sizes) and the compute equals top-k routing's."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_experts, self.k = cfg.n_experts, cfg.experts_per_token
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, 2 * cfg.ffn_hidden))
        self.down = nn.Parameter(torch.empty(cfg.n_experts, cfg.ffn_hidden, cfg.d_model))
        nn.init.normal_(self.gate_up, std=0.02)
        nn.init.normal_(self.down, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        scores = self.router(flat).softmax(dim=-1)  # (tokens, experts)
        capacity = max(1, b * t * self.k // self.n_experts)
        weight, chosen = scores.t().topk(capacity, dim=-1)  # (experts, capacity)
        picked = flat[chosen]  # (experts, capacity, d)
        gate, up = torch.bmm(picked, self.gate_up).chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, self.down) * weight.unsqueeze(-1)
        return torch.zeros_like(flat).index_add(0, chosen.reshape(-1), out.reshape(-1, d)).view(b, t, d)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = ExpertChoiceMoE(cfg) if cfg.n_experts else SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """``forward(tokens, targets)`` returns the mean cross-entropy (logits without targets)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        head_dim = cfg.d_model // cfg.n_head
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device, dtype=torch.float32)
        angles = torch.outer(pos, self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        x = self.embed(tokens)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
