"""A small Mixture-of-Experts decoder: the GPT example with every MLP a ``graphpass.nn.MoE``.

One file, plain PyTorch plus graphpass's MoE layer: token + position embeddings, pre-norm blocks
with causal attention and an MoE MLP (a gate from ``graphpass.nn.gates``, SwiGLU experts), a
final LayerNorm and an LM head tied to the token embedding. ``forward(idx, targets)`` returns
the mean cross-entropy plus every layer's auxiliary losses (load balancing, router z-loss), the
loss graphpass trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt import CausalSelfAttention, GPTConfig
from graphpass.nn import MoE


@dataclass(frozen=True)
class MoEGPTConfig:
    """Model shape; the defaults make a 0.5M-parameter model of 4 experts per layer."""

    vocab_size: int = 256
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    num_experts: int = 4
    d_hidden: int = 96
    gate: str = "topk"
    k: int = 2
    capacity_factor: float | None = None
    drop_policy: str = "position"
    gate_options: dict = field(default_factory=dict)


class MoEBlock(nn.Module):
    def __init__(self, config: MoEGPTConfig):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(config.n_embd), nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(GPTConfig(n_embd=config.n_embd, n_head=config.n_head, bias=False))
        self.moe = MoE(config.n_embd, config.d_hidden, config.num_experts, config.gate, k=config.k,
                       capacity_factor=config.capacity_factor, drop_policy=config.drop_policy,
                       **config.gate_options)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln_1(x))
        y, aux = self.moe(self.ln_2(x), token_ids=idx)
        return x + y, aux


class MoEGPT(nn.Module):
    def __init__(self, config: MoEGPTConfig = MoEGPTConfig()):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(MoEBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        aux = x.new_zeros(())
        for block in self.h:
            x, block_aux = block(x, idx)
            aux = aux + block_aux
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) + aux
