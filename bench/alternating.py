"""Two training loops timed side by side: a warm-up of each, then alternating rounds.

Imported by the bench scripts that compare graphpass with the reference a user would pick
(``overhead.py``, ``sharding_speed.py``, ``pipeline.py``). Each round runs ``steps_per_round``
steps of one side, started by a barrier so every rank starts it together; the sides take turns,
and who goes first alternates too, so machine noise (other processes, frequency changes) hits
both alike. Every step runs the next global batch: both sides see the same sequence.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist


def alternate(sides: Mapping[str, Callable[..., torch.Tensor]], data: Sequence[tuple], warmup: int, rounds: int,
              steps_per_round: int) -> tuple[dict[str, list[float]], dict[str, list[torch.Tensor]]]:
    """Run every side ``warmup`` steps untimed, then ``rounds`` timed rounds each; ``data`` needs
    ``warmup + rounds * steps_per_round`` batches. Returns per side the timed step times (s) and
    the loss of every step (warm-up included), in step order."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[torch.Tensor]] = {name: [] for name in names}

    def run(name: str, start: int, count: int, timed: bool) -> None:
        dist.barrier()
        for i in range(start, start + count):
            t0 = time.perf_counter()
            loss = sides[name](*data[i])
            t1 = time.perf_counter()
            losses[name].append(loss)
            if timed:
                times[name].append(t1 - t0)

    for name in names:
        run(name, 0, warmup, timed=False)
    step = warmup
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            run(name, step, steps_per_round, timed=True)
        step += steps_per_round
    return times, losses
