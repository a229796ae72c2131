"""Step time of graphpass ZeRO-3 against FSDP2, and of graphpass TP against DTensor TP.

What is measured: for each world size in ``--world-sizes`` (default 2 and 4; one launch of gloo
ranks each), the same GPT (``examples/gpt.py``, same seed, so the same initial weights) is
trained on the same sequence of global batches two ways side by side, per pair:

* **ZeRO-3**: ``gp.compile(model, strategy=gp.Strategy(dp=N, zero=3))`` and
  ``dmodel.train_step(idx, targets)``, against FSDP2: ``fully_shard`` on every transformer block,
  then on the root (one all-gather per block in forward, re-gathered in backward, gradients
  reduce-scattered), fed this rank's slice of the global batch;
* **HSDP** (4 ranks and more): ``gp.Strategy(dp=N, zero=3, dp_shard=2)`` (ZeRO-3 inside pairs
  of ranks, replicated across pairs) against FSDP2's HSDP: ``fully_shard`` on a 2-D
  ``(N/2, 2)`` mesh, the same blocks;
* **TP 2**: ``gp.Strategy(dp=N/2, tp=2)`` against DTensor ``parallelize_module`` on the ``tp``
  axis of a ``(dp, tp)`` mesh: ``ColwiseParallel`` on attention q, k, v and MLP up,
  ``RowwiseParallel`` on attention proj and MLP down (Megatron's split; each attention module
  then runs ``n_head / 2`` local heads), wrapped in DDP over ``dp`` when ``dp > 1``
  (``torch.distributed.tensor.parallel.ddp._pre_dp_module_transform``). This half prints "not
  implemented yet" until ``gp.Strategy(tp=2)`` passes ``Strategy.check`` and compiles.

One *step* is forward + backward + ``AdamW.step()`` + ``zero_grad()``, timed on every rank with
``time.perf_counter`` (rank 0's times are reported; the ranks are coupled by collectives). After
a warm-up of both sides, they run in alternating rounds of ``--steps-per-round`` steps (who goes
first alternates too), each round started by a barrier, so machine noise hits both sides alike.
graphpass's step includes the all-reduce of the loss it returns; the reference's losses are
averaged after timing. Both sides take the same optimizer steps from the same weights, so their
losses must agree up to fp32 rounding (AdamW can amplify rounding-level gradient differences
into lr-sized updates, so a drift of ~1e-4 after many steps is not a bug; see DESIGN.md).

How to read it: per pair, the median, 10th and 90th percentile step time of each side, the
median of per-round ratios (cancels slow drifts in machine load) and the ratio of medians
``graphpass / reference step time``; 1.00 is parity, the target is <= 1.1. The machine's cores
are shared by the ranks (``--threads`` intra-op threads each; at 4 ranks on a 2-core machine they
are oversubscribed, so compute is slower and noisier and communication overlap matters less).

``--model llama`` runs the ZeRO-3 pair on a Llama-style decoder instead (``examples/configs.py``'s
``LlamaLike``: RMSNorm, rotary, SwiGLU; FSDP2 wraps each decoder layer); the TP pair stays on
the GPT (its DTensor plan names the GPT's modules).

    python bench/sharding_speed.py                       # 2 then 4 ranks (about 3 min here)
    python bench/sharding_speed.py --world-sizes 2 --rounds 16
    python bench/sharding_speed.py --model llama --world-sizes 2 --batch 16 --block-size 64 --n-embd 256
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

import graphpass as gp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT  # noqa: E402  (examples/ is not a package)
from gpt_args import add_gpt_args, gpt_batches, gpt_config, llama_config  # noqa: E402
from alternating import alternate  # noqa: E402
from configs import LlamaLike  # noqa: E402

TP = 2
HSDP_SHARD = 2  # ZeRO-3 inside pairs of ranks, replicated across pairs (world sizes >= 4)


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default="2,4", help="comma-separated gloo rank counts (default 2,4)")
    add_gpt_args(p, vocab_size=8192, n_embd=512)
    p.add_argument("--batch", type=int, default=8, help="global batch (split over the dp ranks)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each side first")
    p.add_argument("--rounds", type=int, default=8, help="rounds per side (they alternate)")
    p.add_argument("--steps-per-round", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per rank (default: cpu_count // world_size, at least 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt", help="model of the ZeRO-3 pair")
    args = p.parse_args(argv)
    if args.model == "llama" and "--vocab-size" not in (argv or sys.argv):
        args.vocab_size = 1024
    args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    for w in args.world_sizes:
        if args.batch % w:
            p.error(f"--batch {args.batch} must be a multiple of every world size (got {w})")
    return args


def tp_strategy(world: int) -> tuple[gp.Strategy | None, str]:
    """``Strategy(dp=N/2, tp=2)`` if graphpass accepts it on ``world`` ranks, else None and why."""
    if world % TP:
        return None, f"world size {world} is not a multiple of tp={TP}"
    if "tp" not in {f.name for f in dataclasses.fields(gp.Strategy)}:
        return None, "not implemented yet"
    try:
        strategy = gp.Strategy(dp=world // TP, tp=TP)
        strategy.check(world)
    except NotImplementedError:
        return None, "not implemented yet"
    return strategy, ""


# ---------------------------------------------------------------------------- reference sides

def _fsdp2_step_fn(args, model: GPT, shard: int | None = None):
    """FSDP2 over all ranks, or its HSDP (``shard`` ranks per group): ``fully_shard`` on a 2-D
    ``(replicate, shard)`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    if shard is None:
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    for block in (model.model.model.layers if isinstance(model, LlamaLike) else model.h):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _eager_step_fn(model, model.parameters(), args, rank, world)


def _local_heads_attention(self, x: torch.Tensor) -> torch.Tensor:
    """CausalSelfAttention.forward where q/k/v hold ``self.n_head`` local heads (column shards)."""
    B, T, _ = x.shape
    q, k, v = self.q(x), self.k(x), self.v(x)
    C, h = q.shape[-1], self.n_head
    q, k, v = (t.view(B, T, h, C // h).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(B, T, C))


def _dtensor_tp_step_fn(args, model: GPT):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size()
    dp = world // TP
    mesh = init_device_mesh("cpu", (dp, TP), mesh_dim_names=("dp", "tp"))
    for block in model.h:
        parallelize_module(block, mesh["tp"], {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(),
        })
        block.attn.n_head //= TP
        block.attn.forward = types.MethodType(_local_heads_attention, block.attn)
    module = model
    if dp > 1:
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

        _pre_dp_module_transform(model)
        module = DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    return _eager_step_fn(module, model.parameters(), args, mesh["dp"].get_local_rank(), dp)


def _eager_step_fn(module, params, args, dp_rank: int, dp: int):
    opt = torch.optim.AdamW(list(params), lr=args.lr)
    chunk = args.batch // dp

    def step(idx, targets):
        # The same slice of the global batch that graphpass gives this rank.
        loss = module(idx.narrow(0, dp_rank * chunk, chunk), targets.narrow(0, dp_rank * chunk, chunk))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def _graphpass_step_fn(args, model: GPT, strategy: gp.Strategy, example):
    dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=example, strategy=strategy)
    opt = torch.optim.AdamW(dmodel.parameters(), lr=args.lr)

    def step(idx, targets):
        loss = dmodel.train_step(idx, targets)
        opt.step()
        opt.zero_grad()
        return loss

    return step


# ---------------------------------------------------------------------------- timing

def _race(args, data, sides: dict, reference_dp_group=None) -> dict:
    """Alternate the sides in rounds; return per-side step times and the loss check."""
    names = list(sides)
    times, losses = alternate(sides, data, args.warmup, args.rounds, args.steps_per_round)
    gp_losses = torch.stack(losses[names[0]])
    ref_losses = torch.stack(losses[names[1]])
    # The reference returns this rank's mean over its batch slice -> global mean over dp.
    dp = dist.get_world_size(reference_dp_group)
    dist.all_reduce(ref_losses, group=reference_dp_group)
    ref_losses /= dp
    return {"times": times, "max_loss_diff": (gp_losses - ref_losses).abs().max().item()}


def _run_rank(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    world = dist.get_world_size()
    config = gpt_config(args)
    data = gpt_batches(args, args.warmup + args.rounds * args.steps_per_round)
    build = (lambda: LlamaLike(llama_config(args))) if args.model == "llama" else (lambda: GPT(config))
    out: dict = {"params": sum(p.numel() for p in build().parameters())}

    torch.manual_seed(args.seed)
    gp_model = build()
    torch.manual_seed(args.seed)
    ref_model = build()
    sides = {
        "graphpass zero-3": _graphpass_step_fn(args, gp_model, gp.Strategy(dp=world, zero=3), data[0]),
        "FSDP2": _fsdp2_step_fn(args, ref_model),
    }
    del gp_model  # compile keeps only this rank's shards
    out["zero3"] = _race(args, data, sides)
    del sides, ref_model

    if world >= 2 * HSDP_SHARD and world % HSDP_SHARD == 0:
        torch.manual_seed(args.seed)
        gp_model = build()
        torch.manual_seed(args.seed)
        ref_model = build()
        sides = {
            f"graphpass HSDP {HSDP_SHARD}": _graphpass_step_fn(
                args, gp_model, gp.Strategy(dp=world, zero=3, dp_shard=HSDP_SHARD), data[0]),
            "FSDP2 HSDP": _fsdp2_step_fn(args, ref_model, shard=HSDP_SHARD),
        }
        del gp_model
        out["hsdp"] = _race(args, data, sides)
        del sides, ref_model

    strategy, why = tp_strategy(world)
    if strategy is None:
        out["tp"] = why
        return out
    torch.manual_seed(args.seed)
    gp_model = GPT(config)
    torch.manual_seed(args.seed)
    ref_model = GPT(config)
    sides = {
        f"graphpass tp {TP}": _graphpass_step_fn(args, gp_model, strategy, data[0]),
        "DTensor TP": _dtensor_tp_step_fn(args, ref_model),
    }
    # Ranks of one tp group see the same batch slice: average the reference's losses over dp only.
    dp_groups = [dist.new_group(list(range(t, world, TP))) for t in range(TP)]
    out["tp"] = _race(args, data, sides, reference_dp_group=dp_groups[dist.get_rank() % TP])
    return out


# ---------------------------------------------------------------------------- report

def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _report(args, result: dict, title: str) -> None:
    times = result["times"]
    ours, ref = list(times)
    print(f"  {title}")
    print(f"  {'':18s} {'median ms':>10s} {'p10 ms':>8s} {'p90 ms':>8s} {'steps':>6s}")
    for name, ts in times.items():
        print(f"  {name:18s} {statistics.median(ts) * 1e3:10.1f} {_quantile(ts, 0.1) * 1e3:8.1f} "
              f"{_quantile(ts, 0.9) * 1e3:8.1f} {len(ts):6d}")
    k = args.steps_per_round
    a, b = times[ours], times[ref]
    paired = [statistics.median(a[i:i + k]) / statistics.median(b[i:i + k]) for i in range(0, len(a), k)]
    print(f"  max |loss {ours} - loss {ref}|: {result['max_loss_diff']:.2e}")
    print(f"  median of per-round ratios: {statistics.median(paired):.3f} "
          f"(p10 {_quantile(paired, 0.1):.3f}, p90 {_quantile(paired, 0.9):.3f})")
    ratio = statistics.median(a) / statistics.median(b)
    print(f"  {ours} / {ref} step time: {ratio:.3f} (target <= 1.1)")


def main(argv=None) -> None:
    args = _parse_args(argv)
    t0 = time.perf_counter()
    c = gpt_config(args)
    header_done = False
    for world in args.world_sizes:
        result = gp.launch(_run_rank, world, args=(args,), timeout_s=600)[0]
        if not header_done:
            model = "Llama-style (LlamaLike) for ZeRO-3, GPT for TP" if args.model == "llama" else "GPT"
            print(f"{model} vocab={c.vocab_size} block={c.block_size} layers={c.n_layer} "
                  f"embd={c.n_embd}: {result['params'] / 1e6:.2f}M params; global batch {args.batch}; AdamW")
            print(f"{args.rounds} alternating rounds x {args.steps_per_round} step(s) per side after "
                  f"{args.warmup} warm-up steps each (step = fwd + bwd + AdamW.step + zero_grad)")
            header_done = True
        threads = args.threads or max(1, (os.cpu_count() or 1) // world)
        print()
        print(f"{world} gloo ranks, {threads} thread(s) each")
        _report(args, result["zero3"], f"ZeRO-3: graphpass Strategy(dp={world}, zero=3) vs FSDP2 fully_shard")
        print()
        if "hsdp" in result:
            _report(args, result["hsdp"], f"HSDP: graphpass Strategy(dp={world}, zero=3, dp_shard={HSDP_SHARD}) "
                                          f"vs FSDP2 fully_shard on a ({world // HSDP_SHARD}, {HSDP_SHARD}) mesh")
            print()
        if isinstance(result["tp"], str):
            print(f"  TP {TP}: graphpass tp {TP} / DTensor TP step time: {result['tp']}")
        else:
            _report(args, result["tp"], f"TP {TP}: graphpass Strategy(dp={world // TP}, tp={TP}) "
                                        f"vs DTensor parallelize_module")
    print(f"(wall time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
