"""Golden files of each pipeline stage's program: what it receives, the collectives it runs in
order (with the pass that added each), and what it sends.

graphpass.testing.program_text runs the passes in this process on rank 0's program (tp, ZeRO and
dp collectives name their axis; shapes are rank 0's local ones) and cuts the graph as ``compile``
cuts it. A change in the passes, the cut, torch or transformers that moves, adds or drops a
collective or changes what crosses a stage boundary changes the text and fails here with a diff;
when the change is intended, rewrite the files with ``pytest --graphpass-update-golden
tests/test_pipeline_golden.py`` and review the diff of ``tests/golden/`` like code.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import graphpass as gp
import zoo
from graphpass.testing import assert_golden, program_text

GOLDEN = Path(__file__).parent / "golden"

# (file stem, model, Strategy fields, world size): tied weights with ZeRO-3 across two stages,
# Megatron tp with sequence parallelism inside stages, interleaved stages (two per rank).
CASES = [
    ("gpt_pp2_dp2_zero3", "gpt", dict(pp=2, dp=2, zero=3, microbatches=2), 4),
    ("hf_llama_pp2_tp2_sp", "hf_llama", dict(pp=2, tp=2, sequence_parallel=True, microbatches=2), 4),
    ("gpt_deep_pp2_interleaved", "gpt_deep", dict(pp=2, microbatches=2, schedule="interleaved_1f1b",
                                                  virtual_stages=2), 2),
]


@pytest.mark.parametrize("stem,name,fields,world", CASES, ids=[c[0] for c in CASES])
def test_each_stage_program_matches_its_golden_file(stem, name, fields, world):
    text = program_text(zoo.build(name), zoo.batches(name, 1, 8)[0], gp.Strategy(**fields), world)
    assert_golden(GOLDEN / f"{stem}.txt", text)
