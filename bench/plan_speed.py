"""Planning speed: wall time from a meta-device model to a searched Plan, on a 1024-GPU cluster.

What is measured: for GPT-3 1.3B, 13B and 175B (``examples/configs.py``, bf16) planned for
``--preset`` ``--nodes`` x 8 GPUs (default ``h100-80g`` 128 x 8 = 1024) at global batch
``--batch`` (default 1536, GPT-3 175B's; it divides by every dp degree up to 512), three phases,
each timed with ``time.perf_counter``:

* **build**: ``build(name).to(torch.bfloat16)`` under ``torch.device("meta")`` (no allocation);
* **measure**: the :class:`graphpass.planner.Planner` constructor: capture to the FX IR, split
  into blocks, per-node FLOPs/bytes, and a fake-tensor run counting the activations autograd saves;
* **search**: ``planner.auto()``: tensor-parallel layouts (a dry run of the pass per tp), then
  every mesh, its pipeline stages and the per-block ILP.

``meshes`` is the number of meshes searched (from the plan's reasons, ``searched N meshes``) and
``solved`` how many of them got their ILP: the others' step floor (every block at its fastest
choice, no bubble beyond the schedule's) was already slower than a plan found.
Nothing is cached between runs of one model except Python's imports, so ``--repeat`` (default 2
for the models under 100B parameters, 1 for 175B) reports the fastest run, which leaves out
one-time import and first-call costs.

How to read it: ``total`` is what a user waits for; the target is the last line, 175B planned in
<= 10 s on this 2-core machine (issue 13; it was 60 s before).

    python bench/plan_speed.py
    python bench/plan_speed.py --preset a100-80g --nodes 16 --batch 512
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from configs import build, example_inputs, param_count  # noqa: E402  (examples/ is not a package)

from graphpass.planner import Planner  # noqa: E402

MODELS = ("gpt3-1.3b", "gpt3-13b", "gpt3-175b")
TARGET_S = 10.0  # issue 13: GPT-3 175B on 1024 H100s planned in <= 10 s


def plan_once(name: str, cluster: str, batch: int) -> dict:
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = build(name).to(torch.bfloat16)
    inputs = example_inputs(name, batch=batch, device="meta")
    t1 = time.perf_counter()
    planner = Planner(model, cluster, inputs)
    t2 = time.perf_counter()
    plan = planner.auto()
    t3 = time.perf_counter()
    searched = next((int(m.group(1)) for r in plan.report.reasons if (m := re.match(r"searched (\d+) meshes", r))), -1)
    skipped = next((int(m.group(1)) for r in plan.report.reasons if (m := re.search(r"; (\d+) not solved", r))), 0)
    return {"build": t1 - t0, "measure": t2 - t1, "search": t3 - t2, "total": t3 - t0, "meshes": searched,
            "solved": searched - skipped,
            "nodes": len(planner.profile.gm.graph.nodes), "plan": plan}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="h100-80g")
    p.add_argument("--nodes", type=int, default=128, help="nodes of 8 GPUs (default 128: 1024 GPUs)")
    p.add_argument("--batch", type=int, default=1536, help="global batch (sequences)")
    p.add_argument("--repeat", type=int, default=2, help="runs per model under 100B params (fastest kept)")
    p.add_argument("--models", nargs="+", default=list(MODELS), help=f"default: {' '.join(MODELS)}")
    args = p.parse_args(argv)
    cluster = f"{args.preset}:{args.nodes}x8"

    start = time.perf_counter()
    print(f"cluster {cluster} ({args.nodes * 8} GPUs), global batch {args.batch}, default budget "
          "(90% of device memory); seconds, fastest of the runs")
    print(f"{'model':10s} {'params':>8s} {'nodes':>6s} {'runs':>4s} {'build':>6s} {'measure':>8s} "
          f"{'search':>7s} {'total':>7s} {'meshes':>7s} {'solved':>6s}  plan")
    totals = {}
    for name in args.models:
        repeat = args.repeat if param_count(name) < 100e9 else 1
        runs = [plan_once(name, cluster, args.batch) for _ in range(repeat)]
        r = min(runs, key=lambda run: run["total"])
        totals[name] = r["total"]
        plan = r["plan"]
        mesh = " ".join(f"{axis}={plan.mesh.get(axis, 1)}" for axis in ("pp", "dp", "tp"))
        mesh += "".join(f" {axis}={plan.mesh[axis]}" for axis in ("dp_shard", "ep") if axis in plan.mesh)
        mesh += f" m={plan.microbatches}" + (" sp" if plan.sequence_parallel else "")
        print(f"{name:10s} {param_count(name) / 1e9:7.1f}B {r['nodes']:6d} {repeat:4d} {r['build']:6.1f} "
              f"{r['measure']:8.1f} {r['search']:7.1f} {r['total']:7.1f} {r['meshes']:7d} {r['solved']:6d}  {mesh}, "
              f"{plan.report.predicted_step_time_s:.2f} s/step, {plan.report.predicted_peak_memory_bytes / 2**30:.1f} GiB",
              flush=True)
    status = 0
    if "gpt3-175b" in totals:
        ok = totals["gpt3-175b"] <= TARGET_S
        status = 0 if ok else 1
        print(f"175B planned in {totals['gpt3-175b']:.1f} s (target: 175B <= {TARGET_S:.0f} s): "
              + ("yes" if ok else "NO"))
    print(f"(wall time {time.perf_counter() - start:.0f} s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
