"""The disk tier: master weights, their gradients and optimizer state in files, stepped in pages.

A parameter with ``Tiers(optimizer="disk")`` keeps its master copy (what ``dmodel.parameters()``
hands the optimizer) and the buffer its gradient lands in as files under the rank's offload
directory (``gp.compile(..., offload_dir=)``), one file per tensor, mapped into memory
(``mmap``, shared): reading a page loads it, writing it dirties the page cache, and the kernel
or an explicit flush writes it back. Memory holds what is being used, not the whole model.

The optimizer still is yours (any ``torch.optim`` optimizer that keeps per-parameter state).
Its ``step()`` runs, for the disk-tier parameters, *in pages* (Angel-PTM): a global step
pre-hook steps one page of parameters at a time (the others' gradients hidden, so torch skips
them), moves the state the page's first step created into files, and hands the page to the I/O
thread, which writes it back (``msync``) and drops it from memory while the next page, whose
loading it advised ahead (``MADV_WILLNEED``), is stepped. The step that then runs as usual sees
the disk-tier parameters without gradients and steps only the rest; their gradients come back
after it. The update is exact: the same optimizer on the same values, page by page.

**The delayed update** (``gp.compile(..., delayed_disk_update=True)``; Angel-PTM's lock-free
update, ZeRO-Offload's delayed parameter update; opt-in, never the default, and *not exact*):
``opt.step()`` only takes the disk-tier gradients; their paged step runs on a thread of its own
while the next ``train_step`` computes, and is joined by the ``opt.step()`` after it (or by
anything that reads the state: a checkpoint, ``full_state_dict``, ``opt.state_dict()``). The
program computes with the weights of one update earlier: the update of step ``k`` uses the
gradients taken at the weights before update ``k - 1``. The page's step runs on stand-in
parameters sharing the masters' storage (another instance of your optimizer's class, over the
same per-parameter state), so the training thread's ``.grad`` of the masters is never touched;
each step's gradients land in one of two files per parameter, the other being stepped.

What this does not do: an optimizer with one state for all its parameters (LBFGS) or a step
closure cannot be paged (``NotImplementedError``); loading a checkpoint puts the loaded
optimizer state in memory until the next step moves it to files again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import mmap
import os
import pathlib
import shutil
import tempfile
import threading
import weakref
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from graphpass.runtime.memory import mark_host
from graphpass.units import format_bytes

#: The bytes of master, gradient and state stepped as one page.
PAGE_BYTES = 64 * 2**20


def check_offload_dir(path: str | os.PathLike | None, need_bytes: int) -> pathlib.Path:
    """The directory the disk tier writes to, checked: it is given, writable and has room.

    Raises:
        ValueError: naming ``offload_dir`` and what to change.
    """
    if path is None:
        path = os.environ.get("GRAPHPASS_OFFLOAD_DIR")
    if not path:
        raise ValueError("the plan keeps optimizer state on disk (Tiers(optimizer='disk'), Strategy(offload_to='disk')) "
                         "but no directory was given: pass gp.compile(..., offload_dir='/local/nvme/graphpass') or set "
                         "GRAPHPASS_OFFLOAD_DIR")
    root = pathlib.Path(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".graphpass-write-test-{os.getpid()}"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"offload_dir {str(root)!r} is not a writable directory ({exc.strerror or exc}); give "
                         "gp.compile(..., offload_dir=) a directory this process can write") from None
    free = shutil.disk_usage(root).free
    if free < need_bytes:
        raise ValueError(f"offload_dir {str(root)!r} has {format_bytes(free)} free, but the disk tier needs about "
                         f"{format_bytes(need_bytes)} (master weights, gradients and optimizer state); free space there "
                         "or give another offload_dir")
    return root


class DiskStore:
    """One rank's files: one per tensor, mapped into memory, and the I/O thread that moves them.

    Args:
        root: the checked offload directory; files go to a new ``root/rank{rank}-*/``, removed
            when the store is.
    """

    def __init__(self, root: pathlib.Path, rank: int):
        # a directory of its own: several compiled models in one process never share a file
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix=f"rank{rank}-", dir=root))
        self._maps: dict[int, mmap.mmap] = {}  # storage data_ptr -> its mapping
        self._io: concurrent.futures.ThreadPoolExecutor | None = None
        weakref.finalize(self, shutil.rmtree, str(self.dir), True)

    def tensor(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A file-backed CPU tensor shaped like ``like`` (zeros), marked as host memory."""
        nbytes = like.numel() * like.element_size()
        if nbytes == 0:
            return mark_host(torch.zeros(like.shape, dtype=like.dtype))
        path = self.dir / (name.replace("/", "_") + ".bin")
        with open(path, "w+b") as f:
            f.truncate(nbytes)
            mapped = mmap.mmap(f.fileno(), nbytes)
        out = torch.frombuffer(mapped, dtype=like.dtype, count=like.numel()).view(like.shape)
        self._maps[out.untyped_storage().data_ptr()] = mapped
        return mark_host(out)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in one of this store's files."""
        return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in self._maps

    def _mapping(self, tensor: torch.Tensor) -> mmap.mmap | None:
        return self._maps.get(tensor.untyped_storage().data_ptr())

    def _submit(self, job) -> concurrent.futures.Future:
        if self._io is None:
            self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphpass-disk")
        return self._io.submit(job)

    def load_ahead(self, tensors: Iterable[torch.Tensor]) -> None:
        """Ask the kernel to read these tensors' pages now (the next page of a paged step)."""
        maps = [m for m in map(self._mapping, tensors) if m is not None]
        if maps and hasattr(mmap, "MADV_WILLNEED"):
            self._submit(lambda: [m.madvise(mmap.MADV_WILLNEED) for m in maps])

    def write_back(self, tensors: Iterable[torch.Tensor]) -> concurrent.futures.Future | None:
        """Write these tensors' dirty pages to their files and drop them from memory, on the I/O
        thread. A write that fails raises where the returned future is waited for."""
        maps = [m for m in map(self._mapping, tensors) if m is not None]
        if not maps:
            return None

        def job() -> None:
            for m in maps:
                m.flush()
                if hasattr(mmap, "MADV_DONTNEED"):
                    m.madvise(mmap.MADV_DONTNEED)
        return self._submit(job)


# --------------------------------------------------------------------------- the paged step

#: master copy -> the store its files are in
_STORES: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: optimizer -> the disk-tier gradients hidden from the step that follows the paged one
_HIDDEN: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = weakref.WeakKeyDictionary()
_HOOKS: list[Any] = []
#: this thread is stepping pages (its own optimizer steps skip the paging hooks)
_LOCAL = threading.local()
#: master copies whose paged step is delayed (a step behind, on a thread of its own)
_DELAYED: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: optimizer -> (masters, their gradients): a delayed step taken, not yet started (held: the
#: update happens even if the optimizer is dropped before it)
_TAKEN: dict[torch.optim.Optimizer, tuple[list, dict]] = {}
#: optimizer -> the delayed step running
_BEHIND: dict[torch.optim.Optimizer, concurrent.futures.Future] = {}
_BEHIND_POOL: list[concurrent.futures.ThreadPoolExecutor] = []


def _paging() -> bool:
    return getattr(_LOCAL, "paging", False)


@contextlib.contextmanager
def _paging_here() -> Iterator[None]:
    """This thread steps pages meanwhile: the optimizer steps it takes skip the paging hooks."""
    _LOCAL.paging = True
    try:
        yield
    finally:
        _LOCAL.paging = False


def register(master: torch.Tensor, store: DiskStore, delayed: bool = False) -> None:
    """Step ``master`` in pages from now on (its files are in ``store``); ``delayed``: a step
    behind, while the next step computes (not exact, see the module docstring)."""
    _STORES[master] = store
    if delayed:
        _DELAYED[master] = True
    if not _HOOKS:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _HOOKS.append(register_optimizer_step_pre_hook(_step_in_pages))
        _HOOKS.append(register_optimizer_step_post_hook(_give_back_gradients))


def pages(params: Sequence[torch.Tensor], page_bytes: int | None = None) -> list[list[torch.Tensor]]:
    """``params`` in order, cut into pages of about ``page_bytes`` (default :data:`PAGE_BYTES`;
    a bigger tensor is a page of its own)."""
    page_bytes = PAGE_BYTES if page_bytes is None else page_bytes
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > page_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


def _step_in_pages(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _paging():
        return
    settle(optimizer)  # the delayed step before: done (its failure raises here)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    on_disk = [p for p in params if p in _STORES and p.grad is not None]
    if not on_disk:
        return
    if len(args) > 1 or kwargs.get("closure") is not None:  # args[0] is the optimizer
        raise NotImplementedError(f"{type(optimizer).__name__}.step(closure) with optimizer state on disk: a closure "
                                  "re-evaluates the model between pages; step without one")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise NotImplementedError("LBFGS keeps one state for all its parameters, so it cannot step the disk tier "
                                  "in pages; use a per-parameter optimizer (SGD, Adam, AdamW, ...)")
    delayed = [p for p in on_disk if p in _DELAYED]
    if delayed:  # taken now, stepped while the next train_step computes
        _TAKEN[optimizer] = (delayed, {id(p): p.grad for p in delayed})
        for p in delayed:
            p.grad = None  # its file is the delayed step's now; the next backward lands in the other
        _guard_state_dict(optimizer)
    on_disk = [p for p in on_disk if p not in _DELAYED]
    if not on_disk:
        return
    grads = {id(p): p.grad for p in params}
    paged = {id(p) for p in on_disk}
    try:
        for p in params:
            p.grad = None
        with _paging_here():
            _step_pages(optimizer, on_disk, grads, _own_step(optimizer))
    finally:
        for p in params:  # the step that follows skips the paged parameters: they have no gradient
            p.grad = None if id(p) in paged else grads[id(p)]
        _HIDDEN[optimizer] = [(p, grads[id(p)]) for p in on_disk]


def _own_step(optimizer: torch.optim.Optimizer):
    """Step a page with ``optimizer`` itself (the exact mode, on the training thread)."""

    def step(page: list[torch.Tensor], grads: dict[int, torch.Tensor]) -> None:
        for p in page:
            p.grad = grads[id(p)]
        try:
            optimizer.step()
        finally:
            for p in page:
                p.grad = None
    return step


def _stand_in_step(optimizer: torch.optim.Optimizer):
    """Step a page with stand-ins: parameters sharing the masters' storage, under another
    instance of the optimizer's class with the same hyperparameters and the same per-parameter
    state (the delayed mode: the masters' own ``.grad`` belongs to the training thread)."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def step(page: list[torch.Tensor], grads: dict[int, torch.Tensor]) -> None:
        groups: dict[int, dict] = {}
        pairs = []
        for p in page:
            stand_in = torch.nn.Parameter(p.detach(), requires_grad=True)
            stand_in.grad = grads[id(p)]
            group = group_of[id(p)]
            groups.setdefault(id(group), {**{k: v for k, v in group.items() if k != "params"}, "params": []})
            groups[id(group)]["params"].append(stand_in)
            pairs.append((stand_in, p))
        try:
            other = type(optimizer)(list(groups.values()))
        except TypeError as exc:
            raise NotImplementedError(
                f"delayed_disk_update steps the disk tier with another {type(optimizer).__name__} built from its "
                f"param_groups, which its constructor refuses ({exc}); use a torch.optim optimizer or the exact "
                "mode") from None
        for stand_in, p in pairs:
            other.state[stand_in] = optimizer.state[p]  # the same dict: its state lands in optimizer's
        other.step()
    return step


def _step_pages(optimizer: torch.optim.Optimizer, on_disk: list[torch.Tensor], grads: dict[int, torch.Tensor],
                step) -> None:
    """Step ``on_disk`` page by page with ``step``, loading the next page ahead and writing each
    stepped one back; a failed write raises here, before the step is taken as done."""
    page_list = pages(on_disk)
    writes = []
    for i, page in enumerate(page_list):
        if i + 1 < len(page_list):
            ahead = page_list[i + 1]
            _STORES[ahead[0]].load_ahead([t for q in ahead for t in (q, grads[id(q)], *_state_tensors(optimizer, q))])
        step(page, grads)
        for p in page:
            _state_to_files(optimizer, p)
        write = _STORES[page[0]].write_back([t for p in page for t in (p, *_state_tensors(optimizer, p))])
        if write is not None:
            writes.append(write)
    for write in writes:
        write.result()


def _behind(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: dict[int, torch.Tensor]) -> None:
    with _paging_here(), torch.no_grad():
        _step_pages(optimizer, params, grads, _stand_in_step(optimizer))


def taken() -> list[torch.Tensor]:
    """The masters whose delayed step is taken and not yet started (their uploads must finish
    before it writes them)."""
    return [p for params, _ in _TAKEN.values() for p in params]


def start_behind() -> None:
    """Start every delayed step taken (the training thread computes the next step meanwhile)."""
    if not _BEHIND_POOL:
        _BEHIND_POOL.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphpass-disk-step"))
    for optimizer, (params, grads) in list(_TAKEN.items()):
        del _TAKEN[optimizer]
        _BEHIND[optimizer] = _BEHIND_POOL[0].submit(_behind, optimizer, params, grads)


def settle(optimizer: torch.optim.Optimizer | None = None) -> None:
    """Finish the delayed steps (of ``optimizer``; None: all): the one running is waited for,
    one taken but not started runs now. Its failure raises here."""
    for opt in [optimizer] if optimizer is not None else list({*_TAKEN.keys(), *_BEHIND.keys()}):
        future = _BEHIND.pop(opt, None)
        if future is not None:
            future.result()
        if opt in _TAKEN:
            params, grads = _TAKEN.pop(opt)
            _behind(opt, params, grads)


def _guard_state_dict(optimizer: torch.optim.Optimizer) -> None:
    """``opt.state_dict()`` and ``load_state_dict`` wait for the delayed step first (once per optimizer)."""
    if not getattr(optimizer, "_graphpass_settles", False):
        optimizer.register_state_dict_pre_hook(lambda opt: settle(opt))
        optimizer.register_load_state_dict_pre_hook(lambda opt, state: settle(opt))
        optimizer._graphpass_settles = True


def _give_back_gradients(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _paging():
        return
    for p, grad in _HIDDEN.pop(optimizer, ()):
        p.grad = grad


def _state_tensors(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> list[torch.Tensor]:
    return [v for v in optimizer.state.get(param, {}).values() if isinstance(v, torch.Tensor) and v.dim()]


def _state_to_files(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Move the per-element state of ``param`` (momentum, moments) into files, where it is not."""
    store = _STORES[param]
    state = optimizer.state.get(param, {})
    for key, value in list(state.items()):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape == param.shape and not store.holds(value):
            name = f"{id(optimizer):x}.{id(param):x}.{key}"
            state[key] = store.tensor(name, value).copy_(value)


__all__ = ["PAGE_BYTES", "DiskStore", "check_offload_dir", "pages", "register", "settle", "start_behind", "taken"]
