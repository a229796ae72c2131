"""Example model configs at real sizes: GPT-3 1.3B/6.7B/13B/175B, Llama-like 7B/70B, and a
0.9B classifier MLP.

These are for *planning*: build them on the meta device so no memory is allocated, then hand
the model and :func:`example_inputs` to graphpass::

    import torch
    from configs import build, example_inputs, param_count

    with torch.device("meta"):          # plan without allocating a single weight
        model = build("gpt3-175b")
    idx, targets = example_inputs("gpt3-175b", batch=1, device="meta")
    param_count("gpt3-175b")            # analytic; builds nothing

Every model's ``forward(idx, targets)`` returns the mean next-token cross-entropy loss, the
contract ``graphpass.compile`` expects; ``targets`` are the already-shifted next tokens (no
shift happens inside the model), exactly as for :class:`gpt.GPT`.

GPT-3 sizes follow Table 2.1 of Brown et al., "Language Models are Few-Shot Learners" (2020),
mapped onto the example :class:`gpt.GPT` (learned positions, pre-norm LayerNorm with bias, GELU
MLP of width ``4 * n_embd``, LM head tied to the token embedding). Two deviations from the table,
both the ones Megatron-LM and nanoGPT make:

* vocabulary 50304 instead of GPT-2's 50257: padded up to a multiple of 64 (and so of every
  tensor-parallel degree up to 64) for efficient, evenly sharded embeddings and LM heads;
* head count / width where the table is inconsistent (see the comments on each entry).

Llama-like models need SwiGLU, RMSNorm, rotary positions and grouped-query attention, which the
example GPT does not have, so :func:`build_llama_like` builds a Hugging Face ``transformers``
``LlamaForCausalLM`` (imported lazily) wrapped to the same ``forward(idx, targets) -> loss``.

Parameter counts (:func:`param_count`, equal to ``sum(p.numel() for p in model.parameters())``;
a tied weight counts once):

==============  ================  ==========
name            params            nominal
==============  ================  ==========
gpt3-1.3b        1,315,819,520    1.3e9
gpt3-6.7b        6,658,596,864    6.7e9
gpt3-13b        12,853,626,880    13e9
gpt3-175b      174,604,836,864    175e9
llama-7b         6,738,415,616    6.74e9
llama-70b       68,976,648,192    69e9
mlp-0.9b           888,865,768    0.89e9
==============  ================  ==========

The GPT-3 "nominal" figures are rounded marketing names, counted with the paper's own
conventions (vocabulary 50257, and the 13B width 5140), so the analytic counts here land within
about 1.5% of them, not exactly; the Llama figures match the published 6.74B / 68.98B closely.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn as nn
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # so `import gpt` works however this module is imported
    sys.path.insert(0, _HERE)
from gpt import GPT, GPTConfig  # noqa: E402

GPT2_VOCAB = 50257
"""GPT-2 BPE vocabulary, which GPT-3 uses."""
PADDED_VOCAB = 50304
"""``GPT2_VOCAB`` rounded up to a multiple of 64, as Megatron-LM and nanoGPT pad it."""
GPT3_CONTEXT = 2048

GPT3: dict[str, GPTConfig] = {
    # Table 2.1 "GPT-3 XL": n_layers 24, d_model 2048, n_heads 24, d_head 128. The row is
    # self-inconsistent (24 * 128 = 3072 != 2048, and 2048 is not divisible by 24), so keep
    # d_model 2048 and d_head 128, which gives 16 heads (as Megatron-LM's 1.3B config does).
    "gpt3-1.3b": GPTConfig(
        vocab_size=PADDED_VOCAB, block_size=GPT3_CONTEXT, n_layer=24, n_head=16, n_embd=2048,
        dropout=0.0, bias=True,
    ),
    # Table 2.1 "GPT-3 6.7B": 32 layers, d_model 4096, 32 heads, d_head 128 (consistent).
    "gpt3-6.7b": GPTConfig(
        vocab_size=PADDED_VOCAB, block_size=GPT3_CONTEXT, n_layer=32, n_head=32, n_embd=4096,
        dropout=0.0, bias=True,
    ),
    # Table 2.1 "GPT-3 13B": 40 layers, d_model 5140, 40 heads, d_head 128. 5140 is not
    # divisible by 40 (and 40 * 128 = 5120), so use d_model 5120 as Megatron-LM does.
    "gpt3-13b": GPTConfig(
        vocab_size=PADDED_VOCAB, block_size=GPT3_CONTEXT, n_layer=40, n_head=40, n_embd=5120,
        dropout=0.0, bias=True,
    ),
    # Table 2.1 "GPT-3 175B": 96 layers, d_model 12288, 96 heads, d_head 128 (consistent).
    "gpt3-175b": GPTConfig(
        vocab_size=PADDED_VOCAB, block_size=GPT3_CONTEXT, n_layer=96, n_head=96, n_embd=12288,
        dropout=0.0, bias=True,
    ),
}


@dataclass(frozen=True)
class LlamaLikeConfig:
    """Shape of a Llama-style decoder (RMSNorm, rotary positions, SwiGLU MLP, GQA, untied head)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


LLAMA: dict[str, LlamaLikeConfig] = {
    # Llama 2 7B (Touvron et al. 2023): multi-head attention, no GQA.
    "llama-7b": LlamaLikeConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
    ),
    # Llama 2 70B: grouped-query attention with 8 key/value heads.
    "llama-70b": LlamaLikeConfig(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
    ),
}

@dataclass(frozen=True)
class MLPConfig:
    """A classifier MLP: ``depth`` hidden linears of ``width`` with GELU after the first from
    ``inputs`` features, then a linear to ``classes`` logits and a cross-entropy loss. The
    linears are a list, not repeated layers of several ops, so Megatron's pattern (which pairs
    the linears within a layer) shards only the logits; the op-level planner places the rest
    (``graphpass/planner/op_placement.py``)."""

    inputs: int = 4096
    width: int = 16384
    depth: int = 4
    classes: int = 1000


MLPS: dict[str, MLPConfig] = {
    # Wide enough that its optimizer state does not fit small budgets unsharded (0.89B params).
    "mlp-0.9b": MLPConfig(inputs=4096, width=16384, depth=4, classes=1000),
}

CONFIGS: dict[str, Union[GPTConfig, LlamaLikeConfig, MLPConfig]] = {**GPT3, **LLAMA, **MLPS}

NOMINAL_PARAMS: dict[str, float] = {
    "gpt3-1.3b": 1.3e9,
    "gpt3-6.7b": 6.7e9,
    "gpt3-13b": 13e9,
    "gpt3-175b": 175e9,
    "llama-7b": 6.74e9,
    "llama-70b": 69e9,
    "mlp-0.9b": 0.89e9,
}


class MLPClassifier(nn.Module):
    """:class:`MLPConfig`'s model: ``forward(x, targets)`` returns the mean cross-entropy of the
    logits of ``x`` (``[batch, inputs]``, cast to the weights' dtype) against ``targets``."""

    def __init__(self, config: MLPConfig):
        super().__init__()
        dims = [config.inputs] + [config.width] * config.depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(config.width, config.classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = x.to(self.head.weight.dtype)
        for layer in self.layers:
            x = F.gelu(layer(x))
        return F.cross_entropy(self.head(x), targets)


class LlamaLike(nn.Module):
    """Hugging Face ``LlamaForCausalLM`` with the ``forward(idx, targets) -> loss`` contract."""

    def __init__(self, config: LlamaLikeConfig):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.config = config
        hf_config = LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=config.tie_word_embeddings,
            attention_bias=False,
            mlp_bias=False,
            use_cache=False,
        )
        hf_config._attn_implementation = "sdpa"
        self.model = LlamaForCausalLM(hf_config)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=idx, use_cache=False).logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_llama_like(config: LlamaLikeConfig) -> LlamaLike:
    """Build a Llama-like model; wrap the call in ``with torch.device("meta"):`` to plan big ones
    without allocating (a real-device 70B needs ~276 GB in fp32)."""
    return LlamaLike(config)


def _config(name_or_config) -> Union[GPTConfig, LlamaLikeConfig, MLPConfig]:
    if isinstance(name_or_config, (GPTConfig, LlamaLikeConfig, MLPConfig)):
        return name_or_config
    try:
        return CONFIGS[name_or_config]
    except KeyError:
        raise KeyError(f"unknown config {name_or_config!r}; known: {sorted(CONFIGS)}") from None


def build(name) -> nn.Module:
    """Build the model for a config name (or config object) on the current default device.

    Use ``with torch.device("meta"): build(name)`` to plan without allocating.
    """
    config = _config(name)
    if isinstance(config, GPTConfig):
        return GPT(config)
    if isinstance(config, MLPConfig):
        return MLPClassifier(config)
    return build_llama_like(config)


def example_inputs(name, batch: int = 1, device="meta", seq_len: int | None = None):
    """``(idx, targets)`` int64 tensors of shape ``(batch, seq_len)``; ``seq_len`` defaults to
    the config's full context (``block_size`` / ``max_position_embeddings``). For an
    :class:`MLPConfig`: ``(x, targets)``, float32 ``[batch, inputs]`` and int64 ``[batch]``."""
    config = _config(name)
    device = torch.device(device)
    if isinstance(config, MLPConfig):
        if device.type == "meta":
            return torch.empty(batch, config.inputs, device=device), torch.empty(batch, dtype=torch.long, device=device)
        return torch.randn(batch, config.inputs, device=device), torch.randint(0, config.classes, (batch,), device=device)
    if isinstance(config, GPTConfig):
        vocab, context = config.vocab_size, config.block_size
    else:
        vocab, context = config.vocab_size, config.max_position_embeddings
    T = context if seq_len is None else seq_len
    if T > context:
        raise ValueError(f"seq_len={T} exceeds the context length {context}")
    device = torch.device(device)
    if device.type == "meta":
        return (torch.empty(batch, T, dtype=torch.long, device=device),
                torch.empty(batch, T, dtype=torch.long, device=device))
    return (torch.randint(0, vocab, (batch, T), device=device),
            torch.randint(0, vocab, (batch, T), device=device))


def param_count(name) -> int:
    """Parameter count, computed analytically (no model is built); a tied weight counts once."""
    c = _config(name)
    if isinstance(c, MLPConfig):
        dims = [c.inputs] + [c.width] * c.depth + [c.classes]
        return sum(a * b + b for a, b in zip(dims, dims[1:]))
    if isinstance(c, GPTConfig):
        d, b = c.n_embd, int(c.bias)
        attn = 4 * d * d + 4 * d * b  # q, k, v, proj
        mlp = 8 * d * d + (4 * d + d) * b  # up, down
        norms = 2 * (d + d * b)  # ln_1, ln_2 (weight [+ bias])
        embed = c.vocab_size * d + c.block_size * d  # wte (tied with lm_head) + wpe
        return embed + c.n_layer * (attn + mlp + norms) + (d + d * b)  # + ln_f
    d, hd = c.hidden_size, c.head_dim
    attn = d * d + 2 * d * c.num_key_value_heads * hd + d * d  # q, k, v, o (no biases)
    mlp = 3 * d * c.intermediate_size  # gate, up, down
    norms = 2 * d  # input / post-attention RMSNorm
    embed = c.vocab_size * d * (1 if c.tie_word_embeddings else 2)  # embed_tokens + lm_head
    return embed + c.num_hidden_layers * (attn + mlp + norms) + d  # + final norm
