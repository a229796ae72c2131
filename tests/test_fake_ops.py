"""Fake and real agree: every runtime collective op, run for real on 2 gloo ranks and under
``FakeTensorMode`` on the same inputs, returns the same shapes, dtypes and strides; so does its
one-rank stand-in (``ALONE``, what the planner runs when it times a rank's program in one
process), whose result must also carry the gradient back to the op's input.

The pass runner verifies graphs on fake tensors, so an op whose real result has other strides
(a ``movedim`` view where the fake op returns a contiguous tensor) passes verification and then
fails at run time in a later ``view`` — the bug this test exists for. It enumerates
``COLLECTIVE_OPS``, so a new op without a case here fails it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from graphpass.runtime import collectives as ops
from graphpass.runtime import mesh as mesh_lib
from graphpass.runtime.tensor_parallel import ALONE


def _cases():
    """(op, args builder) pairs; a builder gets ``t(shape)`` (a fresh tensor) and the sync."""
    out = []
    for shape, dim in (((4, 6), 0), ((4, 6), 1), ((2, 4, 6), 1), ((2, 4, 6), 2), ((2, 3, 4, 6), 2)):
        out.append((ops.tp_all_gather, lambda t, s, shape=shape, dim=dim: ((t(shape), "tp", 2, dim), {})))
        out.append((ops.tp_all_gather, lambda t, s, shape=shape, dim=dim: ((t(shape), "tp", 2, dim), {"grad": "reduce_scatter"})))
        out.append((ops.tp_reduce_scatter, lambda t, s, shape=shape, dim=dim: ((t(shape), "tp", 2, dim), {})))
        out.append((ops.tp_scatter, lambda t, s, shape=shape, dim=dim: ((t(shape), "tp", 2, dim), {})))
    # A transposed (non-contiguous) input: the ops must not pass its strides through.
    out.append((ops.tp_all_gather, lambda t, s: ((t((6, 4)).t(), "tp", 2, 1), {})))
    out.append((ops.tp_reduce_scatter, lambda t, s: ((t((6, 4)).t(), "tp", 2, 0), {})))
    out.append((ops.tp_copy, lambda t, s: ((t((2, 4, 6)), "tp", 2), {})))
    out.append((ops.tp_all_reduce, lambda t, s: ((t((2, 4, 6)), "tp", 2), {})))
    out.append((ops.tp_all_reduce, lambda t, s: ((t((6, 4)).t(), "tp", 2), {})))
    out.append((ops.vocab_parallel_cross_entropy,
                lambda t, s: ((t((8, 5)), torch.tensor([0, 1, 9, 3, 4, 5, 6, 7]), "tp", 2, 5 * dist.get_rank()), {})))
    out.append((ops.all_reduce, lambda t, s: ((t((3,)), "tp"), {"op": "avg"})))
    out.append((ops.all_reduce_grads, lambda t, s: ((s, t((4, 3)), t((3,))), {"bucket": 0})))
    out.append((ops.all_reduce_grads_int8, lambda t, s: ((s, t((4, 3)), t((3,))), {"bucket": 0})))
    out.append((ops.all_reduce_grads_powersgd, lambda t, s: ((s, t((8, 6)), t((3,))), {"bucket": 0, "rank": 2})))
    out.append((ops.all_gather_params,
                lambda t, s: ((s, t((3, 4)), t((2,))), {"axis": "tp", "shapes": ((5, 4), (3,)), "stage": 3})))
    out.append((ops.all_gather_params,
                lambda t, s: ((s, t((3, 4))), {"axis": "tp", "shapes": ((6, 4),), "stage": 1})))
    return out


def _expert_cases():
    """The experts' exchange on a dp 2 x ep 2 mesh, 4 experts, every rank routing 3 rows to each
    (balanced: the real ops receive as many rows as they send, the fake ops' expectation)."""
    offs = torch.arange(1, 5) * 3
    splits = lambda: ops.ep_counts(offs, "ep", 2)  # noqa: E731
    return [(ops.ep_counts, lambda t, s: ((offs, "ep", 2), {})),
            (ops.ep_dispatch, lambda t, s: ((t((12, 5)), splits(), "ep"), {})),
            (ops.ep_combine, lambda t, s: ((t((12, 5)), splits(), 12, "ep"), {}))]


def _table_cases():
    """A row-wise table of 10 rows (5 a rank), cached or not, and a replicated one on dp 2, every
    rank sending one id to each rank (balanced: the fake ops' expectation)."""
    rank = dist.get_rank()
    ids, offsets = torch.tensor([rank, 5 + rank]), torch.tensor([0, 1])
    rows = ("row_wise", 10, 4, 0, "sum", False, None, 0)
    whole = ("data_parallel", 10, 4, 0, "mean", False, None, 0)
    counts = lambda spec: ops.table_counts([ids], [offsets], (spec,), "dp", 2)  # noqa: E731
    routed = lambda: ops.table_dispatch([ids], [offsets], [None], counts(rows), (rows,), "dp")  # noqa: E731
    return [(ops.table_counts, lambda t, s: (([ids], [offsets], (rows,), "dp", 2), {})),
            (ops.table_dispatch, lambda t, s: (([ids], [offsets], [None], counts(rows), (rows,), "dp"), {})),
            (ops.table_combine,
             lambda t, s: (([t((5, 4))], routed(), counts(rows), [ids], [offsets], (rows,), "dp", 0.5), {})),
            (ops.table_replicated,
             lambda t, s: (([t((10, 4))], [ids], [offsets], [None], counts(whole), (whole,), "dp", 0.5), {})),
            (ops.table_cached,  # with a cache of 3 rows, exact
             lambda t, s: (([t((5, 4))], [ids], [offsets], [None], (rows,), ((3, 0),), "dp", 0.5), {}))]


def _signature(value):
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return [_signature(v) for v in value]
    return (tuple(value.shape), value.dtype, tuple(value.stride()))


def _compare_fake_and_real() -> list[str]:
    torch.manual_seed(dist.get_rank())
    covered, mismatches = set(), []
    for mesh, cases in ((mesh_lib.ProcessMesh({"tp": 2}), _cases()),
                        (mesh_lib.ProcessMesh({"dp": 2, "ep": 2}), _expert_cases()),
                        (mesh_lib.ProcessMesh({"dp": 2}), _table_cases())):
        _compare(mesh, cases, covered, mismatches)
    missing = [op.__name__ for op in ops.COLLECTIVE_OPS if op not in covered and op is not ops.grad_sync_begin]
    unmatched = [op.__name__ for op in ops.TP_OPS if op not in ALONE]
    return (mismatches + [f"no case for {name}" for name in missing]
            + [f"no stand-in in ALONE for {name}" for name in unmatched])


def _compare(mesh, cases, covered: set, mismatches: list) -> None:
    with mesh_lib.active(mesh):
        for op, build in cases:
            covered.add(op)
            sync = ops.grad_sync_begin(next(iter(mesh.axes)))
            real_args, kwargs = build(lambda shape: torch.randn(shape, requires_grad=True), sync)
            real = op(*real_args, **kwargs)
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                def faked(a):
                    if isinstance(a, list):  # a group of lookups' tensors
                        return [faked(x) for x in a]
                    return mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                fake_args = tuple(faked(a) for a in real_args)
                fake = op(*fake_args, **kwargs)
            where = f"{op.__name__}{kwargs} on {[_signature(a) for a in real_args if isinstance(a, (torch.Tensor, list))]}"
            if _signature(real) != _signature(fake):
                mismatches.append(f"{where}: real {_signature(real)} fake {_signature(fake)}")
            if op in ALONE:
                alone = ALONE[op](*real_args, **kwargs)
                if _signature(alone) != _signature(real):
                    mismatches.append(f"{where}: real {_signature(real)} alone {_signature(alone)}")
                (grad,) = torch.autograd.grad(alone.float().sum(), real_args[0])
                if grad.shape != real_args[0].shape:
                    mismatches.append(f"{where}: alone's gradient {tuple(grad.shape)}")


@pytest.mark.timeout(120)
def test_every_runtime_op_returns_what_its_fake_version_does(rank_pool):
    for rank, mismatches in enumerate(rank_pool(2).run(_compare_fake_and_real, timeout_s=60)):
        assert not mismatches, f"rank {rank}:\n" + "\n".join(mismatches)
