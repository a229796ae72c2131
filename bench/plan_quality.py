"""Plan quality: the planner's automatic plan against the best uniform strategy it could have been told.

What is measured: for each scenario (an example model from ``examples/configs.py`` in bf16, a
cluster preset with nodes of 8 GPUs, a global batch and a per-device memory budget) one
:class:`graphpass.planner.Planner` is built (capture + graph measurement, once) and asked for

* **auto**: ``planner.auto()``, the searched plan (mesh, pipeline stages, per-block ZeRO stage /
  operator split / recomputation);
* **baselines**: ``planner.price(Strategy(...))`` of the uniform strategies an engineer would try
  by hand, priced by the very same cost model:

  - ``dp``: pure data parallelism, ``Strategy(dp=W)``;
  - ``zero3``: ``Strategy(dp=W, zero=3)``;
  - ``meg``: the Megatron-LM grid ``tp in {1,2,4,8} x pp in {1,2,4,8,16}``, ``dp = W/(tp*pp)``,
    ``zero=0``, with and without recomputation; for ``pp > 1`` the best of
    ``microbatches in {pp, 2pp, 4pp}`` that divide the per-replica batch (``pp = 1``: one
    microbatch). ``tp=1 pp=1`` without recomputation is ``dp`` again.

  A baseline counts only when its predicted peak fits the budget; degrees that do not divide the
  batch or the model (``Planner.price`` raises ``ValueError``) are skipped.

Nothing runs on a GPU: every number is the cost model's prediction (roofline compute, alpha-beta
collectives, analytic memory) for the preset's published figures, so this checks the *search*,
not the model's accuracy.

How to read it: one row per scenario. ``auto`` is the chosen mesh (``pp/dp/tp``, ``m``
microbatches, ``sp`` sequence parallel, ``op`` / ``op-lean`` the op-level planner's tensor-parallel
layout instead of Megatron's) and how many blocks took which choice (``z3`` ZeRO-3,
``rc`` recompute, ``s2`` operator split 2); ``auto s`` its predicted step time and ``peak/budget``
its predicted peak against the budget in GiB. ``best baseline`` is the fastest baseline that fits
and ``ratio`` is ``auto / best``: the search includes every baseline, so it must be <= 1.00 (the
planner treats candidates within 1e-6 as tied and picks the simplest, so ratios up to 1 + 1e-6
pass). ``fits`` lists which baseline families fit (``meg k/n``: k of the n Megatron points
priced). A row where no baseline fits but auto does is marked ``auto only``. ``block s`` is the
per-block plan (``planner.auto(per_operator=False)``: one ZeRO stage per block, Megatron's tp
layout) and ``op/blk`` the auto plan's time over it: per-operator choices (``z3@4/z1``: the
block's 4 largest operators at ZeRO-3, the rest at ZeRO-1; the op-level tp layouts) must never
make it slower. The last lines count the rows where
auto <= best and where per-operator choices beat the per-block plan; the script exits 1 if any
row fails.

    python bench/plan_quality.py                  # all scenarios (minutes; the offload ones plan 175B)
    python bench/plan_quality.py --only 175b      # scenarios whose label contains "175b"
    python bench/plan_quality.py --only offload   # the offload scenarios alone

**Offload** (the last two sections): the largest GPT of a ladder of GPT-3 shapes (1.3B to 175B,
2048 tokens x 8 sequences, bf16, Adam) the planner fits on one A100-80G and on one H100 with
1 TiB of host memory: with the device alone (``Planner(offload=False)``), with the host's memory
(the preset's host with no disk) and with the preset's NVMe as well, each with the predicted
step time, the plan and where its state went (ZeRO-Offload trained 13B on one 32 GB V100 with
the optimizer on the CPU). Then a scenario where offloading beats ZeRO-3 + recompute and the
search without offload: GPT-3 13B on one node of 8 A100-40G. The script fails if the host fits
no larger GPT than the device alone, or if offloading is not faster in the second.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from configs import build, example_inputs  # noqa: E402  (examples/ is not a package)

from graphpass.cluster import Cluster  # noqa: E402
from graphpass.cost.search import NoPlanError  # noqa: E402
from graphpass.plan import Plan, Strategy  # noqa: E402
from graphpass.planner import Planner  # noqa: E402

GiB = 2**30
#: The planner's own tie tolerance (graphpass.cost.search.driver._TIE_REL): among candidates this close it
#: returns the simplest mesh, which may be that much slower than the fastest.
TIE_REL = 1e-6
TPS = (1, 2, 4, 8)
PPS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Scenario:
    model: str
    preset: str
    nodes: int
    batch: int
    budget: str | None = None  # None: the planner's default, 90% of device memory

    @property
    def world(self) -> int:
        return self.nodes * 8

    @property
    def label(self) -> str:
        return (f"{self.model} {self.preset} {self.nodes}x8 b{self.batch} "
                f"{self.budget or 'default'}")


# Global batches as published for these sizes (GPT-3 paper Table 2.1: 1.3B 1M tokens = 512
# sequences, 13B 1024, 175B 1536 (3.2M tokens); Llama 4M tokens = 1024 x 4096), smaller ones on
# small clusters; every one divides by the dp degrees that matter. Budgets: default (90% of the
# card), and tighter ones that force sharding, recomputation or pipelining.
SCENARIOS = [
    Scenario("gpt3-1.3b", "a100-40g", 1, 256),
    Scenario("gpt3-1.3b", "a100-80g", 4, 512),
    Scenario("gpt3-1.3b", "a100-80g", 4, 512, "16GiB"),
    Scenario("gpt3-6.7b", "a100-40g", 4, 512),
    Scenario("gpt3-6.7b", "h100-80g", 8, 512, "40GiB"),
    Scenario("gpt3-13b", "a100-40g", 8, 512),
    Scenario("gpt3-13b", "a100-80g", 16, 1024),
    Scenario("gpt3-13b", "a100-80g", 16, 1024, "40GiB"),
    Scenario("llama-7b", "h100-80g", 8, 512),
    Scenario("llama-7b", "a100-40g", 4, 256, "30GiB"),
    Scenario("llama-70b", "a100-80g", 32, 1024, "40GiB"),
    Scenario("llama-70b", "h100-80g", 64, 1024),
    Scenario("gpt3-175b", "a100-40g", 64, 1536),
    Scenario("gpt3-175b", "a100-80g", 128, 1536),
    Scenario("gpt3-175b", "h100-80g", 128, 1536, "40GiB"),
    # A model Megatron's pattern cannot shard (linears in a list, not in repeated layers): the
    # op-level planner's tp layouts (`op`, `op-lean` in the plan column) against the per-block
    # plan's data parallelism, ZeRO and pipelines; unsharded it needs 14 GB per device.
    Scenario("mlp-0.9b", "a100-80g", 1, 1024),
    Scenario("mlp-0.9b", "a100-40g", 1, 1024, "8GiB"),
    Scenario("mlp-0.9b", "a100-80g", 4, 4096, "6GiB"),
]


# Offload: the GPT-3 family's shapes (paper Table 2.1; 2.7B with d_head 128) and the widths
# between, to find the largest GPT the planner fits on one device with and without its host.
GPT_LADDER = {
    "1.3b": (24, 2048, 16), "2.7b": (32, 2560, 20), "6.7b": (32, 4096, 32), "13b": (40, 5120, 40),
    "20b": (44, 6144, 48), "30b": (48, 7168, 56), "40b": (52, 8192, 64), "66b": (64, 9216, 72),
    "175b": (96, 12288, 96),
}
OFFLOAD_BATCH = 8  # sequences of 2048 tokens on one device (ZeRO-Offload trained 13B at 8 and up)
HOST_BYTES = 2**40  # 1 TiB of host memory per device


def baselines(world: int, batch: int) -> list[tuple[str, str, list[Strategy]]]:
    """(family, name, strategies to try: the best that fits stands for the name)."""
    out = [("dp", "dp", [Strategy(dp=world)]), ("zero3", "zero3", [Strategy(dp=world, zero=3)])]
    for tp in TPS:
        for pp in PPS:
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            per_replica = batch // dp if batch % dp == 0 else 0
            counts = [m for m in (pp, 2 * pp, 4 * pp) if per_replica and per_replica % m == 0] if pp > 1 else [1]
            for recompute in (False, True):
                if tp == pp == 1 and not recompute:
                    continue  # that is "dp"
                name = f"tp{tp} pp{pp}" + (" rc" if recompute else "")
                out.append(("meg", name, [Strategy(dp=dp, tp=tp, pp=pp, microbatches=m, recompute=recompute)
                                          for m in counts]))
    return out


def price_baselines(planner: Planner, world: int, batch: int) -> tuple[dict[str, list[int]], tuple[str, Plan] | None]:
    """Per family [fitting, priced]; the fastest fitting baseline as (name, plan)."""
    fits: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    best: tuple[str, Plan] | None = None
    for family, name, strategies in baselines(world, batch):
        fitting = []
        priced = False
        for strategy in strategies:
            try:
                plan = planner.price(strategy)
            except ValueError:  # degrees that divide neither the batch nor the model
                continue
            priced = True
            if plan.report.predicted_peak_memory_bytes <= planner.budget:
                fitting.append((plan.report.predicted_step_time_s, strategy.microbatches, plan))
        if not priced:
            continue
        fits[family][1] += 1
        if fitting:
            fits[family][0] += 1
            _, m, plan = min(fitting, key=lambda f: f[0])
            label = name + (f" m{m}" if m > 1 else "")
            if best is None or plan.report.predicted_step_time_s < best[1].report.predicted_step_time_s:
                best = (label, plan)
    return fits, best


def describe(plan: Plan) -> str:
    """``pp4 dp32 tp8 m16 sp | 40 z1+rc, 2 z1``."""
    mesh = plan.mesh
    text = " ".join(f"{axis}{mesh.get(axis, 1)}" for axis in ("pp", "dp", "tp"))
    if plan.microbatches > 1:
        text += f" m{plan.microbatches}"
    if plan.sequence_parallel:
        text += " sp"
    layout = next((r.split(": ", 1)[1].split(" (")[0] for r in plan.report.reasons if r.startswith("tensor-parallel layout: ")), None)
    if layout is not None:  # the op-level planner's tp layout, not Megatron's
        text += " " + layout.replace("op-level lean", "op-lean").replace("op-level", "op")
    counts = collections.Counter(_short(row["choice"]) for row in plan.report.breakdown)
    return text + " | " + ", ".join(f"{n} {c}" for c, n in counts.most_common())


def _short(choice: str) -> str:
    """``zero-3 on 4 largest ops, zero-1 + recompute`` -> ``z3@4/z1+rc``."""
    choice = re.sub(r" on (\d+) largest ops, ", r"@\1/", choice)
    return (choice.replace("zero-", "z").replace(" + recompute", "+rc").replace(" + split ", "+s")
            .replace("dp+", "").replace("dp", "z0"))


def _fits_text(fits: dict[str, list[int]]) -> str:
    parts = [f for f in ("dp", "zero3") if fits.get(f, [0, 0])[0]]
    if "meg" in fits:
        parts.append(f"meg {fits['meg'][0]}/{fits['meg'][1]}")
    return ",".join(parts) or "-"


def _ladder_model(name: str) -> torch.nn.Module:
    from gpt import GPTConfig

    layers, width, heads = GPT_LADDER[name]
    return _meta(GPTConfig(vocab_size=50304, block_size=2048, n_layer=layers, n_head=heads, n_embd=width,
                           dropout=0.0, bias=True))


def _offload_summary(plan: Plan) -> str:
    """``zero-1 | 32 opt+grad host, 9 act host, 152 GiB host, 0 GiB disk``."""
    why = next((r for r in plan.report.reasons if r.startswith("offload, chosen")), None)
    if why is None:
        return "no offload"
    where = why.split(": ", 1)[1]
    gib = re.findall(r"([\d.]+) GiB (in host memory|on disk)", where)
    return ", ".join(f"{float(n):.0f} GiB {'host' if 'host' in what else 'disk'}" for n, what in gib)


def offload_scenarios(time_limit: float | None) -> list[str]:
    """The largest GPT of the ladder each column fits on one device, the predicted step time of
    each fit; and 13B on one node of A100-40G, where offloading beats ZeRO-3 + recompute. Returns
    the failures."""
    failures = []
    print("\nOffload: the largest GPT (2048 tokens x 8 sequences, bf16, Adam) the planner fits on one device; "
          "host 1 TiB per device")
    columns = (("device only", False, None), ("host", True, 0), ("host + NVMe", True, None))
    print(f"{'device':10s} " + " ".join(f"{c[0]:>14s}" for c in columns))
    for preset in ("a100-80g", "h100-80g"):
        one = Cluster.preset(preset, nodes=1, gpus_per_node=1)
        largest: dict[str, tuple[str, Plan]] = {}
        for label, offload, disk in columns:
            cluster = one.with_host(memory_bytes=HOST_BYTES, **({} if disk is None else {"disk_bytes": 0}))
            for name in GPT_LADDER:
                inputs = example_inputs("gpt3-1.3b", batch=OFFLOAD_BATCH, device="meta")
                try:
                    plan = Planner(_ladder_model(name), cluster, inputs, offload=offload).auto(time_limit_s=time_limit)
                except NoPlanError:
                    break
                largest[label] = (name, plan)
        print(f"{preset:10s} " + " ".join(f"{largest[c[0]][0] if c[0] in largest else '-':>14s}" for c in columns))
        for label, (name, plan) in largest.items():
            print(f"  {label:12s} {name:5s} step {plan.report.predicted_step_time_s:7.2f} s, peak "
                  f"{plan.report.predicted_peak_memory_bytes / GiB:.1f} GiB: {describe(plan)}; {_offload_summary(plan)}")
        order = list(GPT_LADDER)
        if "host" not in largest or order.index(largest["host"][0]) <= order.index(largest.get("device only", ("1.3b",))[0]):
            failures.append(f"offload {preset}: the host fits no larger GPT than the device alone")
    return failures + offload_beats_zero3(time_limit)


def offload_beats_zero3(time_limit: float | None) -> list[str]:
    """GPT-3 13B on one node of 8 A100-40G at a global batch of 64: ZeRO-3 + recompute fits, and
    the search without offload finds faster meshes still; with the host it trades recomputation
    and pipeline bubbles for copies it hides behind compute."""
    model = _meta("gpt3-13b")
    inputs = example_inputs("gpt3-13b", batch=64, device="meta")
    plans = {}
    for offload in (False, True):
        planner = Planner(model, "a100-40g:1x8", inputs, offload=offload)
        plans[offload] = planner.auto(time_limit_s=time_limit)
    zero3 = planner.price(Strategy(dp=8, zero=3, recompute=True))
    print("\nOffload against ZeRO-3 + recompute: gpt3-13b a100-40g 1x8 b64 (host per device: 1/8 of the DGX's)")
    rows = (("zero-3 + recompute", zero3), ("auto, no offload", plans[False]), ("auto, offload", plans[True]))
    for label, plan in rows:
        over = " (over the budget)" if plan.report.predicted_peak_memory_bytes > planner.budget else ""
        print(f"  {label:20s} step {plan.report.predicted_step_time_s:7.3f} s, peak "
              f"{plan.report.predicted_peak_memory_bytes / GiB:5.1f} GiB{over}: {describe(plan)}; {_offload_summary(plan)}")
    off, base = plans[True].report.predicted_step_time_s, zero3.report.predicted_step_time_s
    print(f"auto with offload / zero-3 + recompute: {off / base:.3f}; / auto without offload: "
          f"{off / plans[False].report.predicted_step_time_s:.3f} (target: below 1)")
    return [] if off < min(base, plans[False].report.predicted_step_time_s) else [
        f"offload: auto with offload {off:.3f} s is not faster than without it"]


def _meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return build(name).to(torch.bfloat16)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="run only scenarios whose label contains this text")
    p.add_argument("--time-limit", type=float, default=None, help="planner.auto(time_limit_s=...)")
    args = p.parse_args(argv)
    scenarios = [s for s in SCENARIOS if args.only is None or args.only in s.label]
    run_offload = args.only is None or args.only == "offload"
    if not scenarios and not run_offload:
        p.error(f"no scenario label contains {args.only!r} (or --only offload)")

    start = time.perf_counter()
    models: dict[str, torch.nn.Module] = {}
    header = (f"{'scenario':42s} {'auto plan':44s} {'auto s':>8s} {'peak/budget GiB':>15s} "
              f"{'best baseline':20s} {'base s':>8s} {'ratio':>6s}  {'block s':>9s} {'op/blk':>7s}  fits")
    print(header)
    print("-" * len(header))
    passed, failures, auto_only, faster = 0, [], [], []
    for sc in scenarios:
        if sc.model not in models:
            models[sc.model] = _meta(sc.model)
        inputs = example_inputs(sc.model, batch=sc.batch, device="meta")
        planner = Planner(models[sc.model], f"{sc.preset}:{sc.nodes}x8", inputs, memory_budget=sc.budget)
        try:
            auto = planner.auto(time_limit_s=args.time_limit)
            per_block = planner.auto(time_limit_s=args.time_limit, per_operator=False)
        except NoPlanError as exc:
            auto = per_block = None
            why = str(exc)
        fits, best = price_baselines(planner, sc.world, sc.batch)
        budget = planner.budget / GiB
        if auto is None:
            auto_text, auto_s, peak = "no plan fits", "-", f"- /{budget:.1f}"
        else:
            auto_text, auto_s = describe(auto), f"{auto.report.predicted_step_time_s:8.3f}"
            peak = f"{auto.report.predicted_peak_memory_bytes / GiB:.1f}/{budget:.1f}"
        if best is None:
            base_name, base_s, ratio_text = "none fits", "-", "-"
        else:
            base_name, base_s = best[0], f"{best[1].report.predicted_step_time_s:8.3f}"
            ratio_text = "-" if auto is None else f"{auto.report.predicted_step_time_s / best[1].report.predicted_step_time_s:6.3f}"
        block_text = "-" if per_block is None else f"{per_block.report.predicted_step_time_s:9.4f}"
        op_ratio = "-" if per_block is None else f"{auto.report.predicted_step_time_s / per_block.report.predicted_step_time_s:.5f}"
        print(f"{sc.label:42s} {auto_text:44s} {auto_s:>8s} {peak:>15s} {base_name:20s} {base_s:>8s} "
              f"{ratio_text:>6s}  {block_text:>9s} {op_ratio:>7s}  {_fits_text(fits)}", flush=True)
        if per_block is not None:
            if auto.report.predicted_step_time_s > per_block.report.predicted_step_time_s * (1 + TIE_REL):
                failures.append(f"{sc.label}: per-operator {auto.report.predicted_step_time_s:.6f} s > per-block "
                                f"{per_block.report.predicted_step_time_s:.6f} s")
            elif auto.report.predicted_step_time_s < per_block.report.predicted_step_time_s * (1 - TIE_REL):
                faster.append(f"{sc.label}: {per_block.report.predicted_step_time_s:.6f} s -> {auto.report.predicted_step_time_s:.6f} s "
                              f"({describe(per_block)} -> {describe(auto)})")
        if best is None:
            if auto is not None:
                auto_only.append(sc.label)
                passed += 1
            else:
                print(f"  (no plan and no baseline fits: {why})")
                passed += 1
        elif auto is None:
            failures.append(f"{sc.label}: auto found no plan ({why}) but baseline {best[0]} fits")
        elif auto.report.predicted_step_time_s <= best[1].report.predicted_step_time_s * (1 + TIE_REL):
            passed += 1
        else:
            failures.append(
                f"{sc.label}: auto {auto.report.predicted_step_time_s:.4f} s ({describe(auto)}, peak "
                f"{auto.report.predicted_peak_memory_bytes / GiB:.2f} GiB) > {best[0]} "
                f"{best[1].report.predicted_step_time_s:.4f} s (peak {best[1].report.predicted_peak_memory_bytes / GiB:.2f} GiB)"
            )
    if run_offload:
        failures += offload_scenarios(args.time_limit)
    print()
    for label in auto_only:
        print(f"auto only (no uniform baseline fits, auto does): {label}")
    for line in faster:
        print(f"per-operator faster than per-block: {line}")
    print(f"per-operator choices faster than the per-block plan in {len(faster)}/{len(scenarios)} scenarios, "
          "never slower (target)")
    for line in failures:
        print(f"FAIL {line}")
    print(f"auto <= best fitting baseline in {passed}/{len(scenarios)} scenarios (target: all)")
    print(f"(wall time {time.perf_counter() - start:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
