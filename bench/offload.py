"""Offload: the device-resident peak and step time of each kind of offload, and the largest GPT
this machine trains with and without the disk tier.

This machine has no GPU: the device is emulated (docs/offload.md). The runtime marks what lives
in host memory or on disk, and :class:`graphpass.runtime.memory.MemoryProbe` counts every other
tensor as device-resident; every copy, wait and disk write is real. So the peaks below are what
a device would hold, the step times are this CPU's (copies between two places in the same RAM
are cheaper than over PCIe, the disk is real).

**1. Each kind of offload against none** (one process, the example GPT, default 8 layers of 512,
AdamW): for each row the model is compiled with ``Strategy(offload=..., offload_window=...)``,
one warm-up step creates the optimizer state, then one step (``train_step`` + ``opt.step()``)
runs under the probe with the model state, the compute copies, resident buffers and the batch as
its baseline (the state counts from the start, wherever it is resident). Columns:

* ``peak``: the device-resident peak (MiB) and ``/none`` its ratio to no offload;
* ``saved``: the most bytes one forward leaves on the device for its backward (live bytes after
  the forward minus before it): the activations, and with streamed parameters the window of them;
* ``step ms``: the median of ``--steps`` measured steps (forward, backward, optimizer step) and
  ``/none`` the overhead.

The optimizer offloads should take the optimizer state (Adam's two moments, 8 bytes a parameter)
off the peak, and gradients 4 more; streamed parameters keep a window of ``k`` layers of weights;
activations offloaded keep one layer's saved tensors in flight (the one being saved or reloaded)
plus what lies outside the repeated layers (the LM head's logits), so their ``saved`` is about
``1/L`` of none's plus the head's. The ``all, disk`` row steps the optimizer from files.

**2. FSDP2's CPUOffloadPolicy** in the same run, on one gloo rank: ``fully_shard`` per block and
at the root with ``offload_policy=CPUOffloadPolicy()``, its step time against FSDP2 without it and
against graphpass's ``all, window 1`` row. Where torch refuses it on a CPU-only
machine the row says why.

**3. The largest GPT that trains 3 steps** on this machine (its RAM, no swap), each in a child
process that the kernel may kill for memory (``oom_score_adj`` 1000: it goes first): GPTs of
width ``--big-embd`` (2048) and depth 8, 16, 24, ... layers, a batch of 1 x 64 tokens, AdamW.

* ``eager``: plain PyTorch (``loss.backward(); opt.step()``): 16 bytes a parameter in RAM plus
  activations; the depths are tried upwards until one fails;
* ``disk``: ``gp.compile(..., strategy=Strategy(offload=("optimizer", "gradients",
  "parameters"), offload_to="disk"), offload_dir=--offload-dir)``: master weights, gradients and
  Adam's state (16 bytes a parameter) in files, the compute copies streamed a window of one
  layer at a time; the depths are tried downwards from the deepest whose files fit the disk's
  free space, until one trains.

The headline is ``largest disk / largest eager`` (parameters); STRONGHOLD reports 1.9-6.5x on a
32 GB V100. Each row prints the parameters, the result, the child's wall time and its peak RSS
(which counts file pages it has mapped; the kernel can reclaim those, not the anonymous ones).

    python bench/offload.py                       # all three (about 20 min here)
    python bench/offload.py --no-largest          # sections 1 and 2 (about 1 min)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import graphpass as gp
from graphpass.runtime.memory import MemoryProbe, optimizer_state_tensors

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from configs import param_count  # noqa: E402  (examples/ is not a package)
from gpt import GPT, GPTConfig  # noqa: E402
from gpt_args import add_gpt_args, gpt_batches, gpt_config  # noqa: E402

MIB = 2**20
KINDS = ("optimizer", "gradients", "parameters", "activations")

#: (row, Strategy keyword arguments): section 1.
ROWS = (
    ("none", {}),
    ("optimizer", {"offload": ("optimizer",)}),
    ("optimizer+gradients", {"offload": ("optimizer", "gradients")}),
    ("parameters, window 1", {"offload": ("optimizer", "parameters"), "offload_window": 1}),
    ("parameters, window 2", {"offload": ("optimizer", "parameters"), "offload_window": 2}),
    ("activations", {"offload": ("activations",)}),
    ("all, window 1", {"offload": KINDS}),
    ("all, disk", {"offload": KINDS, "offload_to": "disk"}),
)


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpt_args(p, vocab_size=8192, n_embd=512)
    p.set_defaults(n_layer=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="measured steps per row (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offload-dir", default=None, help="where the disk tier writes (default: a temporary directory)")
    p.add_argument("--no-largest", action="store_true", help="skip section 3 (the largest GPT)")
    p.add_argument("--big-embd", type=int, default=2048, help="section 3: the GPTs' width")
    p.add_argument("--big-heads", type=int, default=16)
    p.add_argument("--train-one", choices=("eager", "disk"), default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------ 1. each kind against none


def _measured_step(dmodel, opt, data) -> tuple[int, int]:
    """(device-resident peak, most bytes one forward kept) of one step under the probe."""
    grads = [p.grad for p in dmodel.parameters() if p.grad is not None]
    baseline = [*dmodel.parameters(), *dmodel.graph_module.parameters(), *grads, *optimizer_state_tensors(opt),
                *dmodel.resident_buffers(), *data]
    saved: list[int] = []
    with MemoryProbe(baseline=baseline) as probe:
        before: list[int] = []
        gm = dmodel.graph_module
        hooks = [gm.register_forward_pre_hook(lambda m, a: before.append(probe.current_bytes)),
                 gm.register_forward_hook(lambda m, a, o: saved.append(probe.current_bytes - before[-1]))]
        dmodel.train_step(*data)
        for hook in hooks:
            hook.remove()
        opt.step()
        opt.zero_grad()
    return probe.peak_bytes, max(saved)


def _timed_steps(step, opt, data, steps: int) -> float:
    """Median seconds of ``steps`` (train step + optimizer step + zero_grad)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(*data)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(args, kwargs: dict, data, offload_dir: str) -> dict:
    torch.manual_seed(args.seed)
    dmodel = gp.compile(GPT(gpt_config(args)), example_inputs=data[0], strategy=gp.Strategy(**kwargs),
                        offload_dir=offload_dir if kwargs.get("offload_to") == "disk" else None)
    opt = torch.optim.AdamW(dmodel.parameters(), lr=1e-4)
    dmodel.train_step(*data[0])
    opt.step()
    opt.zero_grad()
    gc.collect()
    peak, saved = _measured_step(dmodel, opt, data[1])
    return {"peak": peak, "saved": saved, "step": _timed_steps(dmodel.train_step, opt, data[1], args.steps)}


def each_kind(args, offload_dir: str) -> dict[str, dict]:
    data = gpt_batches(args, 2)
    rows = {}
    print(f"{'':24s} {'peak MiB':>9s} {'/none':>6s} {'saved MiB':>10s} {'/none':>6s} {'step ms':>8s} {'/none':>6s}")
    for label, kwargs in ROWS:
        rows[label] = r = _row(args, kwargs, data, offload_dir)
        none = rows["none"]
        print(f"{label:24s} {r['peak'] / MIB:9.1f} {r['peak'] / none['peak']:6.3f} {r['saved'] / MIB:10.1f} "
              f"{r['saved'] / none['saved']:6.3f} {r['step'] * 1e3:8.1f} {r['step'] / none['step']:6.2f}", flush=True)
    state = sum(p.numel() for p in GPT(gpt_config(args)).parameters()) * 4
    none = rows["none"]
    print(f"\noptimizer state off the peak: {(none['peak'] - rows['optimizer']['peak']) / state:.2f} parameter "
          "sizes (Adam's two moments: 2)")
    print(f"optimizer+gradients off the peak: {(none['peak'] - rows['optimizer+gradients']['peak']) / state:.2f} "
          "parameter sizes (moments + gradients: up to 3; the gradients of the layer in flight stay)")
    print(f"activations saved on the device / none's: {rows['activations']['saved'] / none['saved']:.3f} "
          f"(one layer of {args.n_layer} in flight: {1 / args.n_layer:.3f}, plus the LM head's logits)")
    return rows


# ------------------------------------------------------------------ 2. FSDP2 CPUOffloadPolicy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp2_offload(args, graphpass_step_s: float) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        data = gpt_batches(args, 2)
        times = {}
        for label, policy in (("FSDP2", None), ("FSDP2 CPUOffloadPolicy", CPUOffloadPolicy())):
            torch.manual_seed(args.seed)
            model = GPT(gpt_config(args))
            mesh = init_device_mesh("cpu", (1,))
            try:
                for block in model.h:
                    fully_shard(block, mesh=mesh, **({"offload_policy": policy} if policy else {}))
                fully_shard(model, mesh=mesh, **({"offload_policy": policy} if policy else {}))
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                step = lambda idx, targets: model(idx, targets).backward()  # noqa: E731
                step(*data[0])
                opt.step()
                opt.zero_grad()
                times[label] = _timed_steps(step, opt, data[1], args.steps)
            except Exception as exc:  # noqa: BLE001 - a bench row reports what torch refused
                print(f"{label:24s} does not run here: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                continue
            print(f"{label:24s} step {times[label] * 1e3:8.1f} ms", flush=True)
        if "FSDP2 CPUOffloadPolicy" in times:
            print(f"graphpass 'all, window 1' / FSDP2 CPUOffloadPolicy step time: "
                  f"{graphpass_step_s / times['FSDP2 CPUOffloadPolicy']:.2f}")
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ 3. the largest GPT


def _big_config(args, layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=8192, block_size=64, n_layer=layers, n_head=args.big_heads, n_embd=args.big_embd,
                     dropout=0.0, bias=True)


def _big_params(args, layers: int) -> int:
    return param_count(_big_config(args, layers))


def train_one(args) -> None:
    """The child process of section 3: build, train 3 steps, print what it saw as JSON."""
    with open("/proc/self/oom_score_adj", "w") as f:  # the kernel kills this one first
        f.write("1000")
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    model = GPT(_big_config(args, args.n_layer))
    g = torch.Generator().manual_seed(args.seed)
    batches = [(torch.randint(8192, (1, 64), generator=g), torch.randint(8192, (1, 64), generator=g))
               for _ in range(3)]
    if args.train_one == "eager":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(idx, targets):
            loss = model(idx, targets)
            loss.backward()
            return loss
    else:
        dmodel = gp.compile(model, example_inputs=batches[0], offload_dir=args.offload_dir,
                            strategy=gp.Strategy(offload=("optimizer", "gradients", "parameters"), offload_to="disk"))
        del model
        opt = torch.optim.AdamW(dmodel.parameters(), lr=1e-4)
        step = dmodel.train_step
    losses = []
    for batch in batches:
        losses.append(float(step(*batch)))
        opt.step()
        opt.zero_grad()
    print(json.dumps({"losses": losses, "wall_s": time.perf_counter() - start,
                      "maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


def _try(args, mode: str, layers: int, offload_dir: str) -> tuple[bool, str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--train-one", mode, "--n-layer", str(layers),
           "--big-embd", str(args.big_embd), "--big-heads", str(args.big_heads), "--offload-dir", offload_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    shutil.rmtree(offload_dir, ignore_errors=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [""])[-1]
        why = "killed for memory (SIGKILL)" if proc.returncode == -9 else f"exit {proc.returncode}: {tail[:120]}"
        return False, why
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return True, (f"trained, losses {', '.join(f'{x:.3f}' for x in out['losses'])}, {out['wall_s']:.0f} s, "
                  f"peak RSS {out['maxrss_gib']:.1f} GiB")


def largest(args, offload_dir: str) -> None:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"GPT width {args.big_embd}, {args.big_heads} heads, vocab 8192, batch 1 x 64 tokens, AdamW; "
          f"RAM {ram / 2**30:.1f} GiB, no swap")
    best = {}
    layers = 8
    while True:  # eager: upwards until one fails
        ok, what = _try(args, "eager", layers, os.path.join(offload_dir, "unused"))
        print(f"eager {layers:3d} layers {_big_params(args, layers) / 1e9:5.2f}B: {what}", flush=True)
        if not ok:
            break
        best["eager"] = layers
        layers += 8
    free = shutil.disk_usage(offload_dir).free
    per_layer = _big_params(args, 2) - _big_params(args, 1)
    layers = 8 * max(1, int(free * 0.9 / 16 / per_layer / 8))
    print(f"disk: {free / 2**30:.0f} GiB free under {offload_dir}; 16 bytes a parameter in files")
    while layers > best.get("eager", 0):  # disk: downwards from what the disk holds until one trains
        ok, what = _try(args, "disk", layers, os.path.join(offload_dir, f"gpt{layers}"))
        print(f"disk  {layers:3d} layers {_big_params(args, layers) / 1e9:5.2f}B: {what}", flush=True)
        if ok:
            best["disk"] = layers
            break
        layers -= 8
    if len(best) == 2:
        print(f"largest GPT trained 3 steps: eager {_big_params(args, best['eager']) / 1e9:.2f}B, disk offload "
              f"{_big_params(args, best['disk']) / 1e9:.2f}B: {_big_params(args, best['disk']) / _big_params(args, best['eager']):.2f}x "
              "(STRONGHOLD: 1.9-6.5x)")


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.train_one:
        train_one(args)
        return 0
    start = time.perf_counter()
    offload_dir = args.offload_dir or tempfile.mkdtemp(prefix="graphpass-offload-bench-")
    os.makedirs(offload_dir, exist_ok=True)
    config = gpt_config(args)
    print(f"GPT vocab={config.vocab_size} block={config.block_size} layers={config.n_layer} "
          f"heads={config.n_head} embd={config.n_embd}, batch {args.batch}, AdamW, one process; the device "
          "emulated (MemoryProbe), MiB = 2**20 bytes\n")
    rows = each_kind(args, offload_dir)
    print()
    fsdp2_offload(args, rows["all, window 1"]["step"])
    if not args.no_largest:
        print()
        largest(args, offload_dir)
    if args.offload_dir is None:
        shutil.rmtree(offload_dir, ignore_errors=True)
    print(f"(wall time {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
