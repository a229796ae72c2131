"""Models the tests train, each built deterministically from a seed.

``build(name)`` returns a fresh model; ``batches(name, n, batch)`` returns ``n`` global batches.
Every rank and the single-process reference call these with the same arguments, so they start
from the same weights and see the same data.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt import GPT, GPTConfig
from moe_gpt import MoEGPT, MoEGPTConfig

VOCAB = 256
SEQ = 32

#: graphpass.nn.MoE decoders, one per gate and mode (4 experts of 96 each, 2 layers).
MOE_CONFIGS = {
    "moe_topk": MoEGPTConfig(vocab_size=VOCAB, block_size=SEQ),  # GShard top-2, dropless
    "moe_topk_capacity": MoEGPTConfig(vocab_size=VOCAB, block_size=SEQ, capacity_factor=1.0),
    "moe_switch_score": MoEGPTConfig(vocab_size=VOCAB, block_size=SEQ, gate="switch", capacity_factor=1.25,
                                     drop_policy="score"),
    "moe_expert_choice": MoEGPTConfig(vocab_size=VOCAB, block_size=SEQ, gate="expert_choice"),
    "moe_hash": MoEGPTConfig(vocab_size=VOCAB, block_size=SEQ, gate="hash", gate_options={"vocab_size": VOCAB}),
    "moe_dense_to_sparse": MoEGPTConfig(vocab_size=VOCAB, block_size=SEQ, gate="dense_to_sparse",
                                        gate_options={"noise": False, "threshold": 0.2, "temperature": (0.05, 0.05)}),
    # top-2 of 8 experts, routing skewed towards the first ones (SkewedGate): the case for
    # dynamic expert placement
    "moe_skewed": MoEGPTConfig(vocab_size=VOCAB, block_size=SEQ, num_experts=8, d_hidden=32),
}


def _skewed_gate(d_model: int, num_experts: int) -> nn.Module:
    """A top-2 gate whose logits favour the first experts by ``-log(e + 1)``: about half of the
    rows go to experts 0 and 1, which contiguous placement puts on one rank."""
    from graphpass.nn.gates import TopKGate

    class SkewedGate(TopKGate):
        def __init__(self):
            super().__init__(d_model, num_experts, k=2)
            self.register_buffer("bias", -torch.log(torch.arange(1, num_experts + 1, dtype=torch.float32)))

        def logits(self, x: torch.Tensor) -> torch.Tensor:
            return super().logits(x) + self.bias

    return SkewedGate()


class LoopExperts(nn.Module):
    """Experts as torchtitan writes them without grouped GEMMs (``GroupedExperts``' for-loop
    path): stacked ``w1``/``w3`` ``[E, h, d]`` and ``w2`` ``[E, d, h]``, a Python loop over the
    per-expert token counts (``tolist()``), padding rows zero."""

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, dim) / dim ** 0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden) / hidden ** 0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden, dim) / dim ** 0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = [int(c) for c in num_tokens_per_expert.tolist()]
        pieces = torch.split(x[: sum(counts)], counts, dim=0)
        out = torch.cat([(F.silu(p @ self.w1[e].t()) * (p @ self.w3[e].t())) @ self.w2[e].t()
                         for e, p in enumerate(pieces)])
        return torch.vstack((out, out.new_zeros(x.shape[0] - sum(counts), out.shape[-1])))


class LoopMoE(nn.Module):
    """torchtitan's MoE layout: a softmax top-k router over flat tokens, counts by ``histc``
    (tallied in a buffer, as its load balancing does), tokens sorted by expert, scores applied
    before the experts, outputs scattered back."""

    def __init__(self, dim: int, hidden: int, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = LoopExperts(dim, hidden, num_experts)
        self.num_experts, self.top_k = num_experts, top_k
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.reshape(-1, dim)
        scores = F.softmax(self.gate(x).float(), dim=1)
        top_scores, chosen = scores.topk(self.top_k, dim=1)
        counts = torch.histc(chosen.reshape(-1).float(), bins=self.num_experts, min=0, max=self.num_experts)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        order = torch.argsort(chosen.reshape(-1), stable=True)
        token = order // self.top_k
        routed = x[token] * top_scores.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        out = self.experts(routed, counts)
        return torch.zeros_like(x).index_add(0, token, out).reshape(bs, slen, dim)


class LoopMoELM(nn.Module):
    """A 2-layer decoder whose MLPs are :class:`LoopMoE` layers (the test model of a
    torchtitan-style Mixture-of-Experts)."""

    def __init__(self, dim: int = 64, n_head: int = 4, hidden: int = 48):
        super().__init__()
        from gpt import CausalSelfAttention

        self.wte, self.wpe = nn.Embedding(VOCAB, dim), nn.Embedding(SEQ, dim)
        self.attn = nn.ModuleList(CausalSelfAttention(GPTConfig(n_embd=dim, n_head=n_head, bias=False))
                                  for _ in range(2))
        self.moe = nn.ModuleList(LoopMoE(dim, hidden) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(5))
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for i in range(2):
            x = x + self.attn[i](self.norms[2 * i](x))
            x = x + self.moe[i](self.norms[2 * i + 1](x))
        logits = self.head(self.norms[4](x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class EncoderLM(nn.Module):
    """``torch.nn.TransformerEncoder`` with token embeddings and an LM head."""

    def __init__(self, d_model: int = 64, nhead: int = 4, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, 2 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.encoder(self.emb(idx)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class TransformerLM(nn.Module):
    """``torch.nn.Transformer`` (encoder, decoder, cross-attention) on token embeddings: its
    cross-attention splits ``in_proj_weight`` into q and kv weights inside the graph."""

    def __init__(self, d_model: int = 64, nhead: int = 4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d_model)
        self.transformer = nn.Transformer(d_model, nhead, 1, 1, 2 * d_model, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        return F.cross_entropy(self.head(self.transformer(x, x)).flatten(0, 1), targets.flatten())


class AttentionWeightsLM(nn.Module):
    """Sequence-first ``nn.MultiheadAttention`` blocks that also return the attention weights
    (``need_weights=True``: the batched-matmul path, not fused attention)."""

    def __init__(self, d_model: int = 64, nhead: int = 4, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d_model)
        self.attns = nn.ModuleList(nn.MultiheadAttention(d_model, nhead) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).transpose(0, 1)
        for attn, norm in zip(self.attns, self.norms):
            h = norm(x)
            out, weights = attn(h, h, h, need_weights=True)
            x = x + out + 0.0 * weights.sum()
        return F.cross_entropy(self.head(x.transpose(0, 1)).flatten(0, 1), targets.flatten())


class MLP(nn.Module):
    """A plain MLP regressor with MSE loss."""

    def __init__(self, width: int = 64, depth: int = 3):
        super().__init__()
        dims = [16] + [width] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(self.out(x).squeeze(-1), y)


class FusedGPT(nn.Module):
    """nanoGPT's layout: one ``c_attn`` linear makes q, k and v (heads contiguous within each),
    split with ``split(n_embd, dim=2)``; a tied LM head."""

    def __init__(self, n_embd: int = 64, n_head: int = 4, n_layer: int = 2):
        super().__init__()
        self.n_head = n_head
        self.wte = nn.Embedding(VOCAB, n_embd)
        self.wpe = nn.Embedding(SEQ, n_embd)
        self.h = nn.ModuleList(_FusedBlock(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():  # nanoGPT's init: small weights, so the tied logits are small
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class _FusedBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class ResNet(nn.Module):
    """A small ResNet (torchvision's BasicBlock layout: conv-bn-relu pairs with a residual, a
    strided 1x1 shortcut between stages, global average pool, a linear classifier)."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, width = [], widths[0]
        for i, out in enumerate(widths):
            blocks.append(_BasicBlock(width, out, stride=1 if i == 0 else 2))
            width = out
        self.layers = nn.ModuleList(blocks)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.layers:
            x = block(x)
        return F.cross_entropy(self.fc(x.mean(dim=(2, 3))), y)


class ConvNet(nn.Module):
    """A VGG-style CNN: biased convolutions, max pooling, a batch norm, global average pooling and
    a two-linear classifier."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.bn = nn.BatchNorm2d(32)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.bn(self.conv3(x))), 1).flatten(1)
        return F.cross_entropy(self.fc2(F.relu(self.fc1(x))), y)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class HFSeq2SeqLM(nn.Module):
    """A Hugging Face encoder-decoder (T5) whose forward returns ``outputs.loss``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, labels=labels).loss


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM whose forward returns ``outputs.loss``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, labels=labels).loss


class TableMajor(nn.Module):
    """Ids given table-major: multi-hot ``ids [tables, batch*hots]`` with ``offsets [tables,
    batch]`` read through ``zip`` (the reference DLRM's ``lS_i`` / ``lS_o`` as tensors, the ids
    hashed into the table by ``%``), and one-hot ``onehot [tables, batch]`` read as
    ``onehot[t]``."""

    def __init__(self, bags: int = 3, onehots: int = 2, rows: int = 40, include_last_offset: bool = False):
        super().__init__()
        self.rows = rows
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, 4, mode="mean", include_last_offset=include_last_offset)
                                  for _ in range(bags))
        self.onehots = nn.ModuleList(nn.Embedding(rows, 4) for _ in range(onehots))
        self.head = nn.Linear(4 * (bags + onehots) + 5, 1)

    def forward(self, dense, ids, offsets, onehot, labels):
        pooled = [dense]
        for table, i, o in zip(self.bags, ids, offsets):
            pooled.append(table(i % self.rows, o))
        for t, table in enumerate(self.onehots):
            pooled.append(table(onehot[t]))
        return F.mse_loss(self.head(torch.cat(pooled, 1)).squeeze(1), labels)


def table_major_batch(batch: int = 8, hots: int = 2, bags: int = 3, onehots: int = 2, seed: int = 0,
                      include_last_offset: bool = False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (bags, batch * hots), generator=g)
    offsets = torch.arange(0, batch * hots + (1 if include_last_offset else 0), hots).expand(bags, -1).contiguous()
    return (torch.randn(batch, 5, generator=g), ids, offsets, torch.randint(0, 40, (onehots, batch), generator=g),
            torch.randn(batch, generator=g))


class ScaledBy(nn.Module):
    """``model``'s loss scaled by a weighted sum of a small input every sample shares (its
    last input, not split along the batch: ``batch_dims={...: None}``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        *batch, scale = inputs
        return self.model(*batch) * (scale[0] + scale[1] * 0.25)


def build(name: str, seed: int = 0) -> nn.Module:
    """A fresh model called ``name`` with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=64))
    if name == "gpt_deep":  # enough layers for 4 pipeline stages
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=64))
    if name == "encoder":
        return EncoderLM()
    if name == "mlp":
        return MLP()
    if name == "gpt_3heads":  # 3 heads do not split 2 or 4 ways: Megatron's layout is refused at tp 2 and 4
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=3, n_embd=48))
    if name == "transformer":
        return TransformerLM()
    if name == "mha_weights":
        return AttentionWeightsLM()
    if name == "hf_gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
        return HFCausalLM(GPT2LMHeadModel(config))
    if name in ("hf_llama", "hf_llama_mha", "hf_llama_mqa", "hf_llama_deep"):
        from transformers import LlamaConfig, LlamaForCausalLM

        # hf_llama uses grouped-query attention (2 kv heads for 4 query heads); hf_llama_mha has
        # 4 kv heads; hf_llama_mqa one kv head and eager (matmul) attention; hf_llama_deep is
        # hf_llama with 4 layers (for 4 pipeline stages).
        kv_heads = {"hf_llama": 2, "hf_llama_mha": 4, "hf_llama_mqa": 1, "hf_llama_deep": 2}[name]
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
            num_hidden_layers=4 if name == "hf_llama_deep" else 2,
            num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=SEQ,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
            attn_implementation="eager" if name == "hf_llama_mqa" else "sdpa",
        )
        return HFCausalLM(LlamaForCausalLM(config))
    if name == "fused_gpt":
        return FusedGPT()
    if name == "resnet":
        return ResNet()
    if name == "convnet":
        return ConvNet()
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "hf_neox":  # fused q/k/v with heads interleaved: view(B, T, heads, 3 * head_dim)
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        config = GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0, **common)
        return HFCausalLM(GPTNeoXForCausalLM(config))
    if name == "hf_phi3":  # fused q/k/v sliced and fused gate/up chunked
        from transformers import Phi3Config, Phi3ForCausalLM

        config = Phi3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                            intermediate_size=128, max_position_embeddings=SEQ, **common)
        return HFCausalLM(Phi3ForCausalLM(config))
    if name == "hf_t5":  # encoder-decoder with eager (matmul) attention and a relative position bias
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
                          decoder_start_token_id=0, **common)
        return HFSeq2SeqLM(T5ForConditionalGeneration(config))
    if name == "hf_mixtral":  # Mixture-of-Experts decoder (top-2 of 4 experts)
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                               intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=SEQ, **common)
        return HFCausalLM(MixtralForCausalLM(config))
    if name == "hf_qwen2_moe":  # MoE decoder with a gated shared expert (top-2 of 4 routed experts)
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        config = Qwen2MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                num_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ, **common)
        return HFCausalLM(Qwen2MoeForCausalLM(config))
    if name == "tt_moe":  # torchtitan-style MoE: experts as a loop over tolist() counts
        return LoopMoELM()
    if name.startswith("moe_"):  # graphpass.nn.MoE decoders: moe_topk, moe_switch, moe_expert_choice, ...
        model = MoEGPT(MOE_CONFIGS[name])
        if name == "moe_skewed":
            for block in model.h:
                block.moe.gate = _skewed_gate(block.moe.gate.router.in_features, block.moe.num_experts)
        return model
    raise KeyError(f"unknown test model {name!r}")


MODELS = ("gpt", "encoder", "mlp", "hf_gpt2", "hf_llama")


def batches(name: str, n: int, batch: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` global batches of size ``batch`` for model ``name``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if name == "mlp":
            out.append((torch.randn(batch, 16, generator=g), torch.randn(batch, generator=g)))
        elif name in ("resnet", "convnet"):
            out.append((torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g)))
        else:
            out.append(
                (
                    torch.randint(0, VOCAB, (batch, SEQ), generator=g),
                    torch.randint(0, VOCAB, (batch, SEQ), generator=g),
                )
            )
    return out


#: one-process references already trained in this process (the parity tests of several files and
#: world sizes compare with the same ones)
_REFERENCES: dict[tuple, tuple] = {}


def train_reference(name: str, steps: int = 3, batch: int = 8, lr: float = 0.05):
    """Train ``name`` in this process with SGD+momentum: (losses, state_dict, grads of step 1),
    a copy of this process's earlier run with the same arguments if there is one."""
    from graphpass.testing import train_reference as reference

    key = (name, steps, batch, lr)
    if key not in _REFERENCES:
        trace = reference(lambda: build(name), batches(name, steps, batch), "sgd-momentum", lr)
        _REFERENCES[key] = (trace.losses, trace.state, trace.grads)
    return copy.deepcopy(_REFERENCES[key])


def train_compiled(dmodel, data, lr: float = 0.05, on_first_step=None, optimizer=None) -> list[float]:
    """Train a compiled model with SGD+momentum (as :func:`train_reference` does), or with
    ``optimizer``; the losses.

    ``on_first_step(dmodel)`` runs after the first backward, before the optimizer step (to read
    gradients).
    """
    opt = optimizer if optimizer is not None else torch.optim.SGD(dmodel.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step, b in enumerate(data):
        losses.append(dmodel.train_step(*b).item())
        if step == 0 and on_first_step is not None:
            on_first_step(dmodel)
        opt.step()
        opt.zero_grad()
    return losses


def assert_matches_reference(where: str, losses, state, ref_losses, ref_state, grads=None, ref_grads=None,
                             rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Losses, full state (same keys, same order) and optionally gradients match one process.

    The default tolerances are the parity tests' (see tests/test_dp.py for why).
    """
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=0, msg=lambda m: f"{where} loss: {m}")
    assert list(state) == list(ref_state), where
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], rtol=rtol, atol=atol, msg=lambda m: f"{where} {key}: {m}")
    for key in grads or {}:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=rtol, atol=atol, msg=lambda m: f"{where} grad {key}: {m}")


#: this process's captures of zoo models, reused by :func:`compile` (zoo models are fixed code
#: and configs, so equal fingerprints mean equal graphs; see graphpass.reusing_captures)
CAPTURES: dict = {}


def reuse_captures_on_this_rank() -> None:
    """A pool rank's initializer (tests/conftest.py): every capture on the rank, by
    :func:`compile` or a test's own ``gp.compile``, reuses the rank's earlier capture of an equal
    model for as long as the rank lives."""
    from graphpass.capture import reusing_captures

    _REUSING.enter_context(reusing_captures(CAPTURES))


#: keeps the rank's reuse block open (see reuse_captures_on_this_rank)
_REUSING = contextlib.ExitStack()


def compile(model: nn.Module, example_inputs, strategy):  # noqa: A001 - gp.compile's name
    """``gp.compile`` on the local cluster, reusing this process's capture of an equal model at the
    same local batch: the parity matrices compile one model under many strategies, and capture
    (export) is most of a compile. Every first capture per model and shape is a real one."""
    import graphpass as gp

    with gp.reusing_captures(CAPTURES):
        return gp.compile(model, gp.Cluster.local(), example_inputs=example_inputs, strategy=strategy)


def compile_on_ranks(name: str, strategy_kwargs: dict, steps: int, batch: int, plan_edit=None):
    """(dmodel, data) for model ``name`` on this launched job: ``Strategy(dp=world, **kwargs)``,
    or the plan it implies edited by ``plan_edit(plan) -> Plan`` (hand-written plans)."""
    import torch.distributed as dist

    import graphpass as gp
    from graphpass.plan_builder import plan_from_strategy
    from graphpass.capture import capture

    world = dist.get_world_size()
    model = build(name)
    data = batches(name, steps, batch)
    strategy = gp.Strategy(**{"dp": world, **strategy_kwargs})
    if plan_edit is not None:
        with gp.reusing_captures(CAPTURES):
            gm = capture(model, tuple(t[: batch // world] for t in data[0])).gm
        strategy = plan_edit(plan_from_strategy(gm, strategy, ["test"]))
    return compile(model, data[0], strategy), data
