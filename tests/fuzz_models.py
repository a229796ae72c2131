"""A family of small decoder-only transformers for the fuzzed parity suite (tests/test_fuzz.py).

One config picks the depth, width, query and key/value heads (multi-head, grouped-query or
multi-query attention), whether the LM head is tied to the token embedding, whether linears and
norms have biases, the norm (``nn.LayerNorm`` or an RMSNorm written out as Llama writes it), the
MLP (GELU, ReLU or SiLU between two linears, or SwiGLU's gated pair), the attention
(``scaled_dot_product_attention``; eager matmul + softmax with an additive causal mask, as Hugging
Face's eager attention; or eager with ``masked_fill`` of the future, as nanoGPT's and minGPT's),
the positions (learned, as GPT-2, or rotary, as Llama), the vocabulary and the sequence length. Plain
``nn.Module`` code, no Hugging Face: every variant is a pattern graphpass meets in real models.

``build(config)`` is seeded, so every rank and the single-process reference start from the same
weights; ``batches(config, n, batch)`` gives them the same data. ``forward(idx, targets)``
returns the mean next-token cross-entropy, as examples/gpt.py does.

Choices are stored on the modules as plain ``str``/``int``/``bool`` attributes, never only in a
config object: ``graphpass.reusing_captures`` tells models apart by their plain attributes, so
two models that differ only in, say, the activation must not share a captured graph.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "relu", "silu", "swiglu")
ATTENTIONS = ("sdpa", "eager", "eager_masked_fill")
POSITIONS = ("learned", "rope")


@dataclass(frozen=True)
class FuzzConfig:
    """The shape and the code paths of one generated model.

    ``heads`` must divide ``width`` and ``kv_heads`` must divide ``heads`` (``kv_heads == heads``
    is multi-head attention, ``1`` multi-query). ``mlp_ratio * width`` is the MLP's hidden width.
    """

    depth: int = 2
    width: int = 32
    heads: int = 4
    kv_heads: int = 4
    mlp_ratio: int = 2
    tied: bool = True
    bias: bool = True
    norm: str = "layernorm"
    activation: str = "gelu"
    attention: str = "sdpa"
    position: str = "learned"
    vocab: int = 64
    seq: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.width % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"FuzzConfig: heads={self.heads} must divide width={self.width} and "
                             f"kv_heads={self.kv_heads} must divide heads")
        if self.position == "rope" and (self.width // self.heads) % 2:
            raise ValueError(f"FuzzConfig: rotary positions need an even head size, got {self.width // self.heads}")
        for name, allowed in (("norm", NORMS), ("activation", ACTIVATIONS), ("attention", ATTENTIONS),
                              ("position", POSITIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"FuzzConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def short(self) -> str:
        """A one-line description, for failure messages and the bench's log."""
        return (f"L{self.depth} d{self.width} h{self.heads}/kv{self.kv_heads} mlp x{self.mlp_ratio} "
                f"{'tied' if self.tied else 'untied'} {'bias' if self.bias else 'nobias'} {self.norm} "
                f"{self.activation} {self.attention} {self.position} V{self.vocab} T{self.seq}")

    def as_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """Llama's RMSNorm, by hand: ``x / sqrt(mean(x^2) + eps) * weight`` computed in fp32."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps) * self.weight


def _norm(config: FuzzConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.width)
    return nn.LayerNorm(config.width, bias=config.bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(seq: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary cos and sin tables, ``[seq, head_dim]`` each (base 10000)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    """Causal self-attention with separate q, k and v projections; k and v have ``kv_heads``
    heads, each repeated ``heads / kv_heads`` times to meet the query heads (Llama's
    ``repeat_kv``: expand, then reshape)."""

    def __init__(self, config: FuzzConfig):
        super().__init__()
        self.heads, self.kv_heads = config.heads, config.kv_heads
        self.head_dim = config.width // config.heads
        self.attention = config.attention
        self.q = nn.Linear(config.width, config.width, bias=config.bias)
        self.k = nn.Linear(config.width, self.kv_heads * self.head_dim, bias=config.bias)
        self.v = nn.Linear(config.width, self.kv_heads * self.head_dim, bias=config.bias)
        self.proj = nn.Linear(config.width, config.width, bias=config.bias)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        repeats = self.heads // self.kv_heads
        if repeats == 1:
            return x
        B, H, T, D = x.shape
        return x[:, :, None, :, :].expand(B, H, repeats, T, D).reshape(B, H * repeats, T, D)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
            if self.attention == "eager":  # Hugging Face's eager attention: an additive mask
                scores = scores + torch.full((T, T), float("-inf"), device=x.device).triu(1)
            else:  # nanoGPT's and minGPT's: masked_fill of the future
                causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                scores = scores.masked_fill(~causal, float("-inf"))
            y = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    """``down(act(up(x)))``, or SwiGLU's ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: FuzzConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.width
        self.activation = config.activation
        self.up = nn.Linear(config.width, hidden, bias=config.bias)
        self.gate = nn.Linear(config.width, hidden, bias=config.bias) if config.activation == "swiglu" else None
        self.down = nn.Linear(hidden, config.width, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        act = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[self.activation]
        return self.down(act(self.up(x)))


class Block(nn.Module):
    def __init__(self, config: FuzzConfig):
        super().__init__()
        self.norm_1 = _norm(config)
        self.attn = Attention(config)
        self.norm_2 = _norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), rope)
        return x + self.mlp(self.norm_2(x))


class FuzzLM(nn.Module):
    """A decoder-only LM of :class:`FuzzConfig`; ``forward(idx, targets)`` returns the mean loss."""

    def __init__(self, config: FuzzConfig):
        super().__init__()
        self.position = config.position
        self.head_dim = config.width // config.heads
        self.wte = nn.Embedding(config.vocab, config.width)
        self.wpe = nn.Embedding(config.seq, config.width) if config.position == "learned" else None
        self.h = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.norm_f = _norm(config)
        self.lm_head = nn.Linear(config.width, config.vocab, bias=config.bias and not config.tied)
        if config.tied:
            self.lm_head.weight = self.wte.weight
        # nanoGPT's init: small weights keep the (possibly tied) logits small, so three SGD steps
        # stay in the regime where fp32 reordering is the only difference between runs.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.normal_(module.bias, std=0.02)  # nonzero, so a dropped bias gradient shows
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.depth))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.wte(idx)
        rope = None
        if self.position == "learned":
            x = x + self.wpe(torch.arange(T, device=idx.device))
        else:
            rope = rotary(T, self.head_dim, idx.device)
        for block in self.h:
            x = block(x, rope)
        logits = self.lm_head(self.norm_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(config: FuzzConfig) -> FuzzLM:
    """A fresh model of ``config`` with weights drawn from ``config.seed``."""
    torch.manual_seed(config.seed)
    return FuzzLM(config)


def batches(config: FuzzConfig, n: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` global batches of ``batch`` token sequences (inputs, targets) for ``config``."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, config.vocab, (batch, config.seq), generator=g),
             torch.randint(0, config.vocab, (batch, config.seq), generator=g)) for _ in range(n)]
