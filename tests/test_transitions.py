"""The transition table is the contract between what the passes emit and what the planner
prices: every entry, emitted through ``graphpass.passes.collectives`` on a small graph and run
on 2 and 4 gloo ranks for a step of 2 microbatches, moves exactly the collectives and bytes
the entry says (counted at the ``torch.distributed`` calls the runtime makes), as often as it
says (per microbatch or per step), blocking or asynchronous as it says (the planner charges
each blocking one the link's synchronisation cost), and writes the bytes of local copies the
entry says in each phase (counted at the tensor ops the runtime dispatches).
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from graphpass import meta
from graphpass.compression import GradCompression, bucket_parts, replica_parts
from graphpass.layout import TensorLayout
from graphpass.passes import collectives as emit
from graphpass.runtime import collectives as ops
from graphpass.runtime import compressed_sync as compressed_runtime
from graphpass.runtime import embeddings as table_runtime
from graphpass.runtime import expert_parallel as ep_runtime
from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime import step as step_program
from graphpass.runtime import tensor_parallel as tp_runtime
from graphpass.runtime import zero as zero_runtime
from graphpass.runtime.grad_sync import Accumulation, accumulating
from graphpass.runtime.regather import rebuild_saved_tensors
from graphpass.transitions import PER_MICROBATCH, PER_STEP, TABLE, redistribution, transition

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------ the table


def test_the_table_covers_every_runtime_collective_op():
    assert {op.__name__ for op in ops.COLLECTIVE_OPS} == {e.op for e in TABLE.values()}


def test_lookup_by_op_and_its_options():
    assert transition("all_gather_params", stage=3) is TABLE["zero3 weights"]
    into_columns = TABLE["tp Shard -> Replicate into column linears"]
    assert [(m.phase, m.kind, m.size(10.0, 2), m.per) for m in into_columns.moves()] == [
        ("forward", "all_gather", 10.0, "microbatch"), ("backward", "all_gather", 10.0, "microbatch"),
        ("backward", "reduce_scatter", 10.0, "microbatch")]
    # HSDP's all-reduce across replicas moves this rank's reduced shard, and only where there are replicas
    zero3 = transition("all_gather_params", stage=3)
    assert [(m.kind, m.size(12.0, 4)) for m in zero3.moves(replicas=True)][-1] == ("all_reduce", 3.0)
    assert len(zero3.moves(replicas=True)) == len(zero3.moves()) + 1
    with pytest.raises(ValueError, match="unknown collective op"):
        transition("broadcast")
    with pytest.raises(ValueError, match="stage"):
        transition("all_gather_params")
    with pytest.raises(ValueError, match="carries out"):
        transition("tp_all_gather")  # two entries: found by placements instead


def test_lookup_by_placements():
    """The emitter, the op-level problem and the planner find a placement change here, by
    (axis, source, target, the gradient's placement where it differs from the target's)."""
    def names(*args):
        return [e.name for e in redistribution("tp", *args)]

    assert names(Shard(1), Replicate()) == names("Shard(0)", "Replicate()") == ["tp Shard -> Replicate"]
    assert names(Shard(2), Replicate(), Partial()) == ["tp Shard -> Replicate into column linears"]
    assert names(Replicate(), Replicate(), Partial()) == ["tp Replicate into sharded compute"]
    assert names(Partial(), Shard(0)) == ["tp Partial -> Shard"]
    assert names(Shard(1), Shard(0)) == ["tp Shard -> Replicate", "tp Replicate -> Shard"]
    assert names(Shard(1), Shard(1)) == names(Replicate(), Replicate()) == names(Replicate(), Replicate(), Replicate()) == []
    with pytest.raises(NotImplementedError, match="turns Replicate\\(\\) into Partial\\(\\)"):
        redistribution("tp", Replicate(), Partial())
    # every entry found this way is the one its key names
    for entry in TABLE.values():
        if entry.redistributes:
            assert redistribution(*entry.key) == (entry,)


def test_sizes_come_from_the_entry():
    """S follows from the tensor's shape and dtype in the entry: a whole tensor, or one float32
    per row for the vocabulary-parallel loss (its logits' last dimension reduced away)."""
    assert TABLE["tp Shard -> Replicate"].size_bytes((4, 6, 8), torch.bfloat16) == 4 * 6 * 8 * 2
    assert TABLE["tp vocabulary-parallel loss"].size_bytes((4, 6, 50257), torch.bfloat16) == 4 * 6 * 4
    assert TABLE["ep token counts"].size_bytes((16,), torch.int64) == 128
    zero3 = TABLE["zero3 weights"]
    assert [(m.kind, b) for m, b in zero3.movements(40.0, 4, replicas=True)] == [
        ("all_gather", 40.0), ("all_gather", 40.0), ("reduce_scatter", 40.0), ("all_reduce", 10.0)]
    assert [m.kind for m, _ in zero3.movements(40.0, 4, backward=False)] == ["all_gather"]


def test_no_collective_traffic_is_written_outside_the_table():
    """The kinds of collective appear as data in graphpass/transitions.py; outside it, the cost
    package names them only in the alpha-beta formulas and the profiler, never as an op's
    traffic (no "tp_copy ... all_reduce" pairs, no hand-priced ZeRO movements), and a movement's
    bytes come from its entry (``Transition.movements``), never a factor multiplied by hand."""
    pattern = re.compile(r'comms\.time\("dp", "(all_gather|reduce_scatter|all_reduce)"|\.factor\s*\*')
    offenders = []
    for path in [*ROOT.glob("cost/**/*.py"), *ROOT.glob("graphpass/**/*.py"), *ROOT.glob("passes/**/*.py")]:
        if path.name == "transitions.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) or re.search(r'op_traffic|OP_KIND', line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


# ------------------------------------------------------------------------------ on ranks


class _Copies(TorchDispatchMode):
    """Bytes written by the copy-like tensor ops that graphpass's runtime calls, per phase.

    Not counted: ops called from elsewhere (autograd's own accumulation of a leaf's gradient,
    which may clone it), copies inside a collective or its wait (``backend()``: gloo's
    reduce-scatter copies its result out when waited for, staging that the link's measured time
    covers) and 0-dim tensors (the step's token, the reported loss: bytes, not bandwidth)."""

    OPS = {"copy_", "cat", "stack", "clone", "_to_copy", "div", "mul_", "index_select", "index_copy_"}

    def __init__(self, phase: list):
        super().__init__()
        self.phase, self.written, self.inside = phase, {}, 0
        self.floats_only = False  # the row cache's index bookkeeping (int64) is not priced

    @contextlib.contextmanager
    def backend(self):
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (not self.inside and func.overloadpacket.__name__ in self.OPS and isinstance(out, torch.Tensor)
                and out.dim() and not (self.floats_only and not out.is_floating_point()) and _called_from(RUNTIME)):
            self.written[self.phase[0]] = self.written.get(self.phase[0], 0) + out.numel() * out.element_size()
        return out


RUNTIME = str(ROOT / "runtime")
_TORCH = str(pathlib.Path(torch.__file__).parent)


def _called_from(directory: str) -> bool:
    """Whether the innermost caller outside torch (and the counter) is code in ``directory``."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH)
                                 or frame.f_code is _Copies.__torch_dispatch__.__code__):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(directory)


class _Waited:
    """A collective's work whose ``wait()`` is the backend's (its copies are not counted)."""

    def __init__(self, work, copies: _Copies):
        self.work, self.copies = work, copies

    def wait(self):
        with self.copies.backend():
            return self.work.wait()

    def is_completed(self):
        return self.work.is_completed()


@contextlib.contextmanager
def _counting(log: list, phase: list, copies: _Copies):
    """Record (phase, kind, bytes of S, blocking) of every collective the runtime launches."""
    saved = (dist.all_reduce, zero_runtime._all_gather_flat, zero_runtime._reduce_scatter_flat,
             tp_runtime._all_gather_flat, tp_runtime._reduce_scatter_flat, ep_runtime._all_to_all,
             table_runtime._all_to_all, table_runtime._all_gather, compressed_runtime._all_to_all,
             compressed_runtime._all_gather_flat)
    real = {"all_reduce": dist.all_reduce, "all_gather": zero_runtime._all_gather_flat,
            "reduce_scatter": zero_runtime._reduce_scatter_flat, "all_to_all": ep_runtime._all_to_all,
            "table all_to_all": table_runtime._all_to_all, "table all_gather": table_runtime._all_gather,
            "compressed all_to_all": compressed_runtime._all_to_all,
            "compressed all_gather": compressed_runtime._all_gather_flat}

    def counted(kind: str, operand: int):
        def call(*args, **kwargs):
            tensor = args[operand]
            log.append((phase[0], kind.removeprefix("table ").removeprefix("compressed "),
                        tensor.numel() * tensor.element_size(),
                        not kwargs.get("async_op")))
            with copies.backend():
                work = real[kind](*args, **kwargs)
            return _Waited(work, copies) if work is not None else None
        return call

    # S is the all-gather's output and the reductions' input; what an all-to-all sends.
    dist.all_reduce = counted("all_reduce", 0)
    ep_runtime._all_to_all = counted("all_to_all", 1)
    table_runtime._all_to_all = counted("table all_to_all", 1)
    table_runtime._all_gather = counted("table all_gather", 1)
    compressed_runtime._all_to_all = counted("compressed all_to_all", 1)
    compressed_runtime._all_gather_flat = counted("compressed all_gather", 0)
    zero_runtime._all_gather_flat = tp_runtime._all_gather_flat = counted("all_gather", 0)
    zero_runtime._reduce_scatter_flat = tp_runtime._reduce_scatter_flat = counted("reduce_scatter", 1)
    try:
        yield
    finally:
        (dist.all_reduce, zero_runtime._all_gather_flat, zero_runtime._reduce_scatter_flat,
         tp_runtime._all_gather_flat, tp_runtime._reduce_scatter_flat, ep_runtime._all_to_all,
         table_runtime._all_to_all, table_runtime._all_gather, compressed_runtime._all_to_all,
         compressed_runtime._all_gather_flat) = saved


def _graph(n: int, local: tuple[int, ...]) -> tuple[fx.GraphModule, fx.Node, fx.Node, fx.Node]:
    """``loss = sum(x * w * v)``: a placeholder x (requires grad), parameters w and v of x's
    shape (two, so that a ZeRO group or a bucket holds more than one tensor)."""
    root = nn.Module()
    root.w = nn.Parameter(torch.randn(local))
    root.v = nn.Parameter(torch.randn(local))
    graph = fx.Graph()
    x = graph.placeholder("x")
    w = graph.get_attr("w")
    v = graph.get_attr("v")
    prod = graph.call_function(torch.ops.aten.mul.Tensor, (x, w))
    scaled = graph.call_function(torch.ops.aten.mul.Tensor, (prod, v))
    loss = graph.call_function(torch.ops.aten.sum.default, (scaled,))
    out = graph.output((loss,))
    for param, value in ((w, root.w), (v, root.v)):
        param.meta.update({meta.ATTR_KIND: "parameter", meta.VAL: value.detach(), meta.LAYER: 0})
    for node in (x, prod, scaled, loss):
        node.meta[meta.LAYER] = 0
    out.meta[meta.ROLE] = {"loss": 0}
    return fx.GraphModule(root, graph), x, prod, loss


def _emit(name: str, gm: fx.GraphModule, x: fx.Node, prod: fx.Node, loss: fx.Node, n: int, axis: str,
          replicate: str | None = None) -> float:
    """Insert the entry's op into ``gm``; return S, the entry's full-tensor bytes."""
    params = [node for node in gm.graph.nodes if node.op == "get_attr"]
    local_bytes = sum(p.numel() * p.element_size() for p in gm.parameters())
    entry = TABLE[name]
    if name == "dp gradient bucket":
        emit.emit_grad_all_reduce(gm, params, axis, 2**30, "test")
        return local_bytes
    if name.startswith("dp gradient bucket "):  # compressed: S in the entry's parts
        compression = GradCompression(name.split()[-1], rank=2)
        emit.emit_grad_all_reduce(gm, params, axis, 2**30, "test", compression=compression)
        return bucket_parts(compression, [tuple(p.shape) for p in gm.parameters()], n)
    if name == "dp reported loss":
        node = emit.emit_all_reduce(gm, loss, axis, "avg", "test")
        out = gm.graph.find_nodes(op="output")[0]
        out.args = ((loss, node),)
        return 4.0
    if name == "dp step":
        emit.ensure_grad_sync(gm, axis, "test")
        return 0.0
    if entry.op == "all_gather_params":
        compressed = name == "zero replicas int8"  # ZeRO-2 with this hop across the replicas
        stage = 2 if compressed else int(name[4])
        for node in params:
            full = getattr(gm, node.target).detach()
            setattr(gm, node.target, nn.Parameter(zero_runtime.make_shard(full, n, dist.get_rank() % n)))
            node.meta[meta.LAYOUT] = TensorLayout.whole(full.shape).with_zero(axis, n, stage)
        emit.emit_param_all_gather(gm, params, axis, stage, 2**30, "test",
                                   divisor=dist.get_world_size() if replicate else None, replicate=replicate,
                                   compression="int8" if compressed else None)
        if compressed:  # the reduced shard of the group across dp / n replicas
            shard_numel = sum(p.numel() for p in gm.parameters())
            return local_bytes, replica_parts(shard_numel, dist.get_world_size() // n)
        return local_bytes
    x_bytes = 4 * 8 * 12  # x is [8, 12] float32 locally, see _run_entry
    if name == "tp vocabulary-parallel loss":
        raise AssertionError("handled by _run_vocab")
    src, dst, grad, full = {
        "tp Shard -> Replicate": (Shard(1), Replicate(), None, n * x_bytes),
        "tp Shard -> Replicate into column linears": (Shard(1), Replicate(), Partial(), n * x_bytes),
        "tp Partial -> Replicate": (Partial(), Replicate(), None, x_bytes),
        "tp Partial -> Shard": (Partial(), Shard(1), None, x_bytes),
        "tp Replicate -> Shard": (Replicate(), Shard(1), None, x_bytes),
        "tp Replicate into sharded compute": (Replicate(), Replicate(), Partial(), x_bytes),
    }[name]
    new = emit.emit_tp_redistribute(gm, x, src, dst, axis, n, before=prod, grad=grad, created_by="test")
    prod.replace_input_with(x, new)
    return full


def _w_shape(name: str, n: int) -> tuple[int, ...]:
    """The parameter's local shape: what x * w needs after the entry's op changes x."""
    if name in ("tp Shard -> Replicate", "tp Shard -> Replicate into column linears"):
        return (8, 12 * n)
    if name in ("tp Partial -> Shard", "tp Replicate -> Shard"):
        return (8, 12 // n)
    return (8, 12)


def _expected_copies(name: str, size: float, n: int, microbatches: int) -> dict[str, float]:
    """Bytes the entry's local copies write per phase in one step."""
    out: dict[str, float] = {}
    for phase, nbytes, per in TABLE[name].copied(size, n):
        out[phase] = out.get(phase, 0.0) + nbytes * (microbatches if per == PER_MICROBATCH else 1)
    return {phase: nbytes for phase, nbytes in out.items() if nbytes}


def _run_entry(name: str, hsdp: bool = False) -> tuple[tuple, tuple]:
    """On each rank: (expected, counted) movements and copies of one step of 2 microbatches;
    ``hsdp``: a ZeRO entry sharded over pairs of ranks, replicated across the pairs."""
    n = dist.get_world_size()
    axis = TABLE[name].axis
    if axis == "ep":
        return _run_expert_exchange(name, n)
    if name.startswith("table "):
        return _run_table_lookup(name, n)
    mesh = mesh_lib.ProcessMesh({"dp": n, "dp_shard": n // 2} if hsdp else {axis: n})
    torch.manual_seed(0)
    if name == "tp vocabulary-parallel loss":
        return _run_vocab(mesh, n)
    shards, replicas = (n // 2, True) if hsdp else (n, False)
    gm, x, prod, loss = _graph(n, _w_shape(name, n))
    size = _emit(name, gm, x, prod, loss, shards, "dp_shard" if hsdp else axis, "dp_replicate" if hsdp else None)
    gm.graph.lint()
    gm.recompile()
    ran = _step(gm, mesh)
    if name == "zero replicas int8":  # ZeRO-2 inside the pairs, this entry's hop across them
        return _replica_hop(name, size, shards), ran
    expected = []
    for move in TABLE[name].moves(replicas=replicas):
        expected += [(move.phase, move.kind, move.size(size, shards), move.blocking)] * (1 if move.per == PER_STEP else 2)
    return (sorted(expected), _expected_copies(name, size, shards, 2)), ran


def _step(gm: fx.GraphModule, mesh) -> tuple[list, dict[str, float]]:
    """One step of 2 microbatches of ``gm`` on ``mesh``: the collectives it launched and the
    bytes its copies wrote per phase."""
    log, phase = [], ["forward"]
    accumulation = Accumulation(2)
    inputs = [torch.randn(8, 12, requires_grad=True) for _ in range(2)]
    copies = _Copies(phase)
    # As in train_step: reported values are all-reduced asynchronously, finished at the step's end.
    with mesh_lib.active(mesh), _counting(log, phase, copies), step_program._deferring_reports(), copies:
        for i in range(2):
            accumulation.last_backward = False
            phase[0] = "forward"
            with accumulating(accumulation), rebuild_saved_tensors():
                outputs = gm(inputs[i])
            accumulation.last_backward = i == 1
            phase[0] = "backward"
            outputs[0].backward()
    return sorted((p, k, float(b), w) for p, k, b, w in log), {p: float(b) for p, b in copies.written.items()}


def _replica_hop(name: str, size: tuple, shards: int) -> tuple[list, dict[str, float]]:
    """What ZeRO-2 over pairs with the hop across them in int8 moves and copies in a step of 2
    microbatches: "zero2 weights" without replicas, and this entry on this rank's shard
    (``size``: the tensor's bytes, this entry's parts)."""
    tensor, parts = size
    expected = []
    for entry, replicas, s in ((TABLE["zero2 weights"], False, tensor), (TABLE[name], True, parts)):
        for move in entry.moves(replicas=replicas):
            expected += [(move.phase, move.kind, move.size(s, shards), move.blocking)] * (1 if move.per == PER_STEP else 2)
    want = _expected_copies("zero2 weights", tensor, shards, 2)
    for phase_name, nbytes in _expected_copies(name, parts, shards, 2).items():
        want[phase_name] = want.get(phase_name, 0.0) + nbytes
    return sorted(expected), want


def _run_vocab(mesh, n: int) -> tuple[tuple, tuple]:
    tokens = 8
    logits = torch.randn(tokens, 5, requires_grad=True)
    target = torch.randint(0, 5 * n, (tokens,))
    log, phase = [], ["forward"]
    copies = _Copies(phase)
    with mesh_lib.active(mesh), _counting(log, phase, copies):
        with copies:
            loss = ops.vocab_parallel_cross_entropy(logits, target, "tp", n, 5 * dist.get_rank())
        phase[0] = "backward"
        loss.backward()  # in place in the saved exponentials: the loss's own compute, not copies
    expected = [(m.phase, m.kind, m.size(4.0 * tokens, n), m.blocking)
                for m in TABLE["tp vocabulary-parallel loss"].moves()]
    return ((sorted(expected), _expected_copies("tp vocabulary-parallel loss", 4.0 * tokens, n, 1)),
            (sorted((p, k, float(b), w) for p, k, b, w in log), {p: float(b) for p, b in copies.written.items()}))


def _run_expert_exchange(name: str, n: int) -> tuple[tuple, tuple]:
    """One entry of the experts' exchange, alone: 2 experts per rank, every rank routing 3 rows
    to each expert (balanced, so a rank receives as many rows as it sends: S either way) and one
    row past the last offset (dropped: it stays home)."""
    experts, d = 2 * n, 5
    offs = torch.arange(1, experts + 1) * 3
    rows = torch.randn(3 * experts + 1, d, requires_grad=True)
    log, phase = [], ["forward"]
    copies = _Copies(phase)
    mesh = mesh_lib.ProcessMesh({"dp": n, "ep": n})
    with mesh_lib.active(mesh):
        splits = ops.ep_counts(offs, "ep", n)
    with mesh_lib.active(mesh), _counting(log, phase, copies):
        with copies:
            if name == "ep token counts":
                out = ops.ep_counts(offs, "ep", n).sum().float().requires_grad_()
            elif name == "ep dispatch":
                out = ops.ep_dispatch(rows, splits, "ep")[0]
            else:
                out = ops.ep_combine(rows[:-1], splits, rows.shape[0], "ep")
        phase[0] = "backward"
        with copies:
            (out * 2).sum().backward()
    size = 8.0 * experts if name == "ep token counts" else 4.0 * 3 * experts * d
    expected = [(m.phase, m.kind, m.size(size, n), m.blocking) for m in TABLE[name].moves()]
    return ((sorted(expected), _expected_copies(name, size, n, 1)),
            (sorted((p, k, float(b), w) for p, k, b, w in log), {p: float(b) for p, b in copies.written.items()}))


def _run_table_lookup(name: str, n: int) -> tuple[tuple, tuple]:
    """One entry of a sharded table's lookup, alone: a row-wise table of ``n`` rows of 5 per
    rank, every rank sending one id to each rank in 3 bags (balanced: a rank receives as many
    ids as it sends, and returns as many pooled rows as it gets); the replicated table's
    backward gathers every rank's ids and row gradients."""
    rows, d, bags = 5 * n, 6, 3
    ids = torch.arange(n) * 5 + dist.get_rank() % 5
    offsets = torch.tensor([0, 1, 2])[:bags] if n >= 3 else torch.tensor([0, 1, 1])
    sharding = "data_parallel" if name == "table replicated gradients" else "row_wise"
    shard = nn.Parameter(torch.randn(rows if sharding == "data_parallel" else 5, d))
    log, phase = [], ["forward"]
    copies = _Copies(phase)
    copies.floats_only = name == "table cached rows"  # the entry's note: its int64 bookkeeping is not priced
    mesh = mesh_lib.ProcessMesh({"dp": n})
    spec = (sharding, rows, d, 0, "sum", False, None, 0)
    with mesh_lib.active(mesh):
        counts = ops.table_counts([ids], [offsets], (spec,), "dp", n)
        routed = None if sharding == "data_parallel" else ops.table_dispatch([ids], [offsets], [None], counts, (spec,),
                                                                             "dp")
    with mesh_lib.active(mesh), _counting(log, phase, copies):
        with copies:
            if name == "table counts":
                out = ops.table_counts([ids], [offsets], (spec,), "dp", n).sum().float().requires_grad_()
            elif name == "table ids":
                out = ops.table_dispatch([ids], [offsets], [None], counts, (spec,), "dp").sum().float()
                out = out.requires_grad_()
            elif name == "table pooled":
                out = ops.table_combine([shard], routed, counts, [ids], [offsets], (spec,), "dp", 0.5)[0]
            elif name == "table cached rows":  # nothing cached yet: the n - 1 other ranks' rows pulled
                out = ops.table_cached([shard], [ids], [offsets], [None], (spec,), ((3, 0),), "dp", 0.5)[0]
            else:
                out = ops.table_replicated([shard], [ids], [offsets], [None], counts, (spec,), "dp", 0.5)[0]
        phase[0] = "backward"
        with copies:
            (out * 2).sum().backward()
    size = {"table counts": 16.0 * n, "table ids": 16.0 * n, "table pooled": 4.0 * bags * d * n,
            "table replicated gradients": 4.0 * n * (2 + d), "table cached rows": 4.0 * d * (n - 1)}[name]
    expected = [(m.phase, m.kind, m.size(size, n), m.blocking) for m in TABLE[name].moves()]
    if name == "table cached rows":  # the pull's requests ahead of the rows (the entry's note)
        expected += [("forward", "all_to_all", 8.0 * n, True), ("forward", "all_to_all", 8.0 * (n - 1), True)]
    return ((sorted(expected), _expected_copies(name, size, n, 1)),
            (sorted((p, k, float(b), w) for p, k, b, w in log), {p: float(b) for p, b in copies.written.items()}))


def _run_all() -> dict:
    # "zero replicas int8" is HSDP's hop across replicas: on 4 ranks only, where there are some
    out = {name: _run_entry(name) for name in TABLE if name != "zero replicas int8"}
    if dist.get_world_size() >= 4:  # HSDP: ZeRO inside pairs, all-reduced across them
        out.update((f"{name} under HSDP", _run_entry(name, hsdp=True)) for name in TABLE
                   if TABLE[name].op == "all_gather_params")
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_entry_moves_and_copies_the_bytes_the_cost_model_prices(rank_pool, world_size):
    for rank, results in enumerate(rank_pool(world_size).run(_run_all, timeout_s=240)):
        wrong = {name: got for name, got in results.items() if got[0] != got[1]}
        assert not wrong, "\n".join(f"rank {rank} {name}: table {e} ran {c}" for name, (e, c) in wrong.items())
