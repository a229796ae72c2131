"""Per-rank peak memory of graphpass strategies against FSDP2 and ZeRO's analytic model state.

What is measured: on ``--world-size`` gloo ranks (default 2) of this machine, the example GPT
(``examples/gpt.py``, default 16.8M parameters, so weights, gradients and AdamW state dominate)
is built with the same seed and trained with AdamW one way after another in the same ranks:

* graphpass ``dp``, ``zero 1/2/3``, ``recompute`` (``Strategy(dp=N, recompute=True)``), and, if
  they compile when the bench runs, ``zero-3 + split 4``, ``tp 2`` (``dp=N/2``) and ``tp 2 + sp``
  (rows that ``Strategy.check`` or ``compile`` refuse with NotImplementedError, or whose
  Strategy field does not exist yet, print "not implemented yet");
* **FSDP2**: ``torch.distributed.fsdp.fully_shard`` on every transformer block, then on the root,
  fed this rank's slice of the same global batch (``loss.backward()``).

For each, one warm-up step (train step + ``AdamW.step()`` + ``zero_grad()``, which creates the
optimizer state), then one measured step under :class:`graphpass.runtime.memory.MemoryProbe`:
``train_step`` (forward + backward) and ``opt.step()``, with parameters, optimizer state and the
batch as the probe's baseline, as tests/test_zero.py ``_peak_bytes`` does. Columns:

* ``analytic state``: ZeRO paper accounting of parameter + gradient + optimizer bytes per rank
  for fp32 AdamW, Ψ parameters (tied weights once): params 4Ψ, grads 4Ψ, Adam m and v 8Ψ, so dp
  16Ψ; zero-1 8Ψ + 8Ψ/N; zero-2 4Ψ + 12Ψ/N; zero-3 (and FSDP2) 16Ψ/N; recompute as dp;
  "-" for tensor parallel (it depends on which layers are split).
* ``state``: the same thing measured: distinct storages of this rank's parameters, their
  ``.grad`` and the optimizer state right after the measured ``opt.step()`` (max over ranks).
  It exceeds the analytic figure by dim-0 row padding and AdamW's per-parameter ``step``
  scalars. It is *below* it for graphpass ZeRO-1/2, because graphpass stores every ZeRO-sharded
  parameter as its 1/N shard between steps (all stages gather it in forward; only stage 3 also
  frees it after use): zero-2 then holds 16Ψ/N like zero-3, and zero-1 16Ψ/N plus the 4Ψ
  all-reduced gradient buffer that its ``.grad`` shards are views of. The full parameters of
  stages 1/2 live only during the step, so they appear in ``fwd+bwd``.
* ``peak rN``: the probe's peak on rank N: model state plus whatever else was alive at the worst
  moment (activations saved for backward, gathered weights, gradient buckets, collective
  buffers, AdamW's temporaries). graphpass's data-parallel gradient buckets stay allocated
  between steps (as DDP's do; ``dmodel.resident_buffers()``) and count from the start; FSDP2
  keeps none.
* ``fwd+bwd`` and ``opt``: the activation / transient part, max over ranks of (peak during
  ``train_step`` − state) and of (peak during ``opt.step()`` − state): saved activations,
  gathered weights and gradient buffers in the first; AdamW's foreach temporaries in the second.
  The peak is state plus the larger of the two.

MiB = 2**20 bytes. The probe counts tensor storages only: no allocator slack, no gloo-internal
staging buffers, no Python objects (see runtime/memory.py for its limits).

Where the peaks are (default model): graphpass ZeRO-3 peaks at the start of backward, in the LM
head (its logits, their gradient and the saved log-softmax are 16 MiB each at 2 ranks, plus the
re-gathered tied ``wte``), not while a block's weights are gathered. OSDP splitting skips the tied
LM head, so ``zero-3 + split 4`` does not lower this peak on the GPT. The last section measures
ZeRO-3 with and without ``split=4`` on ``WideMLP``, a model whose peak is its gathered weights,
which is where OSDP splitting pays. Stage 1/2 keep every gathered weight for
backward, hence their larger ``fwd+bwd``.

Gradient accumulation (``dp, microbatches k``) and sequence parallelism are read on the bytes
one forward keeps for its backward (live bytes after the forward minus before it, max over the
microbatches and ranks): accumulation's should be 1/k of dp's (one microbatch's activations),
``tp 2 + sp``'s below ``tp 2``'s. Their whole-step peaks move less on this model: at 4 rows per
rank its peak is in backward, where the gradients (one full set, held back in the buckets'
own buffers under accumulation) and the LM head's logits gradient are alive, not the
activations.

How to read it: the ZeRO stages should step down in ``state`` as the analytic column does, and
the line ``zero-3 model-state bytes per rank / dp`` should be close to 1/N (padding rows only).
``graphpass zero-3 peak / FSDP2 peak`` compares the two implementations of the same algorithm at
the same world size (target <= 1.05; max over ranks of each). ``zero-3 + split 4 peak < zero-3
peak`` checks that OSDP splitting lowers the peak, once it is implemented.

    python bench/memory.py                   # 2 ranks (about 1 min here)
    python bench/memory.py --world-size 4
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import graphpass as gp
from graphpass.runtime.memory import MemoryProbe, optimizer_state_tensors, tensor_bytes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT  # noqa: E402  (examples/ is not a package)
from gpt_args import add_gpt_args, gpt_batches, gpt_config  # noqa: E402

MIB = 2**20

#: (row name, Strategy keyword arguments other than dp; "tp" sets dp = N / tp).
GRAPHPASS_ROWS = (
    ("graphpass dp", {}),
    ("graphpass zero-1", {"zero": 1}),
    ("graphpass zero-2", {"zero": 2}),
    ("graphpass zero-3", {"zero": 3}),
    ("graphpass recompute", {"recompute": True}),
    ("graphpass dp, microbatches 2", {"microbatches": 2}),
    ("graphpass dp, microbatches 4", {"microbatches": 4}),
    ("graphpass zero-3 + split 4", {"zero": 3, "split": 4}),
    ("graphpass tp 2", {"tp": 2}),
    ("graphpass tp 2 + sp", {"tp": 2, "sequence_parallel": True}),
)
FSDP2_ROW = "FSDP2 fully_shard"


SPLIT_KEY = "_split_wide_mlp"


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="number of gloo ranks (default 2)")
    add_gpt_args(p, vocab_size=8192, n_embd=512)
    p.add_argument("--batch", type=int, default=8, help="global batch (split over the ranks)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.batch % args.world_size:
        p.error(f"--batch {args.batch} must be a multiple of --world-size {args.world_size}")
    return args


def graphpass_strategy(world: int, kwargs: dict) -> tuple[gp.Strategy | None, str]:
    """The Strategy of a row, or None and why it cannot run (yet) on ``world`` ranks."""
    kwargs = dict(kwargs)
    tp = kwargs.get("tp", 1)
    if world % tp:
        return None, f"world size {world} is not a multiple of tp={tp}"
    fields = {f.name for f in dataclasses.fields(gp.Strategy)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        return None, "not implemented yet (no Strategy field " + ", ".join(unknown) + ")"
    try:
        strategy = gp.Strategy(dp=world // tp, **kwargs)
        strategy.check(world)
    except NotImplementedError:
        return None, "not implemented yet"
    return strategy, ""


def _measure(step, params, opt, warm_batch, batch, forward_module: nn.Module | None = None,
             resident=lambda: []) -> dict:
    """Peak of one train step + optimizer step after a warm-up step, and the model state.

    With ``forward_module`` (the compiled graph, run once per microbatch), also ``"saved"``:
    the most bytes any one forward left alive for its backward (activations saved, gathered
    weights kept), measured as live bytes after the forward minus before it. ``resident()``
    gives what the runtime keeps between steps (graphpass's gradient buckets), counted from the
    start like the state.
    """
    step(*warm_batch)
    opt.step()
    opt.zero_grad()
    gc.collect()
    state = list(params) + optimizer_state_tensors(opt) + list(resident())
    saved: list[int] = []
    with MemoryProbe(baseline=state + list(batch)) as probe:
        hooks = []
        if forward_module is not None:
            before: list[int] = []
            hooks = [forward_module.register_forward_pre_hook(lambda m, a: before.append(probe.current_bytes)),
                     forward_module.register_forward_hook(lambda m, a, o: saved.append(probe.current_bytes - before[-1]))]
        step(*batch)
        for hook in hooks:
            hook.remove()
        train_peak = probe.peak_bytes
        probe.reset_peak()
        opt.step()
        opt_peak = probe.peak_bytes
    grads = [p.grad for p in params]
    model_state = tensor_bytes(state + grads)
    opt.zero_grad()
    return {"peak": max(train_peak, opt_peak), "train": train_peak, "opt": opt_peak, "state": model_state,
            "saved": max(saved) if saved else None}


def _graphpass_row(args, world, strategy, data) -> dict:
    torch.manual_seed(args.seed)
    model = GPT(gpt_config(args))
    dmodel = gp.compile(model, gp.Cluster.local(), example_inputs=data[0], strategy=strategy)
    del model
    params = list(dmodel.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    return _measure(dmodel.train_step, params, opt, data[0], data[1], forward_module=dmodel.graph_module,
                    resident=dmodel.resident_buffers)


def _fsdp2_row(args, world, data) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    chunk = args.batch // world
    torch.manual_seed(args.seed)
    model = GPT(gpt_config(args))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step(idx, targets):
        loss = model(idx.narrow(0, rank * chunk, chunk), targets.narrow(0, rank * chunk, chunk))
        loss.backward()
        return loss.detach()

    return _measure(step, params, opt, data[0], data[1])


class WideMLP(nn.Module):
    """A model whose peak is its gathered weights: 4 layers of 1024 -> 4096 -> 1024, batch 8
    (48 MiB of fp32 weights, activations under 1 MiB). OSDP splitting is meant for this case."""

    def __init__(self, width: int = 1024, hidden: int = 4096, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return F.mse_loss(x, y)


def _split_rows(args: argparse.Namespace) -> dict:
    """ZeRO-3 with and without OSDP splitting on the weight-dominated WideMLP."""
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(args.seed)
    data = [(torch.randn(8, 1024, generator=g), torch.randn(8, 1024, generator=g)) for _ in range(2)]
    rows = {}
    for name, kwargs in (("zero-3", {"zero": 3}), ("zero-3 + split 4", {"zero": 3, "split": 4})):
        torch.manual_seed(args.seed)
        dmodel = gp.compile(WideMLP(), gp.Cluster.local(), example_inputs=data[0], strategy=gp.Strategy(dp=world, **kwargs))
        params = list(dmodel.parameters())
        rows[name] = _measure(dmodel.train_step, params, torch.optim.AdamW(params, lr=1e-4), data[0], data[1])
        del dmodel, params
        gc.collect()
    return rows


def _run_rank(args: argparse.Namespace) -> dict:
    world = dist.get_world_size()
    data = gpt_batches(args, 2)
    rows: dict[str, dict | str] = {}
    for name, kwargs in GRAPHPASS_ROWS:
        strategy, why = graphpass_strategy(world, kwargs)
        k = kwargs.get("microbatches", 1)
        if strategy is not None and args.batch % (strategy.dp * k):
            strategy, why = None, f"--batch {args.batch} does not split into dp={strategy.dp} x {k} microbatches"
        if strategy is None:
            rows[name] = why
            continue
        try:
            rows[name] = _graphpass_row(args, world, strategy, data)
        except NotImplementedError:  # compile refuses before any collective: same on all ranks
            rows[name] = "not implemented yet"
        gc.collect()
    rows[FSDP2_ROW] = _fsdp2_row(args, world, data)
    gc.collect()
    rows[SPLIT_KEY] = _split_rows(args)
    return rows


def analytic_state_bytes(name: str, num_params: int, world: int) -> float | None:
    """ZeRO's fp32 AdamW accounting (params 4Ψ, grads 4Ψ, m + v 8Ψ) per rank, or None."""
    psi, n = num_params, world
    if name == FSDP2_ROW or "zero-3" in name:
        return 16 * psi / n
    if "zero-2" in name:
        return 4 * psi + 12 * psi / n
    if "zero-1" in name:
        return 8 * psi + 8 * psi / n
    if "tp" in name:
        return None
    return 16 * psi  # dp, recompute


def _print_ratios(rows: dict, results: list) -> None:
    """Accumulation's and sequence parallelism's activation memory against their references:
    the bytes one forward keeps for its backward (``saved``, max over ranks)."""
    def saved(name: str) -> float | None:
        if name not in rows or isinstance(rows[name], str):
            return None
        return max(r[name]["saved"] for r in results)

    dp = saved("graphpass dp")
    print(f"activations one forward keeps for backward: dp {dp / MIB:.1f} MiB")
    for k in (2, 4):
        acc = saved(f"graphpass dp, microbatches {k}")
        if dp and acc is not None:
            print(f"dp microbatches {k} / dp: {acc / dp:.3f} (1/k = {1 / k:.3f})")
    tp, sp = saved("graphpass tp 2"), saved("graphpass tp 2 + sp")
    if tp and sp is not None:
        print(f"tp 2 + sp / tp 2: {sp / tp:.3f} (below 1: sequence shards, column inputs re-gathered in backward)")


def main(argv=None) -> None:
    args = _parse_args(argv)
    t0 = time.perf_counter()
    results = gp.launch(_run_rank, args.world_size, args=(args,), timeout_s=600)
    world = args.world_size
    c = gpt_config(args)
    num_params = sum(p.numel() for p in GPT(c).parameters())  # tied weights once
    print(f"GPT vocab={c.vocab_size} block={c.block_size} layers={c.n_layer} heads={c.n_head} "
          f"embd={c.n_embd}: Ψ = {num_params / 1e6:.2f}M params ({4 * num_params / MIB:.1f} MiB fp32); "
          f"global batch {args.batch} on {world} gloo ranks; AdamW")
    print("one measured step (train_step + AdamW.step) after one warm-up step; MiB = 2**20 bytes")
    print()
    peaks_header = " ".join(f"{f'peak r{r}':>9s}" for r in range(world))
    print(f"{'':28s} {'analytic state':>14s} {'state':>9s} {peaks_header} {'fwd+bwd':>8s} {'opt':>8s}")
    rows = dict(results[0])
    split_rows = [r.pop(SPLIT_KEY) for r in results]
    rows.pop(SPLIT_KEY)
    figures: dict[str, dict] = {}
    for name in rows:
        if isinstance(rows[name], str):
            print(f"{name:28s} {rows[name]}")
            continue
        peaks = [results[r][name]["peak"] for r in range(world)]
        states = [results[r][name]["state"] for r in range(world)]
        # Above the model state, max over ranks: during train_step, during opt.step.
        train = max(results[r][name]["train"] - states[r] for r in range(world))
        opt = max(results[r][name]["opt"] - states[r] for r in range(world))
        figures[name] = {"peak": max(peaks), "state": max(states)}
        analytic = analytic_state_bytes(name, num_params, world)
        analytic_text = "-" if analytic is None else f"{analytic / MIB:.1f}"
        peaks_text = " ".join(f"{p / MIB:9.1f}" for p in peaks)
        print(f"{name:28s} {analytic_text:>14s} {max(states) / MIB:9.1f} {peaks_text} {train / MIB:8.1f} {opt / MIB:8.1f}")
    print()
    dp, z3, fsdp = figures["graphpass dp"], figures["graphpass zero-3"], figures[FSDP2_ROW]
    print(f"zero-3 model-state bytes per rank / dp: {z3['state'] / dp['state']:.4f} "
          f"(expect 1/N = {1 / world:.4f} within padding)")
    print(f"graphpass zero-3 peak / FSDP2 peak: {z3['peak'] / fsdp['peak']:.3f} (target <= 1.05)")
    split = figures.get("graphpass zero-3 + split 4")
    if split is None:
        print("zero-3 + split 4 peak < zero-3 peak: not implemented yet")
    else:
        lower = split["peak"] < z3["peak"]
        print(f"zero-3 + split 4 peak < zero-3 peak: {'yes' if lower else 'no'} "
              f"({split['peak'] / MIB:.1f} vs {z3['peak'] / MIB:.1f} MiB"
              f"{'' if lower else '; where the peak is: see the module docstring'})")
    _print_ratios(rows, results)
    print()
    print("OSDP splitting where gathered weights dominate (WideMLP: 4 x [1024 -> 4096 -> 1024], batch 8):")
    peak = {name: max(r[name]["peak"] for r in split_rows) for name in split_rows[0]}
    for name, value in peak.items():
        print(f"  graphpass {name:18s} peak {value / MIB:8.1f} MiB")
    lower = peak["zero-3 + split 4"] < peak["zero-3"]
    print(f"zero-3 + split 4 peak < zero-3 peak (WideMLP): {'yes' if lower else 'no'} "
          f"(ratio {peak['zero-3 + split 4'] / peak['zero-3']:.3f})")
    print(f"(wall time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
