"""Property test of the tensor-parallel propagation rules, as DTensor's own op tests check its
sharding rules: for an op with inputs placed on a tp axis of 2, the rewritten graph runs on 2
gloo ranks, and the rule's output placement must describe the global result exactly —
``Shard(d)``: the ranks' outputs concatenated along ``d``; ``Partial()``: their sum;
``Replicate()``: each rank's output. Inputs are buffers (sharded by the pass from the plan), so
every rule, every dim and every combination is exercised without a model.

A rule that claims ``Replicate()`` for chunks that are sharded (the bug where ``getitem`` of a
multi-output node was tagged replicated) fails here on numbers, not on shapes.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor.placement_types import Replicate, Shard

import graphpass as gp
from graphpass.capture import capture
from graphpass.layout import placement_to_str
from graphpass.passes.tensor_parallel import MergedShard, Walker, keeps_shard
from graphpass.passes.tensor_parallel.walker import KEEPS, rule_of
from graphpass.runtime import mesh as mesh_lib
from graphpass.plan_builder import plan_from_strategy

SIZE = 2


class _Op(nn.Module):
    def __init__(self, fn, shapes, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fn = fn
        self.names = [f"in{i}" for i in range(len(shapes))]
        for name, shape in zip(self.names, shapes):
            self.register_buffer(name, torch.randn(shape, generator=g))

    def forward(self, x):
        out = self.fn(*(getattr(self, n) for n in self.names))
        out = out if isinstance(out, (tuple, list)) else (out,)
        return x.sum() + sum(o.sum() for o in out)  # a scalar loss for capture


def _cases():
    """(label, fn, input shapes, input placements on tp as dims or None)."""
    B, H, T, D = 2, 4, 6, 4
    out = []

    def add(label, fn, shapes, dims_options):
        for dims in dims_options:
            out.append((f"{label} {dims}", fn, shapes, dims))

    all_dims = lambda nd: [(d,) for d in range(nd)] + [(None,)]  # noqa: E731
    add("transpose", lambda a: a.transpose(1, 2), [(B, H, T, D)], all_dims(4))
    add("permute", lambda a: a.permute(0, 2, 1, 3), [(B, H, T, D)], all_dims(4))
    add("view merge", lambda a: a.reshape(B, H, T * D), [(B, H, T, D)], all_dims(4))
    add("view split", lambda a: a.view(B, T, H, D), [(B, T, H * D)], all_dims(3))
    # nn.MultiheadAttention's views: heads merged into the batch dim, and split off again.
    add("view merge batch heads", lambda a: a.view(T, B * H, D), [(T, B, H * D)], all_dims(3))
    add("view batch heads and back", lambda a: a.view(T, B * H, D).transpose(0, 1).view(B, H, T, D),
        [(T, B, H * D)], all_dims(3))
    add("view batch heads then sum", lambda a: a.view(T, B * H, D).sum(-1), [(T, B, H * D)], [(2,)])
    add("packed qkv", lambda a: list(a.unflatten(-1, (3, H * D)).unsqueeze(0).transpose(0, -2).squeeze(-2)
                                     .contiguous().unbind(0)), [(T, B, 3 * H * D)], [(0,), (1,), (None,)])
    add("unsqueeze", lambda a: a.unsqueeze(1), [(B, T, D)], all_dims(3))
    add("select", lambda a: a.select(1, 2), [(B, H, T)], all_dims(3))
    add("slice", lambda a: a[:, :, 1:3], [(B, H, T)], all_dims(3))
    add("chunk last", lambda a: a.chunk(3, dim=-1), [(B, T, H, 3 * D)], all_dims(4))
    add("split mid", lambda a: a.split([2, 4], dim=1), [(B, T, H)], all_dims(3))
    add("cat", lambda a, b: torch.cat([a, b], dim=2), [(B, H, T), (B, H, T)],
        [(1, 1), (0, 0), (2, 2), (1, None), (None, None)])
    add("sum", lambda a: a.sum(dim=-1), [(B, H, T)], all_dims(3))
    add("mean keepdim", lambda a: a.mean(dim=1, keepdim=True), [(B, H, T)], all_dims(3))
    add("amax", lambda a: a.amax(dim=-1), [(B, H, T)], all_dims(3))
    add("softmax", lambda a: a.softmax(dim=-1), [(B, H, T)], all_dims(3))
    add("gelu", lambda a: torch.nn.functional.gelu(a), [(B, T, H)], all_dims(3))
    add("type_as", lambda a, b: a.type_as(b), [(B, T, H), (H,)], [(d, None) for d in (0, 1, 2, None)])
    add("add broadcast", lambda a, b: a + b, [(B, H, T), (T,)], [(0, None), (1, None), (2, None), (2, 0), (None, 0)])
    add("mul broadcast", lambda a, b: a * b, [(B, H, T), (H, 1)], [(0, None), (1, None), (1, 0), (2, None), (None, 0)])
    add("where", lambda a, b: torch.where(a > 0, a, b), [(B, H, T), (B, H, T)], [(1, 1), (1, None), (None, 2)])
    add("matmul heads", lambda a, b: a @ b, [(B, H, T, D), (B, H, D, T)],
        [(1, 1), (2, None), (None, 3), (3, 2), (0, 0), (1, None), (None, None)])
    add("matmul broadcast", lambda a, b: a @ b, [(B, H, T, D), (D, T)], [(1, None), (2, None), (None, 1), (3, 0)])
    add("bmm", lambda a, b: torch.bmm(a, b), [(H, T, D), (H, D, T)], [(0, 0), (1, None), (None, 2), (2, 1)])
    add("expand", lambda a: a.expand(B, H, T), [(1, H, T)], [(1,), (2,), (None,)])
    add("flatten", lambda a: a.flatten(2), [(B, H, T, D)], all_dims(4))
    add("sdpa", lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        [(B, H, T, D)] * 3, [(1, 1, 1), (None, None, None), (2, 2, 2)])
    # GPT-2's Conv1D, addmm(bias, x, W[in, out]): column (W Shard(1), bias Shard(0)), row
    # (W Shard(0): mm, then the bias after the view back to [B, T, out]), replicated W with
    # batch-sharded x, and a sequence-sharded x merged into the rows by its view.
    conv1d = lambda b, x, w: torch.addmm(b, x.reshape(-1, H), w).view(B, T, D)  # noqa: E731
    add("conv1d", conv1d, [(D,), (B, T, H), (H, D)], [(0, None, 1), (None, 2, 0), (None, 0, None), (0, 1, 1),
                                                     (None, 1, None), (None, None, None)])
    add("addmm 2-d", lambda b, x, w: torch.addmm(b, x, w), [(D,), (T, H), (H, D)], [(0, None, 1), (None, 1, 0)])
    add("square", lambda a: a.square(), [(B, T, H)], all_dims(3))
    # The fused q/k/v of interleaved heads: heads sharded, each chunk still head-sharded.
    add("fused heads chunk", lambda a: a.view(B, T, H, 3 * D).chunk(3, dim=-1), [(B, T, H * 3 * D)], [(2,)])
    return out


def _placement_and_outputs(label_filter=None):
    """On each rank: {case label: (output placements, local outputs)} (or the error)."""
    rank = dist.get_rank()
    mesh = mesh_lib.ProcessMesh({"tp": SIZE})
    results = {}
    for seed, (label, fn, shapes, dims) in enumerate(_cases()):
        model = _Op(fn, shapes, seed)
        gm = capture(model, (torch.zeros(2),)).gm
        plan = plan_from_strategy(gm, gp.Strategy(tp=SIZE), [])
        node_of = {n.target: n.name for n in gm.graph.nodes if n.op == "get_attr"}
        for name, dim in zip(model.names, dims):
            placements = {**plan.tensor(node_of[name]).placements, "tp": Replicate() if dim is None else Shard(dim)}
            plan = plan.with_tensor(node_of[name], placements=placements)
        # The op's outputs are what the harness's loss sums (besides the dummy input), read after
        # the walk: a rule may route them through nodes it adds (a row projection's bias).
        sums = [n for n in gm.graph.nodes if n.op == "call_function"
                and n.target == torch.ops.aten.sum.default and n.args[0].op != "placeholder"]
        try:
            walker = Walker(gm, plan, SIZE, rank)
            walker.run()
            watched = [n.args[0] for n in sums]
            gm.recompile()
            places = [walker.place.get(n, Replicate()) for n in watched]
            seen: dict[fx.Node, torch.Tensor] = {}

            class _Watch(fx.Interpreter):
                def run_node(self, n):
                    value = super().run_node(n)
                    if n in watched:
                        seen[n] = value.detach().clone()
                    return value

            with mesh_lib.active(mesh):
                _Watch(gm).run(torch.zeros(2))
            results[label] = ([_spelled(p) for p in places], [seen[n] for n in watched])
        except Exception as exc:  # noqa: BLE001 - reported per case
            results[label] = f"{type(exc).__name__}: {exc}"
    return results


def _spelled(placement) -> str:
    if isinstance(placement, MergedShard):
        return f"MergedShard({placement.dim},{placement.outer})"
    return placement_to_str(placement)


def _rebuild_merged(locals_, dim: int, outer: int) -> torch.Tensor:
    """The global tensor of a MergedShard: each rank holds, per outer index, its inner chunk."""
    split = [t.unflatten(dim, (outer, t.shape[dim] // outer)) for t in locals_]
    return torch.cat(split, dim=dim + 1).flatten(dim, dim + 1)


def _global(label, fn, shapes, seed):
    model = _Op(fn, shapes, seed)
    out = fn(*(getattr(model, n) for n in model.names))
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.timeout(300)
def test_every_rule_places_its_output_as_the_op_computes_it(rank_pool):
    ranks = rank_pool(SIZE).run(_placement_and_outputs, timeout_s=240)
    failures = []
    for seed, (label, fn, shapes, dims) in enumerate(_cases()):
        per_rank = [r[label] for r in ranks]
        if isinstance(per_rank[0], str):
            failures.append(f"{label}: {per_rank[0]}")
            continue
        expected = _global(label, fn, shapes, seed)
        places = per_rank[0][0]
        if len(places) != len(expected):
            failures.append(f"{label}: {len(places)} outputs watched, op has {len(expected)}")
            continue
        for i, (place, want) in enumerate(zip(places, expected)):
            locals_ = [r[1][i] for r in per_rank]
            if place.startswith("MergedShard"):
                got = _rebuild_merged(locals_, *(int(v) for v in place[12:-1].split(",")))
            elif place.startswith("Shard"):
                got = torch.cat(locals_, dim=int(place[6:-1]))
            elif place.startswith("Partial"):
                got = sum(locals_)
            else:
                got = locals_[0]
                if not all(torch.equal(got, other) for other in locals_[1:]):
                    failures.append(f"{label} output {i}: Replicate() but the ranks differ")
                    continue
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                failures.append(f"{label} output {i}: claimed {place}, which does not rebuild the op's result")
    assert not failures, "\n".join(failures)


def test_keeps_shard_answers_what_each_rule_does():
    """The op-level problem asks ``keeps_shard`` where a sharded value stays sharded (it does not
    run the pass): on every case of one sharded operand whose op has a rule that can keep a
    shard, the answer is the placement the rule gives the op's output."""
    checked = []
    for seed, (label, fn, shapes, dims) in enumerate(_cases()):
        if dims[0] is None or any(d is not None for d in dims[1:]):
            continue
        model = _Op(fn, shapes, seed)
        gm = capture(model, (torch.zeros(2),)).gm
        source = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == model.names[0])
        op = next(u for u in source.users if u.op == "call_function")
        if KEEPS.get(rule_of(op.target)) is None:
            continue
        expected = keeps_shard(op, dims[0], source)
        plan = plan_from_strategy(gm, gp.Strategy(tp=SIZE), [])
        plan = plan.with_tensor(source.name, placements={**plan.tensor(source.name).placements, "tp": Shard(dims[0])})
        walker = Walker(gm, plan, SIZE, 0)
        walker.run()
        got = walker.place[op]
        assert got == Shard(expected) if expected is not None else not isinstance(got, Shard), (label, expected, got)
        checked.append(label)
    # elementwise, softmax, broadcasting, views, reductions: kept and gathered both seen
    assert len(checked) >= 40, checked
