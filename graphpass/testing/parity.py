"""assert_parity: a user's model trained under parallel strategies on local ranks equals one process.

For each world size and strategy, every rank builds the model with ``model_fn()``, compiles it
with the first of ``batch_fn()``'s global batches and trains ``steps`` steps; the same model and
batches train in this process. Compared: the loss of every step, every parameter's full gradient
after the first backward (put together from all ranks' pieces: ZeRO shards, tensor-parallel
chunks, experts, pipeline stages, by the layouts checkpoints use), and the full state after the
last optimizer step.

Tolerances (the defaults are graphpass's own tests'): a parallel program computes the same mean
loss as one process, but each rank reduces over its own share of the batch and the collectives
add the partial results in another order, so results differ by fp32 rounding (about 1e-7
relative). SGD with momentum keeps those differences at rounding level over a few steps; an
element passes when ``|got - ref| <= atol + rtol * |ref|`` with rtol 1e-5 and atol 1e-6, which
allows rounding and nothing more: a missing or doubled gradient average is off by 10% or more.
Adam divides by the root of the second moment and magnifies rounding where gradients are tiny:
use ``"adamw"`` with looser tolerances (rtol 1e-4, atol 1e-5) or keep the default optimizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from graphpass.plan import PREDICTIONS, Plan, Strategy

#: The optimizers ``assert_parity`` trains with, by name (a callable ``(params, lr) -> Optimizer``
#: is accepted too).
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "sgd-momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
}

RTOL, ATOL = 1e-5, 1e-6


class ParityError(AssertionError):
    """A strategy's training differs from one process beyond the tolerance."""


@dataclasses.dataclass(frozen=True)
class Trace:
    """What one training run produced: the loss of every step, the gradients after the first
    backward and the state after the last step (``state_dict`` keys)."""

    losses: list[float]
    grads: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    #: every rank's losses, by rank (a launched run; empty for the reference)
    rank_losses: list[list[float]] = dataclasses.field(default_factory=list)
    #: the keys of embedding tables the plan shards: their gradients are sparse and applied
    #: inside ``train_step``, never a dense ``.grad``, so only their state is compared
    sparse: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """The worst element of one compared quantity: ``excess`` is its error over the tolerance
    (``> 1`` fails)."""

    what: str
    excess: float
    error: float
    reference: float
    got: float
    index: tuple[int, ...] = ()

    def __str__(self) -> str:
        at = f" at {list(self.index)}" if self.index else ""
        return (f"{self.what}{at}: got {self.got:.8g}, one process {self.reference:.8g} "
                f"(error {self.error:.3g}, {self.excess:.3g}x the tolerance)")


@dataclasses.dataclass(frozen=True)
class ParityResult:
    """One strategy on one world size: its worst mismatch and whether it passed."""

    strategy: str
    world_size: int
    worst: Mismatch | None
    rtol: float
    atol: float

    @property
    def passed(self) -> bool:
        """True when every element is within the tolerance."""
        return self.worst is None or self.worst.excess <= 1.0

    def __str__(self) -> str:
        head = f"{self.strategy} on {self.world_size} ranks: {'ok' if self.passed else 'FAILED'}"
        return head if self.worst is None else f"{head}; worst {self.worst}"


def fit_strategy(strategy: Strategy | Plan | str, world_size: int) -> Strategy | Plan | str:
    """``strategy`` on ``world_size`` ranks: a Strategy's ``dp`` grows to fill the ranks its
    ``tp x pp`` (and given ``dp``) leave (``Strategy(tp=2)`` on 4 ranks is dp 2 x tp 2); a Plan
    must match exactly; ``"auto"`` plans for them.

    Raises:
        ValueError: the degrees do not divide ``world_size`` (or a Plan is for another size).
    """
    if isinstance(strategy, str):
        if strategy != "auto":
            raise ValueError(f"strategies entries must be graphpass.Strategy, Plan or 'auto', got {strategy!r}")
        return strategy
    if isinstance(strategy, Plan):
        if strategy.world_size != world_size:
            raise ValueError(f"a Plan for {strategy.world_size} ranks cannot run on {world_size}: give "
                             f"world_sizes=({strategy.world_size},) for it")
        return strategy
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategies entries must be graphpass.Strategy, Plan or 'auto', got {type(strategy).__name__}")
    if world_size % strategy.degree:
        raise ValueError(f"{strategy!r} uses {strategy.degree} ranks, which does not divide world size "
                         f"{world_size}: leave that world size out (world_sizes=...) or change the degrees")
    return dataclasses.replace(strategy, dp=strategy.dp * (world_size // strategy.degree))


def describe(strategy: Strategy | Plan | str) -> str:
    """A short name: ``dp2-tp2-zero3``, ``auto`` or ``plan-dp2xtp2-<digest>``."""
    if isinstance(strategy, str):
        return strategy
    if isinstance(strategy, Plan):  # the mesh, and a digest of the program so two plans never share a name
        digest = hashlib.sha1(json.dumps(_program_fields(strategy), sort_keys=True, default=str).encode()).hexdigest()
        return "plan-" + "x".join(f"{a}{n}" for a, n in strategy.mesh.items()) + "-" + digest[:8]
    defaults = Strategy()
    parts = []
    for f in dataclasses.fields(Strategy):
        value = getattr(strategy, f.name)
        if f.name in ("dp", "tp", "pp") or value != getattr(defaults, f.name):
            parts.append(f.name if value is True else f"{f.name}{value}")
    return "-".join(parts)


def _program_fields(plan: Plan) -> dict:
    return {k: v for k, v in plan.to_dict().items() if k not in PREDICTIONS}


def make_optimizer(optimizer: str | Callable, params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """The named optimizer (see :data:`OPTIMIZERS`) or ``optimizer(params, lr)``."""
    if callable(optimizer):
        return optimizer(params, lr)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZERS)} (or pass a callable "
                         "(params, lr) -> torch.optim.Optimizer)")
    return OPTIMIZERS[optimizer](params, lr)


def global_batches(batch_fn: Callable[[], Sequence], steps: int) -> list[tuple[torch.Tensor, ...]]:
    """``batch_fn()``'s first ``steps`` batches, each a tuple of tensors."""
    batches = list(batch_fn())
    if len(batches) < steps:
        raise ValueError(f"batch_fn() returned {len(batches)} batches; steps={steps} needs at least {steps}")
    out = []
    for i, batch in enumerate(batches[:steps]):
        batch = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
        if not batch or not all(isinstance(t, torch.Tensor) for t in batch):
            raise TypeError(f"batch_fn()[{i}] must be a tensor or a tuple of tensors (one global batch), got {batch!r}")
        out.append(batch)
    return out


def _device() -> torch.device:
    """This process's device: its current GPU under NCCL (the ranks' and the reference's), else the CPU."""
    import torch.distributed as dist

    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _on(device: torch.device, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in batch)


def train_reference(model_fn: Callable[[], nn.Module], batches: Sequence[tuple[torch.Tensor, ...]],
                    optimizer: str | Callable = "sgd-momentum", lr: float = 0.05,
                    device: str | torch.device = "cpu") -> Trace:
    """Train ``model_fn()`` on ``batches`` in this process (on ``device``), one global batch per
    step; the trace's tensors are on the CPU."""
    model = model_fn().to(device)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    losses, grads = [], {}
    for step, batch in enumerate(batches):
        loss = model(*_on(torch.device(device), batch))
        loss.backward()
        if step == 0:
            grads = {k: p.grad.detach().cpu().clone() for k, p in model.named_parameters() if p.grad is not None}
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return Trace(losses, grads, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()})


def full_grads(dmodel) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient under its ``state_dict`` key, put together on every rank
    from the pieces each rank holds (ZeRO shards, tp chunks, experts, pipeline stages) by the
    layouts checkpoints use; a collective over all ranks."""
    import torch.distributed as dist

    mine = []
    for layout, tensor in dmodel.checkpoint_state()[0]:
        if isinstance(tensor, nn.Parameter) and tensor.grad is not None:
            pieces = [(piece.offsets, view.detach().cpu().clone())
                      for piece, view in zip(layout.pieces, layout.views(tensor.grad))]
            mine.append((layout.key, layout.shape, pieces))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, torch.Tensor] = {}
    for held in everyone:
        for key, shape, pieces in held:
            full = out.setdefault(key, torch.zeros(shape, dtype=pieces[0][1].dtype if pieces else torch.float32))
            for offsets, piece in pieces:
                full[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))] = piece
    return out


def default_compile(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], strategy):
    """``gp.compile`` on the launched ranks' local cluster (the default ``compile_fn``)."""
    import graphpass as gp

    return gp.compile(model, gp.Cluster.local(), example_inputs=example_inputs, strategy=strategy)


#: This rank's capture store of the current ``assert_parity`` call, by call id (one entry).
_CAPTURES: dict[str, dict] = {}


def train_on_rank(model_fn: Callable[[], nn.Module], batch_fn: Callable[[], Sequence], strategy, steps: int,
                  optimizer: str | Callable, lr: float, compile_fn: Callable | None,
                  call_id: str | None = None) -> Trace | None:
    """Run on every rank of a launched job: compile and train as :func:`train_reference` does;
    rank 0 returns the trace (full gradients and state gathered from all ranks), others None.

    The strategies of one ``assert_parity`` call (one ``call_id``) compile through one
    ``graphpass.reusing_captures`` store: the model is traced once per local batch shape."""
    import torch.distributed as dist

    from graphpass.capture import reusing_captures

    if call_id not in _CAPTURES:  # a new call: the previous call's captures are released
        _CAPTURES.clear()
    store = _CAPTURES.setdefault(call_id, {}) if call_id is not None else {}
    device = _device()
    batches = [_on(device, batch) for batch in global_batches(batch_fn, steps)]
    with reusing_captures(store):
        dmodel = (compile_fn or default_compile)(model_fn().to(device), batches[0], strategy)
    opt = make_optimizer(optimizer, dmodel.parameters(), lr)
    losses, grads = [], {}
    for step, batch in enumerate(batches):
        losses.append(dmodel.train_step(*batch).item())
        if step == 0:
            grads = full_grads(dmodel)
        opt.step()
        opt.zero_grad()
    state = {k: v.detach().cpu().clone() for k, v in dmodel.full_state_dict().items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, losses)
    sparse = _sparse_keys(dmodel)
    return Trace(losses, grads, state, everyone, sparse) if dist.get_rank() == 0 else None


def _sparse_keys(dmodel) -> tuple[str, ...]:
    """The ``state_dict`` keys of the tables ``dmodel``'s plan shards (sparse gradients)."""
    step = dmodel.sparse_optimizer
    if step is None:
        return ()
    shards = {id(t) for t in step.shards.values()}
    return tuple(layout.key for layout, tensor in dmodel.checkpoint_state()[0] if id(tensor) in shards)


def _worst(what: str, got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> Mismatch:
    if got.shape != ref.shape:
        return Mismatch(f"{what} (shape {list(got.shape)}, one process {list(ref.shape)})", math.inf, math.inf,
                        math.nan, math.nan)
    if not (got.is_floating_point() or got.is_complex()):
        wrong = (got != ref).reshape(-1)
        if not wrong.any():
            return Mismatch(what, 0.0, 0.0, 0.0, 0.0)
        flat = int(wrong.nonzero()[0])
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ref.shape)) if ref.dim() else ()
        return Mismatch(what, math.inf, math.inf, float(ref.reshape(-1)[flat]), float(got.reshape(-1)[flat]), idx)
    got64, ref64 = got.detach().double(), ref.detach().double()
    error = (got64 - ref64).abs()
    excess = error / (atol + rtol * ref64.abs())
    # Equal values (infinities of one sign, exact zeros under atol 0) and NaN where one process
    # has NaN too agree; any other NaN (one side only) is an infinite mismatch.
    same = (got64 == ref64) | (torch.isnan(got64) & torch.isnan(ref64))
    excess = torch.where(same, torch.zeros_like(excess),
                         torch.where(torch.isnan(excess), torch.full_like(excess, math.inf), excess))
    if excess.numel() == 0:
        return Mismatch(what, 0.0, 0.0, 0.0, 0.0)
    flat = int(excess.reshape(-1).argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ref.shape)) if ref.dim() else ()
    return Mismatch(what, float(excess.reshape(-1)[flat]), float(error.reshape(-1)[flat]),
                    float(ref64.reshape(-1)[flat]), float(got64.reshape(-1)[flat]), idx)


def compare(trace: Trace, reference: Trace, rtol: float = RTOL, atol: float = ATOL) -> Mismatch | None:
    """The worst of every loss, first-step gradient and final state entry (None when there is
    nothing to compare); a missing entry is an infinite mismatch naming it."""
    found: list[Mismatch] = []
    for rank, losses in enumerate(trace.rank_losses or [trace.losses]):
        where = f" on rank {rank}" if trace.rank_losses else ""
        for step, (got, ref) in enumerate(zip(losses, reference.losses), start=1):
            found.append(_worst(f"loss of step {step}{where}", torch.tensor(got), torch.tensor(ref), rtol, atol))
    for key, ref in reference.grads.items():
        if key in trace.sparse:
            continue  # a sharded table's gradient is sparse, applied in train_step: its state is compared
        if key not in trace.grads:
            found.append(Mismatch(f"gradient of {key} (missing from the compiled program)", math.inf, math.inf,
                                  math.nan, math.nan))
        else:
            found.append(_worst(f"gradient of {key} after step 1", trace.grads[key], ref, rtol, atol))
    steps = len(reference.losses)
    for key, ref in reference.state.items():
        if key not in trace.state:
            found.append(Mismatch(f"{key} (missing from full_state_dict)", math.inf, math.inf, math.nan, math.nan))
        else:
            found.append(_worst(f"{key} after {steps} steps", trace.state[key], ref, rtol, atol))
    return max(found, key=lambda m: m.excess, default=None)


def _seeded_batches(model_fn: Callable[[], nn.Module], batch_fn: Callable[[], Sequence],
                    steps: int) -> list[tuple[torch.Tensor, ...]]:
    """The global batches, after checking that two calls of ``model_fn`` and of ``batch_fn``
    agree (every rank calls them itself)."""
    a, b = model_fn().state_dict(), model_fn().state_dict()
    for key, value in a.items():
        if not torch.equal(value, b[key]):
            raise ValueError(f"model_fn() built two different models ({key} differs): every rank and the "
                             "reference must start from the same weights; seed inside model_fn (torch.manual_seed)")
    batches = global_batches(batch_fn, steps)
    for step, (x, y) in enumerate(zip(batches, global_batches(batch_fn, steps))):
        if len(x) != len(y) or not all(torch.equal(s, t) for s, t in zip(x, y)):
            raise ValueError(f"batch_fn() returned a different batch {step} on a second call: every rank calls it "
                             "and must see the same global batches; draw them from a seeded torch.Generator")
    return batches


def assert_parity(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[], Sequence],
    strategies: Sequence[Strategy | Plan | str] = ("auto",),
    world_sizes: Sequence[int] = (2, 4),
    steps: int = 3,
    optimizer: str | Callable = "sgd-momentum",
    *,
    lr: float = 0.05,
    rtol: float = RTOL,
    atol: float = ATOL,
    ranks: Callable[[int], Any] | None = None,
    compile_fn: Callable | None = None,
    golden_dir: str | Path | None = None,
    timeout_s: float = 600.0,
    backend: str = "gloo",
) -> list[ParityResult]:
    """Train ``model_fn()`` under each strategy on each world size of local ranks and fail unless
    it trains as one process does (see the module docstring for what is compared and why these
    tolerances).

    Args:
        model_fn: builds the model, seeded (a module-level function: ranks import it by name).
        batch_fn: returns the global batches, one tensor or tuple of tensors per step (module-level).
        strategies: ``gp.Strategy`` (its ``dp`` grows to fill each world size), a ``gp.Plan`` for
            one world size, or ``"auto"`` (the planner's choice for the local ranks).
        world_sizes: local rank counts to run on.
        steps: optimizer steps.
        optimizer: ``"sgd-momentum"`` (default), ``"sgd"``, ``"adamw"`` or ``(params, lr) -> Optimizer``.
        ranks: ``world_size -> RankPool`` (the ``graphpass_ranks`` fixture) to reuse live ranks;
            default: ranks started and stopped for this call.
        compile_fn: ``(model, example_inputs, strategy) -> DistributedModule`` run on every rank
            (default ``gp.compile`` on ``Cluster.local()``); module-level.
        golden_dir: also check each Strategy's program against ``golden_dir/<strategy>-w<n>.txt``
            (:func:`graphpass.testing.golden.assert_golden`).
        timeout_s: limit of one strategy's run; every rank is killed after it.
        backend: ``"gloo"`` (CPU ranks on 127.0.0.1) or ``"nccl"`` (rank r on GPU r, the
            reference on GPU 0; TF32 left as the user set it: turn it off, or loosen the
            tolerances, where convolutions run in TF32).

    Returns:
        One :class:`ParityResult` per strategy and world size (all passed).

    Raises:
        ParityError: some strategy differs; the message lists each failure with its worst
            parameter, error and the tolerance.
        graphpass.testing.golden.GoldenMismatch: a program differs from its golden file.
    """
    from graphpass.capture import reusing_captures
    from graphpass.runtime.launch import RankPool
    from graphpass.testing.golden import assert_golden, program_text

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"assert_parity(backend={backend!r}): 'gloo' (CPU ranks) or 'nccl' (one local GPU per rank)")
    if backend == "nccl" and torch.cuda.device_count() < max(world_sizes):
        raise ValueError(f"assert_parity(backend='nccl', world_sizes={tuple(world_sizes)}) needs {max(world_sizes)} "
                         f"GPUs, this machine has {torch.cuda.device_count()}")
    if not strategies:
        raise ValueError("assert_parity: strategies is empty")
    if any(not isinstance(w, int) or w < 1 for w in world_sizes):
        raise ValueError(f"assert_parity: world_sizes must be positive ints, got {tuple(world_sizes)!r}")
    batches = _seeded_batches(model_fn, batch_fn, steps)
    for s in strategies:
        if isinstance(s, Plan) and s.world_size not in world_sizes:
            raise ValueError(f"assert_parity: a Plan for {s.world_size} ranks ({describe(s)}) is in strategies but "
                             f"world_sizes={tuple(world_sizes)} does not include {s.world_size}")
    runs = [(w, s, fit_strategy(s, w)) for w in world_sizes for s in strategies
            if not (isinstance(s, Plan) and s.world_size != w)]
    reference = train_reference(model_fn, batches, optimizer, lr, "cuda:0" if backend == "nccl" else "cpu")
    call_id = uuid.uuid4().hex
    results: list[ParityResult] = []
    owned: dict[int, RankPool] = {}
    try:
        for world_size, given, strategy in runs:
            pool = ranks(world_size) if ranks is not None else None
            if pool is None or pool.backend != backend:
                pool = owned.setdefault(world_size, RankPool(world_size, backend=backend))
            trace = pool.run(train_on_rank, model_fn, batch_fn, strategy, steps, optimizer, lr, compile_fn, call_id,
                             timeout_s=timeout_s)[0]
            results.append(ParityResult(describe(strategy), world_size, compare(trace, reference, rtol, atol),
                                        rtol, atol))
    finally:
        for pool in owned.values():
            pool.close()
    failed = [r for r in results if not r.passed]
    if failed:
        raise ParityError(
            f"{len(failed)} of {len(results)} runs differ from one process (an element passes when "
            f"|got - ref| <= atol + rtol * |ref|, rtol={rtol:g}, atol={atol:g}; see graphpass.testing.parity):\n"
            + "\n".join(f"  {r}" for r in failed))
    if golden_dir is not None:
        with reusing_captures():
            for world_size, _, strategy in runs:
                if isinstance(strategy, str):
                    continue  # "auto": the plan depends on the machine
                name = f"{describe(strategy)}-w{world_size}.txt"
                assert_golden(Path(golden_dir) / name, program_text(model_fn(), batches[0], strategy, world_size))
    return results
