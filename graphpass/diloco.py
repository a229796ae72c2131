"""DiLoCo (Douillard et al. 2023): data-parallel workers that synchronise every ``H`` steps.

Each data-parallel rank is a worker: its gradients stay its own (no all-reduce in the step), and
the user's optimizer steps its copy of the parameters on its share of the batch. After every
``H`` train steps (the *inner* steps; one optimizer step each), the workers average how far they
moved and take one *outer* step from where they all started::

    Delta <- theta_0 - mean_workers(theta_w)                  (the outer gradient: one all-reduce)
    theta_0 <- Nesterov SGD step of theta_0 with gradient Delta  (outer lr ~0.7, momentum 0.9)
    theta_w <- theta_0 on every worker

so a step moves ``1 / H`` of the bytes of synchronous data parallelism, and nothing in the other
steps: ``train_step`` then returns the worker's own loss (on its share), not the global batch's
mean, which would cost a collective a step. It is not one process's
training (the workers drift apart between outer steps): the planner never picks it unless told
it may, and ``explain()`` says so.

Under HSDP (``Strategy(dp=, dp_shard=, zero=1..3, diloco=)``) a worker is a shard group instead of
a rank (:func:`worker_axis`), as INTELLECT-1 ran FSDP inside each site and DiLoCo across: inside
it the gradients are reduce-scattered every step (ZeRO, exact, over the site's fast links), the
hop across the replicas is dropped, and the outer step averages each rank's shard over
``dp_replicate`` (:func:`outer_axis`), the axis that crosses the slow link; ``train_step``
reports the worker's loss (its group's mean). The runtime is :mod:`graphpass.runtime.diloco`; the outer
step is torch's own ``SGD(nesterov=True)`` on the shared copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from graphpass.compression import beyond_plain_data_parallel
from graphpass.mesh import DP_REPLICATE, DP_SHARD


@dataclass(frozen=True)
class DiLoCo:
    """A plan's DiLoCo synchronisation (module docstring).

    Attributes:
        inner_steps: ``H``, the train steps (each followed by the user's optimizer step) between
            two outer steps.
        outer_lr: the outer step's learning rate (DiLoCo's 0.7).
        outer_momentum: its Nesterov momentum (DiLoCo's 0.9).
    """

    inner_steps: int
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ValueError(f"DiLoCo.inner_steps must be a positive int, got {self.inner_steps!r}")
        for name in ("outer_lr", "outer_momentum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"DiLoCo.{name} must be a number >= 0, got {value!r}")
        if self.outer_momentum >= 1:
            raise ValueError(f"DiLoCo.outer_momentum must be below 1, got {self.outer_momentum!r}")

    def to_json(self) -> dict[str, Any]:
        return {"inner_steps": self.inner_steps, "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum}

    @classmethod
    def from_json(cls, data: Any) -> DiLoCo:
        if not isinstance(data, Mapping) or "inner_steps" not in data or set(data) - {
                "inner_steps", "outer_lr", "outer_momentum"}:
            raise ValueError(f"Plan.diloco must be an object with inner_steps (and outer_lr, outer_momentum), got {data!r}")
        return cls(**data)

    def __str__(self) -> str:
        return (f"DiLoCo: an outer Nesterov step (lr {self.outer_lr:g}, momentum {self.outer_momentum:g}) every "
                f"{self.inner_steps} inner steps")


def worker_axis(mesh: Any) -> str | None:
    """The mesh axis of one DiLoCo worker's ranks: HSDP's ``dp_shard`` (a worker is a shard
    group, synchronous inside), or None where every dp rank is a worker."""
    return DP_SHARD if DP_SHARD in mesh and mesh.size(DP_REPLICATE) > 1 else None


def step_axis(mesh: Any, diloco: DiLoCo | None) -> str | None:
    """The axis each step averages gradients and reports the loss over: all of ``dp`` without
    DiLoCo; under it a worker's ranks (:func:`worker_axis`), or None where a worker is one rank."""
    return "dp" if diloco is None else worker_axis(mesh)


def outer_axis(mesh: Any) -> str:
    """The mesh axis DiLoCo's outer step averages over: across the workers."""
    return DP_REPLICATE if worker_axis(mesh) else "dp"


def check_strategy(strategy: Any) -> None:
    """A Strategy's ``diloco``: a :class:`DiLoCo` on plain data parallelism, or on HSDP (its
    shard groups the workers)."""
    diloco = strategy.diloco
    if diloco is None:
        return
    if not isinstance(diloco, DiLoCo):
        raise ValueError(f"Strategy.diloco must be a graphpass.DiLoCo or None, got {diloco!r}")
    if strategy.pp > 1:
        raise ValueError(f"Strategy.diloco with pp={strategy.pp}: DiLoCo's workers each train a whole model between "
                         "outer steps, and a pipeline's stages are one model split over ranks; use pp=1 with diloco")
    # under HSDP the workers are shard groups (zero > 0 inside each)
    unsupported = beyond_plain_data_parallel(strategy, also=("grad_compression",), hsdp=strategy.dp_shard is not None)
    if unsupported:
        raise NotImplementedError(
            f"Strategy.diloco={diloco!r} runs each data-parallel rank (or HSDP's shard group, with dp_shard=) as a "
            f"worker; with {', '.join(unsupported)} it is not built yet"
            + (" (ZeRO over all of dp leaves no worker a whole model: give dp_shard= too, each shard group a worker)"
               if any(field.startswith("zero=") for field in unsupported) else " (drop those, or diloco)"))


__all__ = ["DiLoCo", "check_strategy", "outer_axis", "step_axis", "worker_axis"]
