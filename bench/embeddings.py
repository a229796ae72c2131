"""Embedding tables: a DLRM on gloo ranks with its tables replicated (torch DDP, graphpass dp) or
sharded by graphpass (data-parallel with sparse gradients, table-, row-, column-wise), in one run.

What is measured, on 2 and 4 gloo ranks (``--world-sizes``): ``examples/dlrm.py``'s DLRM with
Criteo-like tables (26 features, ``criteo_like(scale=--scale)``: rows from 10^3 x scale to 10^7 x
scale, multi-hot bags of 1-8 Zipf ids) and a global batch of ``--batch`` samples. Each row trains
with SGD (dense parameters: the user's ``torch.optim.SGD``; graphpass's sharded tables: its sparse
SGD, the same update on the rows a step touches) for ``--rounds`` steps after a warm-up:

* ``torch DDP``: the model eagerly under ``DistributedDataParallel``, each rank cutting its share
  of the jagged batch with :func:`graphpass.batching.cut` (a user would write that cut by hand):
  dense table gradients all-reduced in buckets; the reference of the ratio column;
* ``gp dp``: ``Strategy(dp=n)``: the tables are ordinary weights (dense gradients in the buckets);
* ``gp <kind>``: ``Strategy(dp=n, embeddings=kind, embedding_optimizer=SparseOptimizer('sgd'))``;
* ``gp row_wise cache s=k``: the same row-wise tables with HET's cache (``embedding_cache=--cache``
  of each table's rows, ``staleness=k``; :mod:`graphpass.runtime.row_cache`), k = 0, 1, 2, 5:
  the ``/ no cache`` column is its table bytes against uncached row-wise's (HET: up to 88% less),
  ``hits`` the share of other ranks' rows read from the cache;
* ``gp planned s=k``: graphpass's planner's own choice per table (``gp.plan(...,
  embedding_optimizer=, staleness=k)`` on ``Cluster.local(n)``, planned once from the example
  batch's ids, the dense part beside it, in one solve), compiled from that plan on every rank; a
  line under the table gives its kinds, caches and the step time it predicted. Profile the
  machine first (``graphpass profile --world-size n``) or the planner prices default figures.

Columns: median step time (a step's time is its slowest rank's; each step starts at a barrier)
and its ratio to DDP's; the bytes each rank hands to collectives in a step (the tensors given to
all-reduce, all-to-all and all-gather calls, counted by wrapping ``torch.distributed``; for DDP,
whose buckets are reduced in C++, the bytes of its gradients, which its buckets all-reduce once a
step), split into table and dense traffic; and the peak of live tensor memory on rank 0 during a
step (:class:`graphpass.runtime.memory.MemoryProbe`: parameters, gradients, optimizer state, the
step's activations and buffers; DDP's bucket copies are not seen by the probe, nor counted).

TorchRec (``DistributedModelParallel`` with its planner) is the reference a user would pick for
sharded tables; see the printed note for whether it loads against this torch.

    python bench/embeddings.py                  # a few minutes on 2 cores
    python bench/embeddings.py --scale 0.01 --batch 2048
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import graphpass as gp  # noqa: E402
from graphpass import batching  # noqa: E402
from graphpass.runtime.memory import MemoryProbe, optimizer_state_tensors  # noqa: E402
from dlrm import DLRM, CriteoLike, criteo_like  # noqa: E402

KINDS = ("data_parallel", "table_wise", "row_wise", "column_wise")


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--scale", type=float, default=0.002, help="table rows times this (1: Criteo's 10^3..10^7)")
    p.add_argument("--dim", type=int, default=32, help="embedding dim")
    p.add_argument("--batch", type=int, default=512, help="global batch (samples)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", type=float, default=0.05, help="the cached rows' share of each table")
    p.add_argument("--stalenesses", type=int, nargs="+", default=[0, 1, 2, 5])
    p.add_argument("--planned-stalenesses", type=int, nargs="*", default=[0, 2],
                   help="the staleness each planner's row allows (0: exact)")
    return p.parse_args(argv)


def _config(args):
    config = criteo_like(embedding_dim=args.dim, scale=args.scale)
    # a bench-sized MLP (criteo_like's is MLPerf's 512-256 / 1024-1024-512-256)
    from dataclasses import replace
    return replace(config, bottom=(128, args.dim), top=(256, 128))


class _Bytes:
    """Bytes handed to collectives while active, split by whether the caller is the tables' runtime."""

    NAMES = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "all_gather_single",
             "reduce_scatter_tensor", "broadcast")

    def __init__(self):
        self.table = self.dense = 0
        self._saved = {}

    def __enter__(self):
        for name in self.NAMES:
            real = getattr(dist, name, None)
            if real is None:
                continue
            self._saved[name] = real

            def counted(*args, _real=real, _name=name, **kwargs):
                tensor = args[1] if _name in ("all_to_all_single", "all_gather_into_tensor", "all_gather_single",
                                              "reduce_scatter_tensor") else args[0]
                nbytes = tensor.numel() * tensor.element_size()
                caller = sys._getframe(1).f_code.co_filename
                if caller.endswith(os.path.join("runtime", "embeddings.py")) or caller.endswith("sparse_optim.py"):
                    self.table += nbytes
                else:
                    self.dense += nbytes
                return _real(*args, **kwargs)
            setattr(dist, name, counted)
        from graphpass.runtime import embeddings  # its gather was bound at import: rebind it to the counted one
        self._flat = embeddings._all_gather_flat
        embeddings._all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(dist, name, real)
        from graphpass.runtime import embeddings
        embeddings._all_gather_flat = self._flat


def _run_rank(args, kind: str, plan_json: str | None = None) -> dict:
    torch.set_num_threads(args.threads)
    world, rank = dist.get_world_size(), dist.get_rank()
    config = _config(args)
    torch.manual_seed(0)
    model = DLRM(config)
    data = CriteoLike(config, seed=1)
    batches = [data.batch(args.batch) for _ in range(args.warmup + args.rounds + 1)]
    if kind == "ddp":
        shares = batching.infer(model, batches[0])
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        state = list(model.parameters())

        def step(batch):
            loss = ddp(*batching.cut(batch, shares, world, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
    else:
        sharding, staleness = (kind.split(":")[0], int(kind.split(":")[1])) if ":" in kind else (kind, None)
        cache = {} if staleness is None else {"embedding_cache": args.cache, "staleness": staleness}
        if plan_json is not None:
            strategy = gp.Plan.from_json(plan_json)
        else:
            strategy = gp.Strategy(dp=world) if kind == "gp" else gp.Strategy(
                dp=world, embeddings=sharding, embedding_optimizer=gp.SparseOptimizer("sgd", lr=0.01), **cache)
        dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=batches[0], strategy=strategy)
        opt = torch.optim.SGD(dmodel.parameters(), lr=0.01)
        state = list(dmodel.graph_module.parameters())
        if dmodel.sparse_optimizer is not None:
            state += [t for s in dmodel.sparse_optimizer.state.values() for t in s.values()]

        def step(batch):
            dmodel.train_step(*batch)
            opt.step()
            opt.zero_grad()
    for batch in batches[:args.warmup]:
        step(batch)
    times = []
    with _Bytes() as counted:
        for batch in batches[args.warmup:args.warmup + args.rounds]:
            dist.barrier()
            t0 = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - t0)
    table, dense = counted.table / args.rounds, counted.dense / args.rounds
    hits = None
    if kind != "ddp" and dmodel._cached:
        from graphpass.runtime.row_cache import cache_of
        counts = [cache_of(shard).counters for shard in dmodel._cached]
        read = sum(c["hits"] + c["pulled"] for c in counts)
        hits = sum(c["hits"] for c in counts) / read if read else 0.0
    if kind == "ddp":  # its reducer all-reduces every gradient once a step, in C++
        table = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("tables."))
        dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("tables."))
    with MemoryProbe(baseline=state + optimizer_state_tensors(opt) + list(batches[-1])) as probe:
        step(batches[-1])
    return {"times": times, "table": table, "dense": dense, "peak": probe.peak_bytes, "hits": hits}


def _planned(args, world: int, staleness: int) -> tuple[gp.Plan, str]:
    """The planner's plan for the DLRM on ``world`` local ranks, and a line saying what it chose."""
    config = _config(args)
    torch.manual_seed(0)
    batch = CriteoLike(config, seed=1).batch(args.batch)
    t0 = time.perf_counter()
    cluster = gp.Cluster.local(world)
    plan = gp.plan(DLRM(config), cluster, batch, staleness=staleness,
                   embedding_optimizer=gp.SparseOptimizer("sgd", lr=0.01))
    planned_s = time.perf_counter() - t0
    kinds: dict[str, int] = {}
    cached = 0
    for tensor in plan.tensors.values():
        if tensor.table is not None:
            kinds[tensor.table.kind] = kinds.get(tensor.table.kind, 0) + 1
            cached += tensor.table.cache > 0
    chose = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items(), key=lambda kv: -kv[1]))
    return plan, (f"planned s={staleness} on {cluster.name} (in {planned_s:.1f} s): {chose}; {cached} with a cache; zero "
                  f"{sorted({t.zero for t in plan.tensors.values() if t.table is None})}; predicted step "
                  f"{plan.report.predicted_step_time_s * 1e3:.1f} ms")


def _row(args, world: int, kind: str, plan: gp.Plan | None = None) -> dict:
    results = gp.launch(_run_rank, world, args=(args, kind, None if plan is None else plan.to_json()),
                        timeout_s=1200)
    steps = [max(r["times"][i] for r in results) for i in range(args.rounds)]
    return {"step": statistics.median(steps), "table": statistics.mean(r["table"] for r in results),
            "dense": statistics.mean(r["dense"] for r in results), "peak": results[0]["peak"],
            "hits": None if results[0]["hits"] is None else statistics.mean(r["hits"] for r in results)}


def _torchrec_note() -> str:
    try:
        __import__("torchrec")  # loading it (and fbgemm_gpu's libraries) is the question
    except Exception as exc:  # noqa: BLE001 - any failure to load is the answer
        return (f"TorchRec: not run ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); graphpass's own "
                "sharding kinds stand in for its planner's here")
    return "TorchRec: importable (a DistributedModelParallel row is not written yet)"


def main(argv=None) -> None:
    args = _parse_args(argv)
    t0 = time.perf_counter()
    config = _config(args)
    rows = sum(config.table_rows)
    print(f"DLRM: {len(config.table_rows)} tables, {rows:,} rows x {args.dim} ({rows * args.dim * 4 / 2**20:.1f} MiB), "
          f"rows {min(config.table_rows):,}..{max(config.table_rows):,}, bags of 1..8 Zipf ids; global batch "
          f"{args.batch}; SGD; median of {args.rounds} steps after {args.warmup}; {args.threads} thread(s) a rank")
    print(_torchrec_note())
    labels = [("torch DDP", "ddp"), ("gp dp", "gp")] + [(f"gp {k}", k) for k in KINDS] + [
        (f"gp row_wise cache s={s}", f"row_wise:{s}") for s in args.stalenesses] + [
        (f"gp planned s={s}", f"planned:{s}") for s in args.planned_stalenesses]
    print(f"cache: {args.cache:.0%} of each table's rows on every rank")
    for world in args.world_sizes:
        print(f"\n{world} ranks")
        print(f"  {'strategy':<24} {'step ms':>9} {'/ DDP':>7} {'table MiB/step':>15} {'/ no cache':>11} {'hits':>6} "
              f"{'dense MiB/step':>15} {'peak MiB (rank 0)':>18}")
        reference = uncached = None
        notes = []
        for label, kind in labels:
            plan = None
            if kind.startswith("planned:"):
                plan, note = _planned(args, world, int(kind.split(":")[1]))
                notes.append(f"  {label}: {note}")
            r = _row(args, world, kind, plan)
            reference = reference or r["step"]
            if kind == "row_wise":
                uncached = r["table"]
            versus = f"{r['table'] / uncached:11.3f}" if kind.startswith("row_wise:") else f"{'':>11}"
            hits = f"{r['hits']:6.1%}" if r["hits"] is not None else f"{'':>6}"
            print(f"  {label:<24} {r['step'] * 1e3:9.1f} {r['step'] / reference:7.3f} {r['table'] / 2**20:15.3f} "
                  f"{versus} {hits} {r['dense'] / 2**20:15.3f} {r['peak'] / 2**20:18.1f}")
        print("\n".join(notes))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
