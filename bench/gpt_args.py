"""What the benchmarks share: the example GPT's size options, its config, and synthetic batches.

Imported by the bench scripts (their directory is on ``sys.path`` when run as
``python bench/<name>.py``; launched ranks inherit that path).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from configs import LlamaLikeConfig  # noqa: E402
from gpt import GPTConfig  # noqa: E402  (examples/ is not a package)


def add_gpt_args(p: argparse.ArgumentParser, *, vocab_size: int, n_embd: int) -> None:
    """``--vocab-size --block-size --n-layer --n-head --n-embd`` with a bench's defaults."""
    p.add_argument("--vocab-size", type=int, default=vocab_size)
    p.add_argument("--block-size", type=int, default=128, help="sequence length")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=n_embd)


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    """The GPTConfig the size options describe."""
    return GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                     n_head=args.n_head, n_embd=args.n_embd)


def llama_config(args: argparse.Namespace) -> LlamaLikeConfig:
    """The Llama-style decoder (``--model llama``) the same size options describe: 4 heads, a
    SwiGLU width of 688 (~8/3 of 256), positions up to the block size."""
    return LlamaLikeConfig(vocab_size=args.vocab_size, hidden_size=args.n_embd, intermediate_size=688,
                           num_hidden_layers=args.n_layer, num_attention_heads=4, num_key_value_heads=4,
                           max_position_embeddings=args.block_size)


def gpt_batches(args: argparse.Namespace, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` global batches of random token ids (seeded by ``args.seed``)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    shape = (args.batch, args.block_size)
    return [(torch.randint(args.vocab_size, shape, generator=g),
             torch.randint(args.vocab_size, shape, generator=g)) for _ in range(count)]
