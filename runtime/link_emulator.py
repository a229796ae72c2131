"""An emulated wide-area link between sites that are ranks of one machine.

gloo over loopback is fast, so sites joined by a slow link (:mod:`graphpass.sites`) can only be
measured here by emulation: a cluster from ``Cluster.local(...).split(sites, link)`` has
``emulated=True``, and while its program runs (``train_step``, DiLoCo's outer step), every
collective whose group spans sites completes no sooner than the cost model's time for it on
that link (``time_of``: ``compile`` hands it :func:`graphpass.cost.collectives.collective_time`
in the flat form the runtime runs; the runtime does not import the cost model):
an asynchronous one when it is waited for, a blocking one before it returns. Collectives inside
a site run at loopback speed. Every figure measured this way is an emulation, and says so.

It wraps ``torch.distributed``'s collectives for the duration, and the runtime modules' own
references to them (``_all_gather_flat`` and the like), found by identity; and the pipeline
engine's point-to-point batches (``torch.distributed.pipelining.schedules._batch_p2p``): a
receive from a rank of another site completes no sooner than the link's time for the message
after it was posted, or after it arrived where the wait had to block for it (the sender's bytes
counted as crossing; its send completes as the real one does, buffered).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

#: torch.distributed's collectives the emulator delays: name -> (the cost model's kind, the
#: index of the tensor whose bytes are S)
_WRAPPED = {
    "all_reduce": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "all_to_all_single": ("all_to_all", 1),
    "broadcast": ("all_gather", 0),
}


class _Delayed:
    """A collective's work that completes no sooner than its emulated time."""

    def __init__(self, work: Any, due: float, emulator: "LinkEmulator"):
        self.work, self.due, self.emulator = work, due, emulator

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self.work.wait(*args, **kwargs)
        self.emulator.sleep_until(self.due)
        return out

    def is_completed(self) -> bool:
        return self.work.is_completed() and time.perf_counter() >= self.due

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


#: the pipeline engine's one entry point for its sends and receives (module, function)
_P2P = ("torch.distributed.pipelining.schedules", "_batch_p2p")


class _LateBatch:
    """One point-to-point batch whose receives from another site take ``delay`` seconds of the
    link: due once, after it was posted, or after its message arrived where a wait blocked."""

    def __init__(self, posted: float, delay: float, emulator: "LinkEmulator"):
        self.posted, self.delay, self.emulator = posted, delay, emulator
        self.due: float | None = None

    def waited(self, blocked_until: float | None) -> None:
        if self.due is None:
            start = max(self.posted, blocked_until or self.posted)
            self.due = self.emulator.charge(self.delay, 0, start)
        self.emulator.sleep_until(self.due)


class _ReceivedLate:
    """A work of a :class:`_LateBatch`."""

    def __init__(self, work: Any, batch: _LateBatch):
        self.work, self.batch = work, batch

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        before = time.perf_counter()
        out = self.work.wait(*args, **kwargs)
        after = time.perf_counter()
        self.batch.waited(after if after - before > 1e-4 else None)
        return out

    def is_completed(self) -> bool:
        return False  # known only by waiting (the arrival time decides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class LinkEmulator:
    """The emulated link of ``cluster`` (``cluster.emulated``): :meth:`active` delays what crosses it.

    Attributes:
        delayed_s: the emulated seconds requested so far (the link's time of every crossing
            collective), for the benchmarks' figures and the tests.
        crossings: how many collectives crossed the link.
        crossed_bytes: the bytes this rank handed to them (each collective's S).
    """

    def __init__(self, cluster: Any, time_of: Callable[[str, float, list[int]], float],
                 sleep: Callable[[float], None] = time.sleep):
        if not cluster.sites or not cluster.emulated:
            raise ValueError("LinkEmulator needs a cluster of sites whose link is emulated "
                             "(graphpass.Cluster.local().split(sites, link))")
        self.cluster = cluster
        self.time_of = time_of  # (kind, bytes, group ranks) -> seconds on the cluster's links
        self.sleep = sleep
        self.delayed_s = 0.0
        self.crossings = 0
        self.crossed_bytes = 0
        self._ranks: dict[Any, tuple[int, ...]] = {}
        self._depth = 0
        self._free_at = 0.0  # when the link is done with what this rank has sent over it

    def charge(self, delay: float, size: float, start: float) -> float:
        """Book a collective of ``size`` bytes started at ``start`` that the link carries in
        ``delay`` seconds, after what it carries already; returns when it is done."""
        due = self._free_at = max(start, self._free_at) + delay
        self.delayed_s += delay
        self.crossings += 1
        self.crossed_bytes += size
        return due

    def sleep_until(self, due: float) -> None:
        left = due - time.perf_counter()
        if left > 0:
            self.sleep(left)

    def _group_ranks(self, group: Any) -> tuple[int, ...]:
        key = group if group is not None else "world"
        if key not in self._ranks:
            self._ranks[key] = tuple(dist.get_process_group_ranks(group) if group is not None
                                     else range(dist.get_world_size()))
        return self._ranks[key]

    def emulated_s(self, kind: str, size_bytes: float, group: Any) -> float:
        """The link's time for one collective over ``group``; 0 inside a site."""
        ranks = self._group_ranks(group)
        if len(ranks) < 2 or len({self.cluster.site_of(r) for r in ranks}) < 2:
            return 0.0
        return self.time_of(kind, size_bytes, list(ranks))

    def _wrap(self, name: str, real: Callable) -> Callable:
        kind, operand = _WRAPPED[name]

        def emulated(*args: Any, **kwargs: Any) -> Any:
            tensor = args[operand] if len(args) > operand else kwargs.get("tensor", kwargs.get("output"))
            size = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
            delay = self.emulated_s(kind, size, kwargs.get("group"))
            start = time.perf_counter()
            work = real(*args, **kwargs)
            if delay <= 0:
                return work
            # one link: collectives in flight at once (two buckets, PowerSGD's rounds) queue on it
            due = self.charge(delay, size, start)
            if work is None:  # blocking: returns once the link would have carried it
                self.sleep_until(due)
                return None
            return _Delayed(work, due, self)
        emulated.__wrapped__ = real  # type: ignore[attr-defined]
        return emulated

    def _wrap_p2p(self, real: Callable) -> Callable:
        """The pipeline engine's ``_batch_p2p(ops, desc=None)``: receives from another site late."""
        me = dist.get_rank()

        def emulated(p2p_ops: list, *args: Any, **kwargs: Any) -> Any:
            posted = time.perf_counter()
            delay = 0.0
            for op in p2p_ops:
                ranks = (me, op.peer)
                size = op.tensor.numel() * op.tensor.element_size()
                if self.cluster.site_of(me) == self.cluster.site_of(op.peer):
                    continue
                if op.op is dist.isend:  # the bytes this rank hands to the link
                    self.crossed_bytes += size
                else:
                    delay += self.time_of("send_recv", size, list(ranks))
            works = real(p2p_ops, *args, **kwargs)
            if delay <= 0:
                return works
            batch = _LateBatch(posted, delay, self)
            return [_ReceivedLate(w, batch) for w in works]
        emulated.__wrapped__ = real  # type: ignore[attr-defined]
        return emulated

    @contextlib.contextmanager
    def active(self) -> Iterator["LinkEmulator"]:
        """Delay every crossing collective while in this context (re-entrant)."""
        if self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        reals = {name: getattr(dist, name) for name in _WRAPPED if hasattr(dist, name)}
        wrapped = {name: self._wrap(name, real) for name, real in reals.items()}
        by_id = {id(real): wrapped[name] for name, real in reals.items()}
        patched: list[tuple[Any, str, Any]] = [(dist, name, real) for name, real in reals.items()]
        for module_name, module in list(sys.modules.items()):  # the runtime's own references
            if module is None or not module_name.startswith("graphpass.runtime"):
                continue
            for attr, value in list(vars(module).items()):
                if id(value) in by_id:
                    patched.append((module, attr, value))
        for owner, attr, real in patched:
            setattr(owner, attr, by_id[id(real)])
        schedules = sys.modules.get(_P2P[0])
        if schedules is not None:  # the pipeline engine's sends and receives
            real = getattr(schedules, _P2P[1])
            setattr(schedules, _P2P[1], self._wrap_p2p(real))
            patched.append((schedules, _P2P[1], real))
        self._depth = 1
        try:
            yield self
        finally:
            self._depth = 0
            for owner, attr, real in patched:
                setattr(owner, attr, real)


__all__ = ["LinkEmulator"]
