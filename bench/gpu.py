"""One GPU, one prepared run: the compiled program against eager, and the planner against both.

What is measured (one process, ``dp = 1``), on a ~1B-parameter GPT (``examples/gpt.py``, 24
layers, width 1792, 14 heads, sequence 2048, vocabulary 50304) in bf16 with AdamW:

* **eager**: ``loss = model(idx, targets); loss.backward(); opt.step(); opt.zero_grad()``;
* **graphpass**: ``gp.compile(model, strategy=gp.Strategy(dp=1))`` and ``dmodel.train_step``
  with the same optimizer step;
* for each: median step time over ``--steps`` steps after ``--warmup`` (CUDA-synchronised
  ``time.perf_counter``), MFU = model FLOPs per step (forward + backward from the captured graph,
  ``graphpass.cost.compute.total_flops``) / (step time x the device's peak bf16 FLOP/s from its
  preset), and ``torch.cuda.max_memory_allocated`` over a steady-state step;
* the planner's prediction for the same model, batch and device: ``gp.plan(...,
  strategy=gp.Strategy(dp=1))`` with the preset figures (``Cluster.local()``), and again after
  ``gp.profile(world_size=1)`` with ``measure_ops=True`` (measured matmul rate, bandwidth and op
  times); printed next to the measured step time and peak with the relative error.

**Offload row**: a GPT of width 5120 (GPT-3 13B's) deep enough that its bf16 training state
(weights, gradients and AdamW's two moments: 8 bytes a parameter) is about twice the GPU's
memory, capped so that the host (which holds the same 8 bytes a parameter, pinned) keeps 40%
free, at 1 x 2048 tokens: ``Strategy(offload=("optimizer", "gradients", "parameters"))`` (the
master weights and AdamW on the host, the compute copies streamed a window of one layer ahead)
against FSDP2 ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` on a one-rank NCCL group,
step time and peak for each, and the state over the GPU's memory.

Each part runs in its own ``try`` so that one failure still leaves the other figures printed (a
GPU session is short). Lines starting with ``RESULT`` are the figures to commit under
``bench/results/gpu-*.txt``.

    python bench/gpu.py                       # on a CUDA machine: ~3-5 minutes on an H100/H200
    python bench/gpu.py --tiny --device cpu   # smoke test of the script itself (small GPT, fp32)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import torch

import graphpass as gp
from graphpass.capture import capture
from graphpass.cluster import _preset_for_gpu
from graphpass.cost.compute import total_flops
from graphpass.planner import Planner

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig  # noqa: E402  (examples/ is not a package)

GiB = 2**30


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small GPT in fp32 (smoke test)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    return p.parse_args(argv)


def _config(tiny: bool) -> GPTConfig:
    if tiny:
        return GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128)
    return GPTConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=14, n_embd=1792)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _run(step, device: str, warmup: int, steps: int) -> tuple[float, int]:
    """Median step seconds and the peak allocated bytes of one steady-state step."""
    for _ in range(warmup):
        step()
    _sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    return statistics.median(times), peak


def main(argv=None) -> None:
    args = _args(argv)
    device, dtype = args.device, (torch.float32 if args.tiny else torch.bfloat16)
    config = _config(args.tiny)
    torch.manual_seed(0)
    idx = torch.randint(config.vocab_size, (args.batch, config.block_size), device=device)
    targets = torch.randint(config.vocab_size, (args.batch, config.block_size), device=device)
    cluster = gp.Cluster.local(1)
    print(f"device: {cluster}  model: {config}  batch {args.batch} x {config.block_size}, {dtype}")
    key = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    # MFU is against the data-sheet peak of the device's preset: Cluster.local reads a profile
    # cached by an earlier gp.profile (this script writes one), whose measured matmul rate would
    # make the same step time read as a higher MFU.
    preset = _preset_for_gpu(torch.cuda.get_device_name(0)) if device.startswith("cuda") else None
    spec = gp.Cluster.preset(preset).device if preset else cluster.device
    peak_flops = spec.peak_tflops.get(key, next(iter(spec.peak_tflops.values()))) * 1e12
    print(f"RESULT MFU against {peak_flops / 1e12:.0f} TFLOP/s ({spec.name} {key})")

    with torch.device("meta"):
        meta_model = GPT(config).to(dtype)
    meta_inputs = (idx.to("meta"), targets.to("meta"))
    fwd, bwd = total_flops(capture(meta_model, meta_inputs).gm)
    flops = fwd + bwd
    params = sum(p.numel() for p in meta_model.parameters())
    print(f"RESULT model: {params / 1e6:.1f}M parameters, {flops / 1e12:.2f} TFLOP per step (forward + backward)")

    measured: dict[str, tuple[float, int]] = {}
    for name in ("eager", "graphpass"):
        try:
            torch.manual_seed(0)
            model = GPT(config).to(device=device, dtype=dtype)
            if name == "eager":
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

                def step():
                    model(idx, targets).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            else:
                dmodel = gp.compile(model, cluster, example_inputs=(idx, targets), strategy=gp.Strategy(dp=1))
                opt = torch.optim.AdamW(dmodel.parameters(), lr=1e-4)

                def step():
                    dmodel.train_step(idx, targets)
                    opt.step()
                    opt.zero_grad(set_to_none=True)

            seconds, peak = _run(step, device, args.warmup, args.steps)
            measured[name] = (seconds, peak)
            print(f"RESULT {name}: step {seconds * 1e3:.1f} ms, MFU {flops / seconds / peak_flops:.1%}, "
                  f"peak {peak / GiB:.2f} GiB")
            del model, opt
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - keep going: the other figures are still worth printing
            print(f"FAILED {name}:\n{traceback.format_exc()}")
    if "eager" in measured and "graphpass" in measured:
        (te, me), (tg, mg) = measured["eager"], measured["graphpass"]
        print(f"RESULT graphpass / eager: step time {tg / te:.3f}, peak memory {mg / max(me, 1):.3f}")

    for label, make in (("preset figures", lambda: cluster),
                        ("profiled", lambda: gp.profile(world_size=1, quick=args.tiny))):
        try:
            planner = Planner(meta_model, make(), meta_inputs, measure_ops=(label == "profiled"))
            plan = planner.price(gp.Strategy(dp=1))
            line = (f"RESULT planner ({label}): predicted step {plan.report.predicted_step_time_s * 1e3:.1f} ms, "
                    f"peak {plan.report.predicted_peak_memory_bytes / GiB:.2f} GiB")
            if "graphpass" in measured:
                t, m = measured["graphpass"]
                line += (f"; error vs graphpass: time {(plan.report.predicted_step_time_s - t) / t:+.1%}"
                         + (f", memory {(plan.report.predicted_peak_memory_bytes - m) / m:+.1%}" if m else ""))
            print(line)
        except Exception:  # noqa: BLE001
            print(f"FAILED planner ({label}):\n{traceback.format_exc()}")
    offload_row(args)


def offload_row(args) -> None:
    """The offload row (see the module docstring)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    device = args.device
    width = 128 if args.tiny else 5120
    per_layer = 12 * width * width
    gpu = torch.cuda.get_device_properties(0).total_memory if device.startswith("cuda") else 2**30
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    layers = 2 if args.tiny else max(2, min(int(2 * gpu / 8 / per_layer), int(0.6 * host / 8 / per_layer)))
    config = GPTConfig(vocab_size=512 if args.tiny else 50304, block_size=64 if args.tiny else 2048,
                       n_layer=layers, n_head=width // 128 or 1, n_embd=width)
    params = layers * per_layer
    print(f"RESULT offload model: {layers} layers of {width}, {params / 1e9:.1f}B parameters, bf16 state "
          f"{8 * params / GiB:.0f} GiB = {8 * params / gpu:.2f}x the GPU's memory")
    idx = torch.randint(config.vocab_size, (1, config.block_size), device=device)
    targets = torch.randint(config.vocab_size, (1, config.block_size), device=device)
    measured = {}
    for name in ("graphpass offload", "FSDP2 CPUOffloadPolicy"):
        try:
            torch.manual_seed(0)
            if name == "graphpass offload":
                with torch.device(device):
                    model = GPT(config).to(torch.bfloat16)
                dmodel = gp.compile(model, gp.Cluster.local(1), example_inputs=(idx, targets),
                                    strategy=gp.Strategy(offload=("optimizer", "gradients", "parameters")))
                opt = torch.optim.AdamW(dmodel.parameters(), lr=1e-4)

                def step():
                    dmodel.train_step(idx, targets)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            else:
                if not dist.is_initialized():
                    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                            init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
                model = GPT(config).to(torch.bfloat16)  # on the host: the policy keeps it there
                mesh = init_device_mesh(device.split(":")[0], (1,))
                for block in model.h:
                    fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy())
                fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

                def step():
                    model(idx, targets).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            seconds, peak = _run(step, device, 1, max(2, args.steps // 3))
            measured[name] = seconds
            print(f"RESULT {name}: step {seconds * 1e3:.1f} ms, GPU peak {peak / GiB:.2f} GiB")
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - keep going: the other figures are still worth printing
            print(f"FAILED {name}:\n{traceback.format_exc()}")
    if len(measured) == 2:
        print(f"RESULT graphpass offload / FSDP2 CPUOffloadPolicy step time: "
              f"{measured['graphpass offload'] / measured['FSDP2 CPUOffloadPolicy']:.3f}")


if __name__ == "__main__":
    main()
