"""What the static verifier costs (graphpass.runtime.verifier).

    python bench/verify.py [--ranks 8] [--repeats 3]

Two figures:

1. ``compile`` on 2 gloo ranks of the largest test model (by captured nodes, from tests/zoo.py):
   the seconds spent in the verifier's functions on rank 0 (recording the program after every
   pass, checking the shards and memory, one ``all_gather_object`` of the digests and the
   comparison) and their share of the compile, median of ``--repeats``. (Timing whole compiles
   with and without it measures capture noise, which is larger than the verifier.)
2. ``gp.verify`` of a 1.5B GPT built on the meta device at ``--ranks`` simulated ranks, in this
   one process: the whole call (capture, plan, every rank's passes on meta copies, the checks)
   and the verifier's own share of it (reading the programs, tiling the shards, comparing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", d) for d in ("tests", "examples")]

import graphpass as gp  # noqa: E402
import zoo  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from graphpass.runtime import verifier  # noqa: E402
from graphpass.capture import capture  # noqa: E402

CANDIDATES = ("gpt_deep", "hf_llama_deep", "hf_t5", "hf_mixtral", "hf_phi3", "hf_gpt2")
# GPT-2 XL's size (48 layers, width 1600) with 16 heads, so tensor parallelism divides them.
GPT_1_5B = GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=16, n_embd=1600, dropout=0.0)


def _largest_test_model() -> tuple[str, int]:
    sizes = {}
    for name in CANDIDATES:
        sizes[name] = len(capture(zoo.build(name), zoo.batches(name, 1, 8)[0]).gm.graph.nodes)
    name = max(sizes, key=sizes.get)
    return name, sizes[name]


def _compile_times(name: str, strategy: dict, repeats: int) -> list[tuple[float, float]]:
    """On each rank: (seconds per compile, seconds of it in the verifier) per repeat."""
    data = zoo.batches(name, 1, 8)
    out = []
    for _ in range(repeats):
        model = zoo.build(name)
        with _Timer() as timer:
            start = time.perf_counter()
            gp.compile(model, gp.Cluster.local(), example_inputs=data[0], strategy=gp.Strategy(**strategy))
            out.append((time.perf_counter() - start, timer.seconds))
    return out


class _Timer:
    """Seconds spent in the verifier's own functions during a ``gp.verify`` call."""

    NAMES = ("program", "local_problems", "check_programs", "check_across_ranks")

    def __init__(self):
        self.seconds = 0.0
        self.real = {n: getattr(verifier, n) for n in self.NAMES}

    def __enter__(self):
        for name, fn in self.real.items():
            setattr(verifier, name, self._timed(fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(verifier, name, fn)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-compile", action="store_true", help="only the simulated 1.5B GPT")
    args = parser.parse_args()

    if not args.skip_compile:
        name, nodes = _largest_test_model()
        print(f"compile on 2 gloo ranks, {name} ({nodes} captured nodes), median of {args.repeats}:")
        print(f"{'strategy':24s} {'compile s':>10s} {'verifier ms':>12s} {'share':>7s}")
        for strategy in (dict(dp=2, zero=3), dict(tp=2), dict(pp=2, microbatches=2)):
            times = gp.launch(_compile_times, 2, (name, strategy, args.repeats), timeout_s=1200)[0]
            total = statistics.median(t for t, _ in times)
            checked = statistics.median(v for _, v in times)
            label = " ".join(f"{k}={v}" for k, v in strategy.items())
            print(f"{label:24s} {total:10.2f} {checked * 1e3:12.0f} {checked / total:7.1%}")

    with torch.device("meta"):
        model = GPT(GPT_1_5B)
    params = sum(p.numel() for p in model.parameters())
    batch = 2 * args.ranks
    idx = torch.zeros(batch, GPT_1_5B.block_size, dtype=torch.long, device="meta")
    cluster = gp.Cluster.preset("h100-80g", nodes=1, gpus_per_node=args.ranks)
    print(f"\ngp.verify of a {params / 1e9:.2f}B GPT on the meta device, {args.ranks} simulated ranks "
          f"(h100-80g), batch {batch} x {GPT_1_5B.block_size}:")
    print(f"{'strategy':32s} {'total s':>8s} {'verifier s':>11s} {'share':>7s} {'collectives/rank':>17s}")
    strategies = [dict(dp=args.ranks, zero=3), dict(dp=args.ranks // 2, tp=2, zero=3),
                  dict(pp=2, dp=args.ranks // 2, zero=1, microbatches=2)]
    for strategy in strategies:
        with _Timer() as timer:
            start = time.perf_counter()
            programs = gp.verify(model, cluster, example_inputs=(idx, idx), strategy=gp.Strategy(**strategy))
            total = time.perf_counter() - start
        count = sum(len(v) for g, v in programs[0].items() if g[0] != verifier.SHARDS)
        label = " ".join(f"{k}={v}" for k, v in strategy.items())
        print(f"{label:32s} {total:8.1f} {timer.seconds:11.2f} {timer.seconds / total:7.1%} {count:17d}")


if __name__ == "__main__":
    main()
