"""Checkpoints: saved at one tensor-parallel degree, loaded bit-identical at another."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor

import tpfn
from tests.models import full
from tests.ranks import mesh
from tests.test_on_shards import GatedMLP
from tpfn import Replicate, checkpoint, colwise, prepare_in, prepare_out, replicate, rowwise

PLAN = {"gate_up": colwise(parts=2), "down": rowwise()}


def _model(tp: int | None):
    torch.manual_seed(0)
    model = GatedMLP(dim=8, hidden=12)
    if tp:
        tpfn.parallelize(model, mesh(tp), PLAN)
    return model


def _train(model, opt, steps, seed):
    torch.manual_seed(seed)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full_state(model, opt) -> dict:
    """Parameters and optimizer state, gathered, by parameter name."""
    out = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.state[p].items():
            out[f"{n}.{k}"] = full(v).clone() if isinstance(v, torch.Tensor) else v
    return out


def _save(path):
    model = _model(dist.get_world_size())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, 2, seed=1)
    checkpoint.save(path, model, opt)
    state, exported = _full_state(model, opt), checkpoint.full_state_dict(model)
    later = _train(model, opt, 2, seed=2)  # where the loss goes next, uninterrupted
    return state, later, exported


def _load(path, tp):
    model = _model(tp)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    checkpoint.load(path, model, opt)
    state = _full_state(model, opt)
    return state, _train(model, opt, 2, seed=2)


def _same(a: dict, b: dict) -> list:
    return [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor)
                                 else a[k] == b[k])]


def test_save_at_tp2_load_at_tp2_tp1_and_tp4(ranks2, ranks4, tmp_path):
    path = str(tmp_path / "ckpt")
    (saved, later, exported), _ = ranks2.run(_save, path)
    assert os.listdir(tmp_path) == ["ckpt"]
    for tp, ranks in ((2, ranks2), (None, ranks2), (4, ranks4)):
        for state, continued in ranks.run(_load, path, tp):
            assert _same(saved, state) == [], f"tp={tp}"
            # The loss continues where it stopped: bit for bit at the same degree, to float
            # rounding (other reduction orders) at another.
            if tp == 2:
                assert continued == later
            else:
                assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(continued, later)), tp
    # The export is the gathered model, bit for bit, and plain tensors.
    assert all(not isinstance(v, DTensor) for v in exported.values())
    assert _same({k: saved[k] for k in exported}, exported) == []


def _interrupted(path):
    model = _model(2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, 1, seed=1)
    checkpoint.save(path, model, opt)
    first = _full_state(model, opt)
    _train(model, opt, 1, seed=2)
    real_save = dcp.save

    def crash(state, checkpoint_id):
        real_save({"model": state["model"]}, checkpoint_id=checkpoint_id)  # half written
        raise KeyboardInterrupt("killed while writing")

    dcp.save = crash
    try:
        checkpoint.save(path, model, opt)
    except KeyboardInterrupt:
        pass
    finally:
        dcp.save = real_save
    dist.barrier()
    fresh = _model(2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    checkpoint.load(path, fresh, fresh_opt)
    return _same(first, _full_state(fresh, fresh_opt))


def test_an_interrupted_save_leaves_the_previous_checkpoint_loadable(ranks2, tmp_path):
    assert ranks2.run(_interrupted, str(tmp_path / "ckpt")) == [[], []]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.partial"]


def test_a_swap_cut_between_its_renames_still_loads(tmp_path):
    model = nn.Linear(3, 3)
    checkpoint.save(tmp_path / "ckpt", model)
    os.rename(tmp_path / "ckpt", tmp_path / "ckpt.previous")   # as if killed mid-swap
    fresh = nn.Linear(3, 3)
    checkpoint.load(tmp_path / "ckpt", fresh)
    assert torch.equal(fresh.weight, model.weight)
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nowhere"):
        checkpoint.load(tmp_path / "nowhere", fresh)


def _save_plain(path):
    model = _model(None)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, 2, seed=1)
    checkpoint.save(path, model, opt)
    return _full_state(model, opt)


def test_a_plain_checkpoint_loads_into_packed_shards(ranks2, tmp_path):
    path = str(tmp_path / "plain")
    saved, _ = ranks2.run(_save_plain, path)
    for state, _ in ranks2.run(_load, path, 2):
        assert _same(saved, state) == []


# Issue 13: every packing of the fused gate_up loads into every other, at any degree.
# "packed" stores gate_up as its 2 parts; the others store it whole.
LAYOUTS = {
    "packed": PLAN,                                                      # Shard(0, parts=2)
    "plain": {"gate_up": colwise() >> prepare_out(Replicate())},         # Shard(0)
    "replicated": {"gate_up": prepare_in(Replicate()) >> replicate() >> prepare_out(Replicate())},
    "unparallelized": None,
}


def _laid_out(layout: str, seed: int):
    torch.manual_seed(seed)
    model = GatedMLP(dim=8, hidden=12)
    if LAYOUTS[layout] is not None and dist.is_initialized():
        tpfn.parallelize(model, mesh(dist.get_world_size()), LAYOUTS[layout])
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _save_layouts(directory):
    """Each layout, trained a step, saved to ``directory/LAYOUT-tpN``; its full state."""
    saved = {}
    for layout in LAYOUTS:
        model, opt = _laid_out(layout, seed=0)
        # The export is the module's own state: the true full tensors, as plain tensors.
        assert _same(_laid_out("unparallelized", seed=0)[0].state_dict(),
                     checkpoint.full_state_dict(model)) == [], layout
        _train(model, opt, 1, seed=1)
        checkpoint.save(os.path.join(directory, f"{layout}-tp{dist.get_world_size()}"), model, opt)
        saved[layout] = _full_state(model, opt)
        saved[layout]["exported"] = checkpoint.full_state_dict(model)
    return saved


def _load_layouts(directory, saved_tp):
    """Every checkpoint of ``_save_layouts`` at ``saved_tp`` loaded into every layout."""
    loaded = {}
    for src in LAYOUTS:
        for dst in LAYOUTS:
            model, opt = _laid_out(dst, seed=2)  # other numbers than the saved ones
            checkpoint.load(os.path.join(directory, f"{src}-tp{saved_tp}"), model, opt)
            loaded[src, dst] = _full_state(model, opt)
    return loaded


def _checked(saved: dict, loaded: dict, where: str) -> list:
    """The (source, target, key) whose loaded value is not the saved one, bit for bit."""
    wrong = []
    for (src, dst), state in loaded.items():
        expected = {k: v for k, v in saved[src].items() if k != "exported"}
        assert set(state) == set(expected), (where, src, dst)
        wrong += [(where, src, dst, k) for k in _same(expected, state)]
    return wrong


def test_every_packing_loads_into_every_other_at_tp1_2_and_4(ranks2, ranks4, tmp_path):
    directory = str(tmp_path)
    saved = {2: ranks2.run(_save_layouts, directory)[0], 4: ranks4.run(_save_layouts, directory)[0]}
    for tp, states in saved.items():
        for layout, state in states.items():  # the export is still the gathered model
            exported = state["exported"]
            assert all(not isinstance(v, DTensor) for v in exported.values())
            assert _same({k: state[k] for k in exported}, exported) == [], (tp, layout)
    for tp in (2, 4):  # packed: stored as its parts; the others whole
        for layout in LAYOUTS:
            keys = dcp.FileSystemReader(os.path.join(directory, f"{layout}-tp{tp}")) \
                .read_metadata().state_dict_metadata
            assert ("model.gate_up.weight.part1_of_2_dim0" in keys) == (layout == "packed")
            assert ("model.gate_up.weight" in keys) == (layout != "packed")
    wrong = []
    for saved_tp in (2, 4):
        for tp, ranks in ((2, ranks2), (4, ranks4)):
            wrong += _checked(saved[saved_tp], ranks.run(_load_layouts, directory, saved_tp)[0],
                              f"tp{saved_tp}->tp{tp}")
        # One process, no process group: a plain module.
        for src in LAYOUTS:
            model, opt = _laid_out("unparallelized", seed=2)
            checkpoint.load(os.path.join(directory, f"{src}-tp{saved_tp}"), model, opt)
            wrong += _checked(saved[saved_tp], {(src, "one process"): _full_state(model, opt)},
                              f"tp{saved_tp}->1")
    assert wrong == []


def _save_packed(path):
    checkpoint.save(path, _laid_out("packed", seed=0)[0])


def test_parts_that_do_not_make_the_model_s_tensor_are_refused_by_name(ranks2, tmp_path):
    path = str(tmp_path / "packed")
    ranks2.run(_save_packed, path)
    smaller = GatedMLP(dim=8, hidden=10)
    with pytest.raises(ValueError, match=r"the checkpoint holds 'model.gate_up.weight' as 2 parts "
                                         r"of shapes \[\(12, 8\), \(12, 8\)\] \(along dim 0\), which "
                                         r"do not make the model's \(20, 8\): load it into a model "
                                         r"of the architecture that saved it"):
        checkpoint.load(path, smaller)

