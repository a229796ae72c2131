"""A user's CI test of their model under graphpass: only graphpass.testing is used.

Run it with ``pytest examples/test_gpt_parity.py``; after an intended change to the model or an
upgrade of torch / graphpass that changes the distributed program, ``pytest
examples/test_gpt_parity.py --graphpass-update-golden`` rewrites examples/golden/ for review.
"""

from pathlib import Path

import torch

import graphpass as gp
from graphpass.testing import assert_parity
from gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
STRATEGIES = [
    gp.Strategy(),  # data parallel over every rank
    gp.Strategy(zero=3),  # fully sharded
    gp.Strategy(tp=2, sequence_parallel=True),  # Megatron tp + sp (dp fills the rest)
    gp.Strategy(pp=2, microbatches=2),  # two pipeline stages
]


def build_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (8, 32), generator=g), torch.randint(0, 256, (8, 32), generator=g))
            for _ in range(3)]


def test_gpt_trains_as_one_process(graphpass_ranks):
    assert_parity(build_model, make_batches, STRATEGIES, world_sizes=(2, 4), ranks=graphpass_ranks,
                  golden_dir=Path(__file__).parent / "golden")
