"""Offload at run time: master copies, gradients and saved activations in host memory.

A parameter whose plan entry puts parts off the device (:class:`graphpass.layout.Tiers`) keeps
two tensors on its rank:

- the *compute copy*, the graph's attribute (``get_attr``): what forward and backward read, what
  gradient synchronisation writes ``.grad`` of, on the device;
- the *master copy* in host memory: what ``dmodel.parameters()`` hands the optimizer, so the
  optimizer and its state live and step on the host (ZeRO-Offload), and what checkpoints and
  ``full_state_dict`` read.

Each step, :meth:`OffloadedParams.upload` streams a master that changed since its last upload
into the compute copy (it starts as soon as the optimizer has stepped, from an optimizer step
hook, else when the next step begins); the graph's ``fetch_param`` node waits for that copy
right before the parameter's first use, so the earlier layers compute while the later ones
arrive. Gradients go down into ``master.grad``: with ``Tiers(gradient="host")`` each one as it
lands on the compute copy (from gradient synchronisation, or autograd's accumulation), with
``"device"`` once after the step's backwards; the compute copy's ``.grad`` is then dropped.

A layer whose activations are saved on the host (``ActivationPlan(tier="host")``) runs between
``saved_to_host`` and ``saved_on_device`` nodes: while it runs, every tensor autograd saves
(except parameters and what ZeRO-3 re-gathers) is copied to host memory, and in backward the
layer's tensors come back when the layer after it starts its backward (one layer ahead).

Copies run on one background thread (CPU) or a side CUDA stream: compute that does not need a
copy never waits for it. On a CPU-only machine the device *is* the host, so the tiers are
emulated: host buffers are marked (:func:`graphpass.runtime.memory.mark_host`) and a
:class:`~graphpass.runtime.memory.MemoryProbe` counts only the rest, while every copy is real.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import operator
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from graphpass.layout import Tiers
from graphpass.runtime import disk, grad_sync, ownership, regather
from graphpass.runtime.disk import DiskStore
from graphpass.runtime.fake import is_fake
from graphpass.runtime.memory import is_host, mark_host

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- copies


class Transfer:
    """One copy in flight; :meth:`wait` blocks until it is done (once; later calls return)."""

    __slots__ = ("_future", "_event")

    def __init__(self, future: concurrent.futures.Future | None = None, event: Any = None):
        self._future, self._event = future, event

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()  # re-raises a failed copy here, on the thread that needs it
            self._future = None
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            self._event = None


class _Copier:
    """The copy engine: one background thread, and a side stream on a GPU."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream: Any = None

    def run(self, job: Callable[[], None], device: torch.device) -> Transfer:
        """Run ``job`` (copies) off the compute path."""
        if device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream), torch.no_grad():
                job()
            event = torch.cuda.Event()
            event.record(self._stream)
            return Transfer(event=event)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphpass-offload")
            atexit.register(self._pool.shutdown, wait=False)
        return Transfer(self._pool.submit(_no_grad, job))


def _no_grad(job: Callable[[], None]) -> None:
    with torch.no_grad():  # grad mode is per thread
        job()


COPIER = _Copier()


def host_like(tensor: torch.Tensor) -> torch.Tensor:
    """An uninitialised host-memory tensor shaped like ``tensor`` (its strides where they are
    dense, else contiguous; pinned when a GPU copies into it), marked as host memory. Allocated
    on the calling thread, so a memory probe sees it."""
    pin = tensor.device.type == "cuda"
    return mark_host(torch.empty_like(tensor, device="cpu", memory_format=torch.preserve_format, pin_memory=pin))


# --------------------------------------------------------------------------- parameters

#: compute copy -> its upload in flight, waited for by the graph's ``fetch_param`` node
_PENDING: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: master copy -> the :class:`OffloadedParams` holding it (for the optimizer step hook)
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: compute copy -> its :class:`_Streamed` (``Tiers(parameter="host")``)
_STREAMED: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _Streamed:
    """A compute copy that is resident only around its uses (``Tiers(parameter="host")``): its
    storage is released between them and streamed in from the master copy ahead of each."""

    def __init__(self, param: nn.Parameter, master: nn.Parameter, window: int):
        self.param, self.master, self.window = param, master, window
        self.nbytes = param.untyped_storage().nbytes()
        self.resident = True
        self.unit: int | None = None  # its layer's (prefetch_params group's) id: backward's window counts these

    def bring_in(self) -> None:
        """Make the storage resident again and start filling it from the master (no-op if it is)."""
        if self.resident:
            return
        self.param.untyped_storage().resize_(self.nbytes)  # on this thread: a memory probe sees it
        self.resident = True
        _PENDING[self.param] = COPIER.run(lambda d=self.param.data, m=self.master: d.copy_(m, non_blocking=True),
                                          self.param.device)

    def release(self) -> None:
        """Drop the storage (after its last forward use: backward reloads what it saved)."""
        if not self.resident:
            return
        transfer = _PENDING.pop(self.param, None)
        if transfer is not None:
            transfer.wait()
        regather.forget(self.param)
        self.param.untyped_storage().resize_(0)
        self.resident = False



class _Reload:
    """One streamed parameter as one forward saved it: backward reads a fresh device copy of the
    master instead of the released compute copy, started a window of layers ahead."""

    __slots__ = ("streamed", "owner", "unit", "out", "transfer", "group")

    def __init__(self, streamed: _Streamed, owner: "_BackwardWindow", unit: int):
        self.streamed, self.owner, self.unit = streamed, owner, unit
        self.out: torch.Tensor | None = None
        self.transfer: Transfer | None = None
        self.group: regather.Rebuildable | None = None  # the handles autograd saved of it

    def start(self) -> None:
        if self.out is None and self.group is not None and self.group.outstanding > 0:  # saved, not yet read
            # allocated on this thread: a memory probe sees it
            self.out = torch.empty_like(self.streamed.param, memory_format=torch.preserve_format)
            self.transfer = COPIER.run(lambda d=self.out, m=self.streamed.master: d.copy_(m, non_blocking=True),
                                       self.out.device)

    def take(self) -> list[torch.Tensor]:
        """The copy (regather's rebuild: once, at backward's first read), the next layers' started."""
        self.owner.ahead(self.unit, self.streamed.window)
        self.start()  # the group's outstanding handle is the one being read
        assert self.transfer is not None and self.out is not None
        self.transfer.wait()
        out, self.out, self.transfer = self.out, None, None
        return [out]


class _BackwardWindow:
    """One forward's streamed parameters by layer, in forward order. Backward reaches the layers
    in reverse: its first read of layer ``u``'s parameters starts bringing in those of layers
    ``u - 1 .. u - window`` (STRONGHOLD's window, the other way)."""

    def __init__(self) -> None:
        self.units: list[list[_Reload]] = []
        self._index: dict[int | None, int] = {}

    def add(self, streamed: _Streamed) -> _Reload:
        if streamed.unit not in self._index or streamed.unit is None:
            self._index[streamed.unit] = len(self.units)
            self.units.append([])
        unit = self._index[streamed.unit]
        reload = _Reload(streamed, self, unit)
        self.units[unit].append(reload)
        return reload

    def ahead(self, unit: int, window: int) -> None:
        for earlier in range(unit - 1, max(-1, unit - 1 - window), -1):
            for reload in self.units[earlier]:
                reload.start()


#: the forward running (regather's registry) -> its streamed parameters for backward
_WINDOWS: "weakref.WeakKeyDictionary[Any, _BackwardWindow]" = weakref.WeakKeyDictionary()


def _parameter_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._base if tensor._is_view() and tensor._base is not None else tensor


def fetch_param(param: torch.Tensor) -> torch.Tensor:
    """The graph op before a parameter's first use that reads its data (``param`` or the view
    gradient synchronisation hands out): wait for its compute copy (a streamed one is brought
    in now if no prefetch did) and return it. A streamed copy is then released after its last
    use, so what autograd saves of it is reloaded from the master in backward."""
    if is_fake(param):
        return param
    base = _parameter_of(param)
    streamed = _STREAMED.get(base)
    if streamed is not None:
        streamed.bring_in()
        forward = regather.current()
        if forward is not None:
            window = _WINDOWS.get(forward)
            if window is None:
                window = _WINDOWS[forward] = _BackwardWindow()
            reload = window.add(streamed)
            reload.group = regather.register((base,), reload.take)
    transfer = _PENDING.pop(base, None)
    if transfer is not None:
        transfer.wait()
    return param


def prefetch_params(*params: torch.Tensor) -> None:
    """Graph op a window of layers ahead of these streamed parameters' use: start bringing them in."""
    for param in params:
        streamed = None if is_fake(param) else _STREAMED.get(param)
        if streamed is not None:
            streamed.unit = id(params[0])
            streamed.bring_in()


def release_params(*params: torch.Tensor) -> None:
    """Graph op after these streamed parameters' last forward use: drop their device storage."""
    for param in params:
        streamed = None if is_fake(param) else _STREAMED.get(param)
        if streamed is not None:
            streamed.release()


@contextlib.contextmanager
def resident(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Offloaded parameters among ``tensors`` up to date and resident for the block (read outside
    their graph nodes: ZeRO prefetching the next group's gather, or re-gathering in backward);
    streamed ones it brought in are released after."""
    brought = []
    for tensor in tensors:
        streamed = _STREAMED.get(tensor)
        if streamed is not None:
            if not streamed.resident:
                brought.append(streamed)
            streamed.bring_in()
        transfer = _PENDING.pop(tensor, None)  # an upload after the optimizer step, too
        if transfer is not None:
            transfer.wait()
    try:
        yield
    finally:
        for streamed in brought:
            streamed.release()


class OffloadedParams:
    """The parameters of one rank's program whose master copy lives in host memory.

    Args:
        params: ``(attribute target, compute copy, tiers)`` of each offloaded parameter.
        window: layers a streamed parameter is brought in ahead of its use (in backward too).
        store: the rank's files, for parameters whose optimizer lives on disk.
        delayed: step the disk tier a step behind (:mod:`graphpass.runtime.disk`; not exact).
    """

    def __init__(self, params: Iterable[tuple[str, nn.Parameter, Tiers]], window: int = 1,
                 store: DiskStore | None = None, delayed: bool = False):
        params = list(params)
        if delayed:
            streamed = [t for t, _, tiers in params if tiers.optimizer == "disk" and tiers.parameter == "host"]
            if not any(tiers.optimizer == "disk" for _, _, tiers in params):
                raise ValueError("delayed_disk_update=True delays the disk tier's optimizer step, and this plan keeps "
                                 "no optimizer state on disk: use Strategy(offload=(...), offload_to='disk') or drop it")
            if streamed:
                raise ValueError(f"delayed_disk_update=True with streamed parameters ({streamed[0]!r}: "
                                 "Tiers(parameter='host')): forward reads their masters while the delayed step writes "
                                 "them; drop 'parameters' from Strategy.offload or the delayed update")
        self.tiers: dict[str, Tiers] = {}
        self.compute: dict[str, nn.Parameter] = {}
        self.masters: dict[str, nn.Parameter] = {}
        self._by_compute: WeakIdKeyDictionary = WeakIdKeyDictionary()  # compute copy -> target
        self._uploaded: dict[str, int] = {}  # target -> the master's version its compute copy holds
        self._held: set[str] = set()
        self._store = store
        self._grad_files: dict[str, list[torch.Tensor]] = {}
        self._delayed = delayed
        for target, param, tiers in params:
            on_disk = tiers.optimizer == "disk"
            if on_disk and store is None:
                raise ValueError(f"{target!r} keeps its optimizer on disk but no offload directory was given: "
                                 "gp.compile(..., offload_dir=)")
            with torch.no_grad():
                copy = store.tensor(f"{target}.master", param) if on_disk else host_like(param)
                master = nn.Parameter(mark_host(copy.copy_(param)), requires_grad=param.requires_grad)
            if on_disk:
                disk.register(master, store, delayed)
            self.tiers[target], self.compute[target], self.masters[target] = tiers, param, master
            self._by_compute[param] = target
            ownership.compute_copy(param, target)
            self._uploaded[target] = master._version
            _OWNERS[master] = self
            _install_step_hook()
            if tiers.parameter == "host":
                streamed = _STREAMED[param] = _Streamed(param, master, window)
                streamed.release()  # resident only around its uses from now on
            if tiers.gradient == "host":
                grad_sync.when_grad_lands(param, self._grad_landed)
                param.register_post_accumulate_grad_hook(self._grad_landed)
        self._down: list[Transfer] = []

    def __len__(self) -> int:
        return len(self.masters)

    def master_of(self, param: torch.Tensor) -> nn.Parameter | None:
        """The master copy of compute copy ``param`` (None: not offloaded)."""
        target = self._by_compute.get(param)
        return None if target is None else self.masters[target]

    def upload(self) -> None:
        """Start copying every master that changed since its last upload into its compute copy
        (the graph's ``fetch_param`` waits for it). A streamed copy is filled from the master at
        each use, unless it is still resident: one this rank's program never releases (a weight
        tied to a later pipeline stage, whose last use is there) is refreshed here like the others."""
        for target, master in self.masters.items():
            if master._version == self._uploaded[target]:
                continue
            param = self.compute[target]
            streamed = _STREAMED.get(param)
            if streamed is not None and not streamed.resident:
                self._uploaded[target] = master._version  # its next bring_in reads the master
                continue
            previous = _PENDING.pop(param, None)
            if previous is not None:
                previous.wait()
            _PENDING[param] = COPIER.run(lambda p=param, m=master: p.data.copy_(m, non_blocking=True), param.device)
            self._uploaded[target] = master._version

    def wait_uploads(self) -> None:
        """Wait for every upload in flight (before something outside the graph reads the
        compute copies)."""
        for param in self.compute.values():
            fetch_param(param)

    def hold_gradients(self, targets: Iterable[str]) -> None:
        """Keep these parameters' gradients on the device until :meth:`finish_step`, even with
        ``Tiers(gradient="host")``: something still reduces them after the backwards (a weight
        that several pipeline stages share sums its stages' gradients at the end of the step)."""
        self._held = set(targets)

    def _grad_landed(self, param: torch.Tensor) -> None:
        target = self._by_compute.get(param)
        if target is not None and param.grad is not None and target not in self._held:
            self._send_down(target)

    def _send_down(self, target: str) -> None:
        """Copy the compute copy's gradient into the master's ``.grad`` (added to what is there,
        as autograd accumulates), then drop it from the device."""
        param, master = self.compute[target], self.masters[target]
        grad = param.grad
        param.grad = None
        if master.grad is None:
            master.grad = self._grad_buffer(target, grad)
            job = (lambda dst=master.grad, g=grad: dst.copy_(g, non_blocking=True))
        else:
            job = (lambda dst=master.grad, g=grad: dst.add_(g.to(dst.device)))
        self._down.append(COPIER.run(job, grad.device))

    def _grad_buffer(self, target: str, grad: torch.Tensor) -> torch.Tensor:
        """Where a master's gradient lands: host memory, or its file for the disk tier (made
        once, reused every step)."""
        if self.tiers[target].optimizer != "disk":
            return host_like(grad)
        files = self._grad_files.setdefault(target, [])
        if not files:
            files.append(self._store.tensor(f"{target}.grad", grad))
        elif self._delayed:  # two files, taken in turn: the delayed step reads the other
            if len(files) == 1:
                files.append(self._store.tensor(f"{target}.grad.1", grad))
            files.reverse()
        return files[0]

    def start_delayed(self) -> None:
        """Start the disk tier's delayed step (a step behind) once the uploads it would overwrite
        are done; the step about to run computes meanwhile."""
        taken = {id(t) for t in disk.taken()}
        if not taken:
            return
        for target, master in self.masters.items():
            if id(master) in taken:
                fetch_param(self.compute[target])  # its upload has read the master
        disk.start_behind()

    def finish_step(self) -> None:
        """After the step's backwards: send every gradient still on the device down and wait
        for all of them (the optimizer steps the masters next)."""
        for target, param in self.compute.items():
            if param.grad is not None:
                self._send_down(target)
        down, self._down = self._down, []
        for transfer in down:
            transfer.wait()


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Start streaming the updated masters up as soon as an optimizer has stepped them; the
    state it keeps for them is host memory (what an emulated device does not count)."""
    owners = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            owner = _OWNERS.get(p)
            if owner is not None:
                owners[id(owner)] = owner
                for value in optimizer.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        mark_host(value)
    for owner in owners.values():
        owner.upload()


_HOOK: Any = None


def _install_step_hook() -> None:
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK = register_optimizer_step_post_hook(_after_optimizer_step)


# --------------------------------------------------------------------------- activations


class _Saved:
    """One saved tensor in host memory: its copy down in flight, and its copy back once asked."""

    __slots__ = ("host", "down", "device_copy", "up", "device")

    def __init__(self, tensor: torch.Tensor):
        self.device = tensor.device
        self.host = host_like(tensor)
        self.down = COPIER.run(lambda dst=self.host, src=tensor: dst.copy_(src, non_blocking=True), tensor.device)
        self.device_copy: torch.Tensor | None = None
        self.up: Transfer | None = None

    def prefetch(self) -> None:
        if self.device_copy is None:
            self.down.wait()
            self.device_copy = torch.empty_like(self.host, device=self.device, memory_format=torch.preserve_format)
            self.up = COPIER.run(lambda dst=self.device_copy, src=self.host: dst.copy_(src, non_blocking=True),
                                 self.device)

    def get(self) -> torch.Tensor:
        self.prefetch()
        assert self.up is not None and self.device_copy is not None
        self.up.wait()
        out, self.device_copy, self.up = self.device_copy, None, None
        return out


class _LayerSaved:
    """The tensors one layer saved on the host in one forward; the layer saved before it (whose
    backward comes next) is fetched when this one's backward begins."""

    def __init__(self, layer: int, before: "_LayerSaved | None"):
        self.layer = layer
        self.before = before
        self.by_key: dict[tuple, tuple[_Saved, weakref.ref]] = {}
        self.started = False

    def pack(self, tensor: torch.Tensor) -> Any:
        """A handle for ``tensor`` in host memory, or None to keep it (parameters, which the
        device holds anyway; host tensors; what is not a plain dense tensor)."""
        base = tensor._base if tensor._is_view() else tensor
        if (base.is_leaf and base.requires_grad) or tensor.layout != torch.strided or is_fake(tensor) \
                or is_host(tensor) or tensor.numel() == 0:
            return None
        # One copy of a tensor saved twice (by two ops): keyed by its storage, which must still be
        # the same one (an address the allocator handed out again is another tensor)
        storage = tensor.untyped_storage()
        key = (id(storage), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        entry = self.by_key.get(key)
        if entry is None or entry[1]() is not storage:
            entry = self.by_key[key] = (_Saved(tensor), weakref.ref(storage))
        return _HostHandle(self, entry[0])

    def unpacking(self) -> None:
        if not self.started:
            self.started = True
            if self.before is not None:  # the next backward's activations start their way back
                for saved, _ in self.before.by_key.values():
                    saved.prefetch()


class _HostHandle:
    """What autograd keeps for a tensor saved on the host."""

    __slots__ = ("layer", "saved")

    def __init__(self, layer: _LayerSaved, saved: _Saved):
        self.layer, self.saved = layer, saved

    def unpack(self) -> torch.Tensor:
        self.layer.unpacking()
        return self.saved.get()


class ActivationScope:
    """The value of a ``saved_to_host`` node: the layer whose saved tensors go to the host until
    the matching ``saved_on_device`` node."""

    __slots__ = ("layer",)

    def __init__(self, layer: "_LayerSaved | None"):
        self.layer = layer


class _Forward:
    """The host-saved layers of one forward, in order (tracked per forward of the step program)."""

    def __init__(self) -> None:
        self.last: _LayerSaved | None = None


_FORWARDS: "weakref.WeakKeyDictionary[Any, _Forward]" = weakref.WeakKeyDictionary()


def saved_to_host(layer: int) -> ActivationScope:
    """Graph op before a layer's first node: from here on, what autograd saves goes to the host.

    A no-op outside a training forward (shape propagation, evaluation)."""
    registry = regather.current()
    if registry is None or not torch.is_grad_enabled():
        return ActivationScope(None)
    forward = _FORWARDS.setdefault(registry, _Forward())
    saved = _LayerSaved(layer, forward.last)
    forward.last = saved
    registry.spill = saved.pack
    return ActivationScope(saved)


def saved_on_device(scope: ActivationScope) -> None:
    """Graph op after the layer's last node: saved tensors stay on the device again."""
    registry = regather.current()
    if registry is not None and scope.layer is not None:
        registry.spill = None


# --------------------------------------------------------------------------- the schedule's rules


def schedule_problems(gm: Any) -> list[str]:
    """What is wrong with the transfers of a rank's program (``gm``, after any pass), read from
    its nodes before anything runs: a parameter whose parts live off the device read other than
    through a ``fetch_param`` (its compute copy may not have arrived); a streamed parameter read
    after a ``release_params`` dropped it and before a fetch brought it back, or released twice;
    a ``saved_to_host`` scope not closed by its ``saved_on_device`` or nested in another."""
    from graphpass import meta  # the core's metadata keys (this module is imported by passes too)

    problems: list[str] = []
    bucket_ops = {"all_reduce_grads"}
    resident: dict[Any, Any] = {}  # streamed parameter -> the node that last brought it in / released it
    released_by: dict[Any, Any] = {}
    open_scope = None
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            layout = meta.layout(node)
            if layout is None or not layout.tiers.offloaded:
                continue
            for user in node.users:
                name = getattr(user.target, "__name__", "")
                if user.op == "call_function" and (user.target in OFFLOAD_OPS or name in bucket_ops):
                    if name in bucket_ops:
                        for item in user.users:
                            if item.args[1] == list(user.args).index(node) - 1:
                                problems += [f"node {u.name!r} reads {node.target!r} (through gradient bucket "
                                             f"{user.name!r}) without a fetch_param: its compute copy may not have "
                                             "arrived" for u in item.users if u.target is not fetch_param]
                    continue
                problems.append(f"node {user.name!r} reads {node.target!r}, whose parts live off the device "
                                f"({layout.tiers}), without a fetch_param: its compute copy may not have arrived")
            continue
        if node.op != "call_function":
            continue
        if node.target is prefetch_params:
            for param in node.args:
                resident[param] = node
        elif node.target is release_params:
            for param in node.args:
                if param in released_by and param not in resident:
                    problems.append(f"{node.name!r} releases {param.target!r} again ({released_by[param].name!r} "
                                    "already did, with no fetch between)")
                resident.pop(param, None)
                released_by[param] = node
        elif node.target is fetch_param:
            param = node.args[0]
            base = param.args[0].args[1 + param.args[1]] if param.target is operator.getitem else param
            resident[base] = node
        elif node.target is saved_to_host:
            if open_scope is not None:
                problems.append(f"{node.name!r} opens layer {node.args[0]}'s host-saved scope inside "
                                f"{open_scope.name!r}'s (layer {open_scope.args[0]}), which is not closed yet")
            open_scope = node
        elif node.target is saved_on_device:
            if node.args[0] is not open_scope:
                problems.append(f"{node.name!r} closes {node.args[0].name!r}'s host-saved scope, which is not the "
                                "open one")
            open_scope = None
        for arg in node.all_input_nodes:
            if arg.op == "call_function" and arg.target is fetch_param:
                base = arg.args[0]
                base = base.args[0].args[1 + base.args[1]] if base.target is operator.getitem else base
                if base in released_by and base not in resident:
                    problems.append(f"node {node.name!r} reads {base.target!r} after {released_by[base].name!r} "
                                    "released it, with no fetch_param bringing it back")
    if open_scope is not None:
        problems.append(f"{open_scope.name!r} saves layer {open_scope.args[0]}'s activations on the host and no "
                        "saved_on_device closes it")
    return problems


#: This module's graph ops (inserted only by the offload pass).
OFFLOAD_OPS = (fetch_param, prefetch_params, release_params, saved_to_host, saved_on_device)


def is_offload_op(target: Any) -> bool:
    """Whether ``target`` is one of this module's graph ops."""
    return target in OFFLOAD_OPS


__all__ = ["OFFLOAD_OPS", "ActivationScope", "OffloadedParams", "Transfer", "fetch_param", "host_like",
           "is_offload_op", "prefetch_params", "release_params", "resident", "saved_on_device", "saved_to_host",
           "schedule_problems"]
