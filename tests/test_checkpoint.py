"""Checkpoints (graphpass.save / load / load_into on torch.distributed.checkpoint).

The resharding matrix saves under one plan and world size after 2 steps, loads under another,
saves again right after the load, and trains one more step: the two checkpoints must be equal
bit for bit (every parameter, buffer and optimizer state, read whole in this process), and the
resumed step's loss equal to the uninterrupted run's. Loading copies bytes, so "bit for bit" is
exact; the resumed loss is compared at the parity tolerance (rtol 1e-5, see tests/test_dp.py),
since the two layouts sum the same products in another order.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import graphpass as gp
import zoo
from graphpass.runtime import checkpoint as ckpt

STEPS = 3  # the checkpoint is taken after STEPS - 1 steps


def _optimizer(name: str, params, lr: float | None = None):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr or 0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr or 1e-3, weight_decay=0.1)


def _compile(model_name: str, strategy: dict, seed: int):
    data = zoo.batches(model_name, STEPS)
    return zoo.compile(zoo.build(model_name, seed=seed), data[0], gp.Strategy(**strategy)), data


def _shape_of_layouts(dmodel) -> tuple[int, int]:
    """(most pieces one local tensor holds, most local tensors one key has): > 1 for fused
    tensor-parallel parts and for split operators' slices."""
    entries = dmodel.checkpoint_state()[0]
    per_key: dict[str, int] = {}
    for layout, _ in entries:
        per_key[layout.key] = per_key.get(layout.key, 0) + 1
    return max(len(layout.pieces) for layout, _ in entries), max(per_key.values())


def _train_then_save(model_name: str, strategy: dict, opt_name: str, path: str) -> tuple[float, tuple[int, int]]:
    """Rank function: STEPS - 1 steps, save, one more step; (the last step's loss, the shape of
    the layouts saved)."""
    dmodel, data = _compile(model_name, strategy, seed=0)
    opt = _optimizer(opt_name, dmodel.parameters())
    for batch in data[:-1]:
        dmodel.train_step(*batch)
        opt.step()
        opt.zero_grad()
    gp.save(dmodel, opt, path, extra={"step": STEPS - 1, "note": "from A"})
    loss = dmodel.train_step(*data[-1]).item()
    return loss, _shape_of_layouts(dmodel)


def _load_then_resume(model_name: str, strategy: dict, opt_name: str, path: str, again: str) -> tuple:
    """Rank function: another model's weights and another learning rate, then load (both must
    be replaced), save again, one step; (extra, the step's loss)."""
    dmodel, data = _compile(model_name, strategy, seed=1)
    opt = _optimizer(opt_name, dmodel.parameters(), lr=0.5)
    extra = gp.load(dmodel, opt, path)
    gp.save(dmodel, opt, again)
    loss = dmodel.train_step(*data[-1]).item()
    return extra, loss


def _run(rank_pool, world: int, fn, *args):
    if world == 1:  # in this process, without a process group
        return [fn(*args)]
    return rank_pool(world).run(fn, *args)


def _assert_same_checkpoint(a: str, b: str) -> None:
    first, second = ckpt.read(a), ckpt.read(b)
    tensors = sorted(k for k in first if isinstance(first[k], torch.Tensor))
    assert tensors == sorted(k for k in second if isinstance(second[k], torch.Tensor))
    assert any(k.startswith("optim.") for k in tensors), "no optimizer state was saved"
    for key in tensors:
        assert torch.equal(first[key], second[key]), f"{key} differs after load"
    assert first["optim.param_groups"] == second["optim.param_groups"]


# (model, strategy A, world A, strategy B, world B, optimizer): the matrix, each pair
# once, the optimizers alternating; fused_gpt's tp shards are one piece per fused part.
MATRIX = [
    ("gpt", dict(dp=2), 2, dict(dp=4, zero=3), 4, "sgd"),
    ("gpt", dict(dp=4, zero=3), 4, dict(), 1, "adamw"),
    ("hf_llama", dict(tp=2), 2, dict(dp=2), 2, "adamw"),
    ("gpt", dict(dp=2, tp=2, zero=3), 4, dict(tp=2, sequence_parallel=True), 2, "sgd"),
    ("gpt", dict(dp=2, zero=3, split=2), 2, dict(dp=2, zero=1), 2, "adamw"),  # split is defined with ZeRO-3
    ("gpt", dict(pp=2, microbatches=2), 2, dict(dp=2, tp=2), 4, "sgd"),
    ("gpt", dict(dp=2, tp=2), 4, dict(pp=2, microbatches=2), 2, "adamw"),
    ("fused_gpt", dict(tp=2), 2, dict(dp=2, zero=2), 2, "sgd"),
    # experts sharded over ep 2 and ZeRO over edp 2, loaded with experts whole and ZeRO-1 over dp
    ("moe_topk", dict(dp=4, ep=2, zero=3), 4, dict(dp=2, zero=1), 2, "adamw"),
    # HSDP (ZeRO inside pairs, replicated across them) to and from other layouts: every replica
    # holds the same shards, one of them saves each
    ("gpt", dict(dp=4, zero=3, dp_shard=2), 4, dict(dp=2, tp=2), 4, "adamw"),
    ("hf_llama", dict(dp=2, zero=2), 2, dict(dp=4, zero=1, dp_shard=2), 4, "sgd"),
    # offload: host masters (streamed, with ZeRO-3) saved and loaded like any stored tensor, to and
    # from other plans; the loaded masters reach the device copies before the resumed step
    ("gpt", dict(dp=2, zero=3, offload=("optimizer", "gradients", "parameters")), 2, dict(dp=2, tp=2), 4, "adamw"),
    ("hf_llama", dict(tp=2), 2, dict(dp=2, offload=("optimizer", "activations")), 2, "sgd"),
    ("gpt", dict(dp=4, offload=("optimizer",)), 4,
     dict(pp=2, microbatches=2, offload=("optimizer", "parameters"), offload_window=2), 2, "adamw"),
]


@pytest.mark.parametrize("model_name, a, world_a, b, world_b, opt_name", MATRIX,
                         ids=[f"{m}-{a}x{wa}-to-{b}x{wb}-{o}" for m, a, wa, b, wb, o in MATRIX])
def test_resharding_matrix(rank_pool, tmp_path, model_name, a, world_a, b, world_b, opt_name):
    path, again = str(tmp_path / "a"), str(tmp_path / "b")
    uninterrupted, (pieces, tensors) = _run(rank_pool, world_a, _train_then_save, model_name, a, opt_name, path)[0]
    if model_name == "fused_gpt":  # q, k and v: one piece each of the fused weight
        assert pieces == 3, pieces
    if "split" in a:  # a split weight is saved from its two slices
        assert tensors == 2, tensors
    extra, resumed = _run(rank_pool, world_b, _load_then_resume, model_name, b, opt_name, path, again)[0]
    assert extra == {"step": STEPS - 1, "note": "from A"}
    _assert_same_checkpoint(path, again)
    # Another layout sums the same products in another order: the parity tolerance.
    torch.testing.assert_close(resumed, uninterrupted, rtol=1e-5, atol=0)


def test_checkpoint_loads_into_the_plain_model(rank_pool, tmp_path):
    """A tp 2 x ZeRO-3 checkpoint of GPT (tied embedding and LM head, saved once) loads into the
    single-device model, which then computes the same loss as the compiled one."""
    path = str(tmp_path / "c")
    uninterrupted = _run(rank_pool, 4, _train_then_save, "gpt", dict(dp=2, tp=2, zero=3), "sgd", path)[0][0]
    model = zoo.build("gpt", seed=3)
    gp.load_into(model, path)
    assert model.lm_head.weight is model.wte.weight  # still tied
    saved = ckpt.read(path)
    assert "model.wte.weight" in saved and "model.lm_head.weight" not in saved  # tied: saved once
    state = model.state_dict()
    for key, value in saved.items():
        if key.startswith("model."):
            assert torch.equal(state[key[len("model."):]], value), key
    # The checkpoint is after STEPS - 1 steps; its model's next loss is the uninterrupted one
    # at the parity tolerance (one process sums in another order).
    loss = model(*zoo.batches("gpt", STEPS)[-1]).item()
    torch.testing.assert_close(loss, uninterrupted, rtol=1e-5, atol=0)


# ------------------------------------------------------------------ crash safety


def _save_then_die_saving_again(path: str) -> None:
    """Rank function: save after one step; after a second step save again, rank 1 exiting
    (as if killed) right after writing its first item."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as filesystem

    dmodel, data = _compile("gpt", dict(dp=2), seed=0)
    opt = _optimizer("sgd", dmodel.parameters())
    for step, batch in enumerate(data[:2]):
        dmodel.train_step(*batch)
        opt.step()
        opt.zero_grad()
        if step == 0:
            gp.save(dmodel, opt, path, extra={"step": 1})
    if dist.get_rank() == 1:
        write_item = filesystem._write_item

        def write_then_die(*args, **kwargs):
            result = write_item(*args, **kwargs)
            os._exit(3)
            return result

        filesystem._write_item = write_then_die  # the rank dies; the pool starts fresh ranks
    gp.save(dmodel, opt, path, extra={"step": 2})


def _load_where_one_rank_fails(path: str) -> str:
    """Rank 1 loads from a path with no checkpoint: every rank must raise, none may wait."""
    import torch.distributed as dist

    dmodel, _ = _compile("gpt", dict(dp=2), seed=0)
    try:
        gp.load(dmodel, None, path if dist.get_rank() == 0 else path + "-missing")
    except (gp.CheckpointError, FileNotFoundError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


@pytest.mark.timeout(300)
def test_a_load_failing_on_one_rank_fails_on_every_rank(rank_pool, tmp_path):
    pool = rank_pool(2)
    pool.run(_train_then_save, "gpt", dict(dp=2), "sgd", str(tmp_path / "ck"), timeout_s=120)
    said = pool.run(_load_where_one_rank_fails, str(tmp_path / "ck"), timeout_s=120)
    assert said[1].startswith("FileNotFoundError: no checkpoint at"), said
    assert said[0].startswith("CheckpointError: rank 1 failed: FileNotFoundError: no checkpoint at"), said


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(rank_pool, tmp_path):
    path = tmp_path / "ck"
    with pytest.raises(gp.RankError, match="rank 1"):
        rank_pool(2).run(_save_then_die_saving_again, str(path))
    partial = tmp_path / "ck.partial"
    assert partial.is_dir() and any(partial.iterdir()), "the interrupted save wrote nothing"
    with pytest.raises(gp.CheckpointError, match="not a complete checkpoint|incomplete save"):
        ckpt.resolve(partial)
    assert ckpt.read(path)["extra"] == {"step": 1}
    # The previous checkpoint is the model after one step: one process's, at the parity tolerance.
    _, ref_state, _ = _reference_after(1)
    model = zoo.build("gpt", seed=3)
    gp.load_into(model, path)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_state[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def _reference_after(steps: int):
    return zoo.train_reference("gpt", steps=steps)


# ------------------------------------------------------------------ single process: protocol, safety, bad input


def _tiny(path, *, extra=None, optimizer=True, value=1.0):
    """A checkpoint of one 4-element parameter ``w`` saved in this process; (param, optimizer)."""
    from graphpass.runtime.layout import HeldPieces, Piece

    w = torch.nn.Parameter(torch.full((4,), value))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.ones(4)
    opt.step()
    layout = HeldPieces("w", (4,), (4,), (Piece((0,), (slice(0, 4),)),))
    ckpt.save_state([(layout, w)], {}, opt if optimizer else None, path, extra=extra)
    return w, opt, layout


def test_killed_between_the_renames_the_old_checkpoint_is_read(tmp_path):
    path = tmp_path / "ck"
    _tiny(path, extra={"step": 1})
    os.replace(path, tmp_path / "ck.old")  # the save died after moving the previous one aside
    assert ckpt.resolve(path) == tmp_path / "ck.old"
    assert ckpt.read(path)["extra"] == {"step": 1}
    _tiny(path, extra={"step": 2}, value=2.0)  # the next save completes and clears it
    assert ckpt.resolve(path) == path and not (tmp_path / "ck.old").exists()
    assert not (tmp_path / "ck.partial").exists()
    assert ckpt.read(path)["extra"] == {"step": 2}


class _RunsCode:
    """Unpickling this with plain pickle writes a file: a stand-in for any code a crafted
    checkpoint could run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    path, marker = tmp_path / "ck", tmp_path / "ran.txt"
    _tiny(path)
    payload = pickle.dumps(_RunsCode(str(marker)))
    pickle.loads(payload)  # the payload is real: plain pickle runs it
    assert marker.exists()
    marker.unlink()
    (path / ".metadata").write_bytes(payload)
    with pytest.raises(gp.CheckpointError, match=r"builtins\.exec"):
        gp.load_into(torch.nn.Linear(4, 4), path)
    with pytest.raises(gp.CheckpointError, match=r"builtins\.exec"):
        ckpt.read(path)
    assert not marker.exists()


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path):
    path = tmp_path / "ck"
    _tiny(path)
    metadata = pickle.loads((path / ".metadata").read_bytes())  # our own, trusted here
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[index] = type(info)(relative_path="../../etc/passwd", offset=info.offset, length=info.length)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(gp.CheckpointError, match=r"names the data file '../../etc/passwd' outside the checkpoint"):
        ckpt.read(path)


def test_an_entry_that_would_run_code_is_refused(tmp_path, monkeypatch):
    path, marker = tmp_path / "ck", tmp_path / "ran.txt"
    # save refuses such an entry (tests/test_checkpoint_errors.py); a crafted checkpoint has it anyway.
    monkeypatch.setattr(ckpt, "encode_extra", lambda value, where="extra": value)
    _tiny(path, extra={"note": _RunsCode(str(marker))})
    with pytest.raises(gp.CheckpointError, match="'extra'"):
        ckpt.read(path)
    assert not marker.exists()


def test_bad_checkpoints_and_paths_are_named(tmp_path):
    # No checkpoint at all, and an interrupted save next to it.
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nowhere"):
        ckpt.read(tmp_path / "nowhere")
    (tmp_path / "nowhere.partial").mkdir()
    with pytest.raises(FileNotFoundError, match="nowhere.partial.*interrupted save"):
        ckpt.read(tmp_path / "nowhere")
    # A directory DCP committed but graphpass did not (killed after .metadata).
    path = tmp_path / "ck"
    _tiny(path)
    (path / ckpt.MARKER).unlink()
    with pytest.raises(gp.CheckpointError, match="incomplete save"):
        ckpt.read(path)
    # Saving over a directory that is not a checkpoint.
    other = tmp_path / "data"
    other.mkdir()
    (other / "keep.txt").write_text("user data")
    with pytest.raises(gp.CheckpointError, match="is not a complete graphpass checkpoint"):
        _tiny(other)
    assert (other / "keep.txt").read_text() == "user data"


def test_checkpoint_of_another_model_names_the_keys_and_shapes(tmp_path):
    path = tmp_path / "ck"
    _tiny(path)
    with pytest.raises(gp.CheckpointError, match=r"not of this model: 2 of the model's keys .*weight, bias.*; 1 of its keys .*\(w\)"):
        gp.load_into(torch.nn.Linear(4, 4), path)

    class W(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(5))

    with pytest.raises(gp.CheckpointError, match=r"'w' has shape \(4,\) there but \(5,\) in this model"):
        gp.load_into(W(), path)


def test_optimizer_mismatches_are_named(tmp_path):
    path = tmp_path / "ck"
    w, opt, layout = _tiny(path, optimizer=False)
    with pytest.raises(gp.CheckpointError, match="no optimizer state.*optimizer=None"):
        ckpt.load_state([(layout, w)], {}, ["w"], opt, path)
    stranger = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"param_groups\[0\] holds a tensor of shape \(3,\).*dmodel.parameters"):
        ckpt.save_state([(layout, w)], {}, torch.optim.SGD([stranger], lr=0.1), tmp_path / "other")
    # Saved with two param groups, loaded into an optimizer with one.
    from graphpass.runtime.layout import HeldPieces, Piece

    v = torch.nn.Parameter(torch.zeros(2))
    v_layout = HeldPieces("v", (2,), (2,), (Piece((0,), (slice(0, 2),)),))
    entries = [(layout, w), (v_layout, v)]
    ckpt.save_state(entries, {}, torch.optim.SGD([{"params": [w]}, {"params": [v]}], lr=0.1), path)
    with pytest.raises(gp.CheckpointError, match="2 optimizer param groups, this optimizer 1"):
        ckpt.load_state(entries, {}, ["w", "v"], torch.optim.SGD([w, v], lr=0.1), path)


def test_loading_restores_the_optimizer_state_and_settings(tmp_path):
    path = tmp_path / "ck"
    w, opt, layout = _tiny(path, extra={"step": 1})
    fresh = torch.nn.Parameter(torch.zeros(4))
    fresh_opt = torch.optim.SGD([fresh], lr=0.7, momentum=0.5)
    extra = ckpt.load_state([(layout, fresh)], {}, ["w"], fresh_opt, path)
    assert extra == {"step": 1}
    assert torch.equal(fresh.detach(), w.detach())
    assert torch.equal(fresh_opt.state[fresh]["momentum_buffer"], opt.state[w]["momentum_buffer"])
    assert fresh_opt.param_groups[0]["lr"] == 0.1 and fresh_opt.param_groups[0]["momentum"] == 0.9
