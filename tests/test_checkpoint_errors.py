"""Checkpoint ``extra`` round-trips and checkpoint failures (issue 37, points 3 and 5).

``extra`` holds the resume metadata people keep with a checkpoint (numpy values and RNG states,
``argparse.Namespace``, config dataclasses, dates): whatever ``gp.save`` accepts, ``gp.load``
reads back without running code; anything else is refused before a byte is written, naming its
place and type, and the previous checkpoint stays. Every way a save or load fails (damaged or
truncated files, a flipped byte, another optimizer class, DCP's own errors) is a
``gp.CheckpointError`` naming the checkpoint, the file and the cause, on 1 and 2 ranks.

Most cases run in this process on a one-parameter checkpoint (``_tiny``); the 2-rank cases run
inside one launch of a compiled GPT (``_two_rank_cases``), since a launch costs seconds.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import enum
import errno
import io
import json
import os
import pathlib
import random
import re
import types

import numpy as np
import pytest
import torch

import graphpass as gp
from graphpass.runtime import checkpoint as ckpt
from graphpass.runtime.checkpoint_extra import TAG
from graphpass.runtime.layout import HeldPieces, Piece

W = HeldPieces("w", (4,), (4,), (Piece((0,), (slice(0, 4),)),))


def _tiny(path, *, extra=None, optimizer="sgd", value=1.0, lr=0.1):
    """A checkpoint of one 4-element parameter ``w`` after one step, saved in this process."""
    w = torch.nn.Parameter(torch.full((4,), value))
    opt = (torch.optim.SGD([w], lr=lr, momentum=0.9) if optimizer == "sgd" else
           torch.optim.AdamW([w], lr=lr) if optimizer == "adamw" else None)
    if opt is not None:
        w.grad = torch.ones(4)
        opt.step()
    ckpt.save_state([(W, w)], {}, opt, path, extra=extra)
    return w, opt


def _load(path, optimizer="sgd"):
    w = torch.nn.Parameter(torch.zeros(4))
    opt = (torch.optim.SGD([w], lr=0.5, momentum=0.5) if optimizer == "sgd" else
           torch.optim.AdamW([w], lr=0.5) if optimizer == "adamw" else None)
    return ckpt.load_state([(W, w)], {}, ["w"], opt, path), w, opt


def _as_format_1(path) -> None:
    """Rewrite ``path``'s graphpass.json as format 1 wrote it: no file sums, the optimizer's bare
    class name. (``extra`` here is plain, which format 1 saved as it is, as format 2 does.)"""
    marker = pathlib.Path(path) / ckpt.MARKER
    info = json.loads(marker.read_text())
    del info["files"]
    info["format"] = 1
    info["optimizer"] = info["optimizer"].rsplit(".", 1)[-1]
    marker.write_text(json.dumps(info))


def _data_file(path) -> pathlib.Path:
    (file,) = [f for f in pathlib.Path(path).iterdir() if f.suffix == ".distcp" and f.stat().st_size]
    return file


# ------------------------------------------------------------------ point 3: extra round-trips


@dataclasses.dataclass
class Optim:
    name: str = "adamw"
    betas: tuple = (0.9, 0.95)


@dataclasses.dataclass
class Config:
    lr: float = 3e-4
    steps: int = 100
    started: datetime.datetime = datetime.datetime(2025, 1, 2, 3, 4, 5, 678)
    optim: Optim = dataclasses.field(default_factory=Optim)


def _rng_states():
    random.seed(3)
    np.random.seed(3)
    return {"random": random.getstate(), "numpy": np.random.get_state(),
            "numpy_generator": np.random.default_rng(3).bit_generator.state, "torch": torch.get_rng_state()}


EXTRAS = {
    "numpy float32": np.float32(1.5),
    "numpy int64": np.int64(-7),
    "numpy bool": np.bool_(True),
    "numpy datetime64": np.datetime64("2025-01-02T03:04"),
    "numpy array": np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2],  # not contiguous
    "numpy uint32 array": np.arange(5, dtype=np.uint32),
    "np.random.get_state()": np.random.RandomState(0).get_state(),
    "Generator state": np.random.default_rng(0).bit_generator.state,  # 128-bit ints
    "random.getstate()": random.Random(0).getstate(),
    "torch.get_rng_state()": torch.get_rng_state(),
    "argparse.Namespace": argparse.Namespace(lr=0.1, layers=[1, 2], out=pathlib.Path("/tmp/run")),
    "SimpleNamespace": types.SimpleNamespace(a=1),
    "dataclass": Config(),
    "datetime": datetime.datetime(2025, 1, 2, 3, 4, 5, 6),
    "aware datetime": datetime.datetime(2025, 1, 2, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
    "date": datetime.date(2025, 1, 2),
    "time": datetime.time(3, 4, 5),
    "timedelta": datetime.timedelta(days=1, seconds=2, microseconds=3),
    "path": pathlib.Path("/data/shard-3"),
    "pure path": pathlib.PureWindowsPath("C:/data"),
    "tuple": (1, (2.0, "three"), None),
    "set": {1, "two", (3, 4)},
    "frozenset": frozenset({5}),
    "OrderedDict": collections.OrderedDict([("b", 1), ("a", np.int32(2))]),
    "a dict using graphpass's tag": {TAG: "mine", 3: "x"},
    "plain": {"step": 7, "loss": 1.25, "big": 2 ** 100, "z": 1 + 2j, "b": b"\x00", "dtype": torch.bfloat16,
              "size": torch.Size([2, 3]), "device": torch.device("cpu"), "none": None},
    "tensor": torch.arange(6.0).reshape(2, 3),
}


def _same(saved, loaded, where="extra") -> None:
    """``loaded`` is ``saved`` read back: equal, and of the same type, all the way down (a
    dataclass as a SavedDataclass of its fields)."""
    if dataclasses.is_dataclass(saved):
        assert isinstance(loaded, gp.SavedDataclass), f"{where}: {type(loaded)}"
        assert loaded.dataclass_name == f"{type(saved).__module__}.{type(saved).__qualname__}", where
        fields = {f.name: getattr(saved, f.name) for f in dataclasses.fields(saved)}
        assert list(vars(loaded)) == list(fields), where
        for name, value in fields.items():
            _same(value, getattr(loaded, name), f"{where}.{name}")
        return
    assert type(loaded) is type(saved), f"{where}: {type(saved)} came back as {type(loaded)}"
    if isinstance(saved, torch.Tensor):
        assert saved.dtype == loaded.dtype and torch.equal(saved, loaded), where
    elif isinstance(saved, np.ndarray):
        assert saved.dtype == loaded.dtype and np.array_equal(saved, loaded), where
        assert loaded.flags.writeable, where
    elif isinstance(saved, (list, tuple)):
        assert len(saved) == len(loaded), where
        for i, (a, b) in enumerate(zip(saved, loaded)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(saved, dict):
        assert list(saved) == list(loaded), where
        for key in saved:
            _same(saved[key], loaded[key], f"{where}[{key!r}]")
    elif isinstance(saved, (argparse.Namespace, types.SimpleNamespace)):
        _same(vars(saved), vars(loaded), where)
    else:
        assert saved == loaded, f"{where}: {saved!r} came back as {loaded!r}"
        if isinstance(saved, datetime.datetime):
            assert saved.utcoffset() == loaded.utcoffset(), where


@pytest.mark.parametrize("name", list(EXTRAS))
def test_resume_metadata_in_extra_round_trips(tmp_path, name):
    extra = {"value": EXTRAS[name], "step": 3}
    _tiny(tmp_path / "ck", extra=extra)
    loaded, _, _ = _load(tmp_path / "ck")
    _same(extra, loaded)
    _same(extra, ckpt.read(tmp_path / "ck")["extra"])
    # What a load returned saves again and reads back the same (a resumed run saving its extra).
    _tiny(tmp_path / "again", extra=loaded)
    _same(extra, _load(tmp_path / "again")[0])


def test_a_resumed_run_draws_the_same_random_numbers_and_learning_rates(tmp_path):
    """The README's resume recipe: RNG states and the scheduler's state in ``extra``; the
    scheduler built before ``load``, its state loaded after it."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=10)
    for _ in range(3):
        w.grad = torch.ones(4)
        opt.step()
        sched.step()
    states = _rng_states()
    ckpt.save_state([(W, w)], {}, opt, tmp_path / "ck", extra={"rng": states, "scheduler": sched.state_dict()})
    expected = (random.random(), np.random.rand(), torch.rand(1))
    lrs = []
    for _ in range(3):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    fresh = torch.nn.Parameter(torch.zeros(4))
    fresh_opt = torch.optim.SGD([fresh], lr=0.7, momentum=0.9)
    fresh_sched = torch.optim.lr_scheduler.OneCycleLR(fresh_opt, max_lr=0.3, total_steps=10)
    extra = ckpt.load_state([(W, fresh)], {}, ["w"], fresh_opt, tmp_path / "ck")
    fresh_sched.load_state_dict(extra["scheduler"])
    random.setstate(extra["rng"]["random"])
    np.random.set_state(extra["rng"]["numpy"])
    torch.set_rng_state(extra["rng"]["torch"])
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(1), expected[2])
    resumed = []
    for _ in range(3):
        fresh_opt.step()
        fresh_sched.step()
        resumed.append(fresh_opt.param_groups[0]["lr"])
    assert resumed == lrs


def test_numpy_learning_rates_in_param_groups_round_trip(tmp_path):
    """A schedule computed with numpy leaves numpy floats in the param groups, which load used
    to refuse like numpy values in extra."""
    w, opt = _tiny(tmp_path / "ck", lr=np.float64(0.25))
    _, _, fresh_opt = _load(tmp_path / "ck")
    assert fresh_opt.param_groups[0]["lr"] == 0.25 and type(fresh_opt.param_groups[0]["lr"]) is np.float64


class Color(enum.Enum):
    RED = 1


class Opaque:
    pass


class MyFloat(float):
    pass


@dataclasses.dataclass
class WithCallback:
    lr: float = 0.1
    on_step: object = print


REFUSED = [
    ({"fn": lambda: 1}, "extra['fn'] is a function"),
    ({"cfg": WithCallback()}, "extra['cfg'].on_step is a builtin_function_or_method"),
    ({"items": [1, Opaque()]}, f"extra['items'][1] is a {__name__}.Opaque"),
    ({"color": Color.RED}, f"extra['color'] is a {__name__}.Color"),
    ({"args": argparse.Namespace(log=io.StringIO())}, "extra['args'].log is a _io.StringIO"),
    ({"when": {datetime.date(2025, 1, 1): 1}},
     "extra['when'] has a key or member datetime.date(2025, 1, 1) of type datetime.date"),
    ({"a": np.array([object()])}, "extra['a'] is a numpy array of dtype object"),
    ({"sub": MyFloat(1.0)}, f"extra['sub'] is a {__name__}.MyFloat"),
    ({"t": torch.nn.Linear(2, 2)}, "extra['t'] is a torch.nn.modules.linear.Linear"),
]


def _cyclic():
    loop: list = [1]
    loop.append(loop)
    return {"loop": loop}


REFUSED.append((_cyclic(), "extra['loop'][1] contains itself"))


@pytest.mark.parametrize("extra, said", REFUSED, ids=[said.split()[0] for _, said in REFUSED])
def test_an_unsupported_value_in_extra_is_refused_before_writing(tmp_path, extra, said):
    path = tmp_path / "ck"
    _tiny(path, extra={"step": 1})
    before = sorted((f.name, f.read_bytes()) for f in path.iterdir())
    refused = re.escape(f"gp.save to {str(path)!r}: {said}") + ".*Nothing was written"
    with pytest.raises(gp.CheckpointError, match=refused):
        _tiny(path, extra=extra, value=2.0)
    assert sorted((f.name, f.read_bytes()) for f in path.iterdir()) == before
    assert not (tmp_path / "ck.partial").exists()
    assert _load(path)[0] == {"step": 1}


# ------------------------------------------------------------------ point 5: every failure named


def _assert_names(error: BaseException, *parts) -> str:
    """``error`` is a CheckpointError (an Exception) whose message names each of ``parts``."""
    assert isinstance(error, gp.CheckpointError) and isinstance(error, Exception), type(error)
    text = str(error)
    for part in parts:
        assert str(part) in text, f"{part!r} not in {text!r}"
    return text


def _every_loader(path):
    """Each way to read a checkpoint: (name, call)."""
    return [("gp.load", lambda: _load(path)), ("gp.load_into", lambda: gp.load_into(_W(), path)),
            ("read", lambda: ckpt.read(path))]


class _W(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))


def _damage(path, how: str) -> str:
    """Damage checkpoint ``path`` as ``how`` says; the name of the file damaged."""
    path = pathlib.Path(path)
    metadata, data = path / ".metadata", _data_file(path)
    if how == "garbage metadata":
        metadata.write_bytes(b"\x80\x04garbage that is no pickle" + bytes(range(40)))
        return ".metadata"
    if how == "truncated metadata":
        metadata.write_bytes(metadata.read_bytes()[:-40])
        return ".metadata"
    if how == "truncated data":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        return data.name
    if how == "flipped byte":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
        return data.name
    if how == "missing data":
        data.unlink()
        return data.name
    raise ValueError(how)


DAMAGE = ["garbage metadata", "truncated metadata", "truncated data", "flipped byte", "missing data"]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_file_is_named_by_every_loader(tmp_path, how):
    path = tmp_path / "ck"
    _tiny(path)
    file = _damage(path, how)
    for name, load in _every_loader(path):
        with pytest.raises(gp.CheckpointError) as caught:
            load()
        text = _assert_names(caught.value, f"checkpoint {str(path)!r}", file)
        if how != "missing data":
            assert re.search("truncated|CRC-32|bytes but", text), (name, text)


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_format_1_checkpoint_without_sums_is_named(tmp_path, how):
    """Format 1 recorded no sums: the damage shows when the file is read, named with its cause;
    a flipped byte in a tensor's payload goes unseen there (what the sums are for)."""
    path = tmp_path / "ck"
    _tiny(path, extra={"step": 1})
    _as_format_1(path)
    assert _load(path)[0] == {"step": 1}  # format 1 still loads
    file = _damage(path, how)
    for name, load in _every_loader(path):
        if how == "flipped byte":
            continue
        with pytest.raises(gp.CheckpointError) as caught:
            load()
        text = _assert_names(caught.value, str(path), file)
        if how.startswith("truncated"):
            assert "truncated" in text, (name, text)
        if how == "garbage metadata":
            assert "damaged or truncated" in text, (name, text)


def test_a_damaged_or_newer_graphpass_json_is_named(tmp_path):
    path = tmp_path / "ck"
    _tiny(path)
    marker = path / ckpt.MARKER
    good = marker.read_text()
    marker.write_text(good[: len(good) // 2])
    with pytest.raises(gp.CheckpointError) as caught:
        _load(path)
    _assert_names(caught.value, str(marker), "JSONDecodeError")
    marker.write_text(json.dumps({**json.loads(good), "format": ckpt.FORMAT + 1}))
    with pytest.raises(gp.CheckpointError) as caught:
        ckpt.read(path)
    _assert_names(caught.value, str(path), f"format {ckpt.FORMAT + 1}", "update graphpass")


def test_an_adamw_checkpoint_is_refused_by_sgd_naming_both(tmp_path):
    path = tmp_path / "ck"
    _tiny(path, optimizer="adamw")
    with pytest.raises(gp.CheckpointError) as caught:
        _load(path, optimizer="sgd")
    _assert_names(caught.value, str(path), "torch.optim.adamw.AdamW", "torch.optim.sgd.SGD", ckpt.MARKER)
    _as_format_1(path)  # format 1 recorded the class name alone
    with pytest.raises(gp.CheckpointError) as caught:
        _load(path, optimizer="sgd")
    _assert_names(caught.value, str(path), "AdamW", "torch.optim.sgd.SGD")
    extra, w, opt = _load(path, optimizer="adamw")
    assert set(opt.state[w]) == {"step", "exp_avg", "exp_avg_sq"}
    _load(path, optimizer=None)  # the model alone


def test_a_save_that_dcp_cannot_write_is_named_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    _tiny(path, extra={"step": 1})
    # <path>.partial is a file: DCP cannot make its directory.
    (tmp_path / "ck.partial").write_text("in the way")
    with pytest.raises(gp.CheckpointError) as caught:
        _tiny(path, extra={"step": 2})
    _assert_names(caught.value, f"checkpoint {str(path)!r}", str(tmp_path / "ck.partial"), "saving")
    assert _load(path)[0] == {"step": 1}
    (tmp_path / "ck.partial").unlink()
    # The disk fills while DCP writes a data file.
    import torch.distributed.checkpoint.filesystem as filesystem

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesystem, "_write_item", disk_full)
    with pytest.raises(gp.CheckpointError) as caught:
        _tiny(path, extra={"step": 2})
    text = _assert_names(caught.value, str(path), "No space left on device", "raised at")
    assert "ranks:dict_keys" not in text
    monkeypatch.undo()
    assert _load(path)[0] == {"step": 1}


def test_a_file_record_holds_the_files_size_and_crc32(tmp_path):
    """The record a load checks against (its cost is measured in the closing note, not here:
    tests never assert on wall time)."""
    import zlib

    file = tmp_path / "big"
    data = os.urandom(3 << 20)
    file.write_bytes(data)
    record = ckpt.file_record(file)
    assert record == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}, record


# ------------------------------------------------------------------ 2 ranks: one launch, many cases


def _two_rank_cases(root: str) -> dict[str, str]:
    """Rank function: a compiled GPT (dp 2) saved and loaded through every failure; what each
    case raised on this rank ("ok" where it loaded)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as filesystem

    import zoo

    rank = dist.get_rank()
    data = zoo.batches("gpt", 2)
    dmodel = zoo.compile(zoo.build("gpt", seed=0), data[0], gp.Strategy(dp=2))
    opt = torch.optim.AdamW(dmodel.parameters(), lr=1e-3)
    dmodel.train_step(*data[0])
    opt.step()
    opt.zero_grad()
    said: dict[str, str] = {}

    def attempt(case: str, fn) -> None:
        try:
            fn()
            said[case] = "ok"
        except gp.CheckpointError as exc:
            said[case] = f"CheckpointError: {exc}"
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            said[case] = f"{type(exc).__name__} (not a CheckpointError): {exc}"

    def on_rank_0(fn) -> None:
        if rank == 0:
            fn()
        dist.barrier()

    # Every issue type in extra, through gp.save and gp.load on 2 ranks.
    extra = {"step": 1, "cfg": Config(), "args": argparse.Namespace(lr=0.1), "np": np.float32(0.5),
             "when": datetime.datetime(2025, 1, 2), "rng": _rng_states()}
    path = os.path.join(root, "ck")
    gp.save(dmodel, opt, path, extra=extra)
    loaded = gp.load(dmodel, opt, path)
    try:
        _same(extra, loaded)
        said["round trip"] = "ok"
    except AssertionError as exc:
        said["round trip"] = f"AssertionError: {exc}"
    # An unsupported value on rank 0 (extra is rank 0's): both ranks refuse, nothing written.
    attempt("unsupported extra", lambda: gp.save(dmodel, opt, path, extra={"fn": print} if rank == 0 else None))
    attempt("intact after refusal", lambda: gp.load(dmodel, opt, path))
    attempt("sgd", lambda: gp.load(dmodel, torch.optim.SGD(dmodel.parameters(), lr=0.1, momentum=0.9), path))

    # DCP fails on rank 1 alone: the disk fills while it writes.
    write_item = filesystem._write_item

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if rank == 1:
        filesystem._write_item = disk_full
    try:
        attempt("disk full on rank 1", lambda: gp.save(dmodel, opt, path, extra={"step": 2}))
    finally:
        filesystem._write_item = write_item
    attempt("intact after disk full", lambda: said.__setitem__("step", str(gp.load(dmodel, opt, path)["step"])))

    # Rank 1's data file: its sum was taken on rank 1 and recorded by rank 0.
    rank_1_file = os.path.join(path, "__1_0.distcp")
    said["rank 1 wrote"] = str(os.path.getsize(rank_1_file))
    original = open(rank_1_file, "rb").read()
    dist.barrier()  # both ranks have read the file before rank 0 rewrites it (opening it truncates)

    def flip() -> None:
        raw = bytearray(original)
        raw[len(raw) // 3] ^= 0x10
        open(rank_1_file, "wb").write(bytes(raw))

    on_rank_0(flip)
    attempt("flipped byte", lambda: gp.load(dmodel, opt, path))
    on_rank_0(lambda: open(rank_1_file, "wb").write(original[: len(original) // 2]))
    attempt("truncated data", lambda: gp.load(dmodel, opt, path))
    on_rank_0(lambda: open(rank_1_file, "wb").write(original))
    metadata = os.path.join(path, ".metadata")
    good_metadata = open(metadata, "rb").read()
    on_rank_0(lambda: open(metadata, "wb").write(b"garbage" * 10))
    attempt("garbage metadata", lambda: gp.load(dmodel, opt, path))
    on_rank_0(lambda: open(metadata, "wb").write(good_metadata))
    attempt("repaired", lambda: gp.load(dmodel, opt, path))
    return said


@pytest.fixture(scope="module")
def two_ranks(rank_pool, tmp_path_factory):
    root = tmp_path_factory.mktemp("two_ranks")
    return root / "ck", rank_pool(2).run(_two_rank_cases, str(root), timeout_s=240)


@pytest.mark.timeout(400)
def test_two_ranks_round_trip_extra_and_refuse_an_unsupported_value_together(two_ranks):
    path, said = two_ranks
    for rank in (0, 1):
        assert said[rank]["round trip"] == "ok", said[rank]
        assert said[rank]["intact after refusal"] == "ok", said[rank]
    refused = f"CheckpointError: gp.save to {str(path)!r}: extra['fn'] is a builtin_function_or_method"
    assert said[0]["unsupported extra"].startswith(refused), said[0]
    assert said[1]["unsupported extra"].startswith(f"CheckpointError: rank 0 failed: {refused}"), said[1]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case, parts", [
    ("sgd", ["torch.optim.adamw.AdamW", "torch.optim.sgd.SGD"]),
    ("disk full on rank 1", ["rank 1", "No space left on device", "saving"]),
    ("flipped byte", ["__1_0.distcp", "CRC-32"]),
    ("truncated data", ["__1_0.distcp", "truncated"]),
    ("garbage metadata", [".metadata", "bytes but"]),
])
def test_two_ranks_name_the_checkpoint_the_file_and_the_cause(two_ranks, case, parts):
    path, said = two_ranks
    for rank in (0, 1):
        text = said[rank][case]
        assert text.startswith("CheckpointError: "), (rank, text)
        for part in [str(path), *parts]:
            assert part in text, (rank, part, text)
        assert "ranks:dict_keys" not in text, text


@pytest.mark.timeout(400)
def test_two_ranks_keep_the_previous_checkpoint_through_a_failed_save(two_ranks):
    _, said = two_ranks
    for rank in (0, 1):
        assert said[rank]["intact after disk full"] == "ok" and said[rank]["step"] == "1", said[rank]
        assert said[rank]["repaired"] == "ok", said[rank]
        assert int(said[rank]["rank 1 wrote"]) > 0, said[rank]
