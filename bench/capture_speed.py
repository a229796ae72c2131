"""Capture speed: wall time to capture GPT models built on the meta device (no allocation).

    python bench/capture_speed.py

Prints, per model size, the parameter count and the seconds each capture route takes (median of
3). The issue's target: a 1.5B-parameter model captures in under 5 s on this 2-core machine.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from gpt import GPT, GPTConfig  # noqa: E402

from graphpass.capture import capture  # noqa: E402

SIZES = {
    "gpt2-124M": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-1.5B": GPTConfig(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
}


def main() -> None:
    print(f"{'model':12s} {'params':>8s} {'route':>15s} {'seconds':>8s} {'nodes':>6s}")
    for name, config in SIZES.items():
        with torch.device("meta"):
            model = GPT(config)
        params = sum(p.numel() for p in model.parameters())
        idx = torch.zeros(2, config.block_size, dtype=torch.long, device="meta")
        for route in ("export", "symbolic_trace"):
            times = []
            for _ in range(3):
                start = time.perf_counter()
                result = capture(model, (idx, idx), route=route)
                times.append(time.perf_counter() - start)
            print(f"{name:12s} {params / 1e9:7.2f}B {route:>15s} {statistics.median(times):8.2f} {len(result.gm.graph.nodes):6d}")


if __name__ == "__main__":
    main()
