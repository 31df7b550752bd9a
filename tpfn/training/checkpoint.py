"""Checkpoints through ``torch.distributed.checkpoint``, loadable at any tensor-parallel degree.

Each rank writes the shards it holds; the checkpoint records every tensor's global shape
and layout, so it loads into a model parallelized over another number of ranks, or into a
plain module in one process (DCP reshards on load). Optimizer state travels with the model.

A packed shard (``Shard(dim, parts=k)``, a fused gate and up projection) is stored as its
``k`` parts, each an ordinary shard, so it too loads at any degree, packed or not.

A save is atomic: it writes ``PATH.partial`` and only a finished write replaces ``PATH``
(the old one is kept as ``PATH.previous`` until the swap completes), so a save interrupted
at any point leaves the previous checkpoint loadable.

``full_state_dict(model)`` gathers the unsharded values, e.g. to export a Hugging Face
checkpoint with ``model.save_pretrained(dir, state_dict=...)``.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from tpfn._torch import StridedShard
from tpfn.algebra import contiguous_strides

__all__ = ["save", "load", "full_state_dict"]


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _states(model, optimizer) -> dict:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _packing(value):
    """(dim, parts) of a DTensor packed over a 1-D mesh, else None."""
    if isinstance(value, DTensor) and len(value.placements) == 1:
        p = value.placements[0]
        if isinstance(p, StridedShard):
            return p.dim % value.ndim, p.split_factor
    return None


def _part_views(value, dim: int, parts: int) -> dict:
    """The ``parts`` parts of a packed DTensor or a plain tensor, as views, by their key."""
    if isinstance(value, DTensor):
        shape = list(value.shape)
        shape[dim] //= parts
        chunks = value.to_local().chunk(parts, dim)
        views = [DTensor.from_local(c, value.device_mesh, [Shard(dim)], run_check=False,
                                    shape=torch.Size(shape), stride=contiguous_strides(shape))
                 for c in chunks]
    else:
        views = value.chunk(parts, dim)
    return {f"part{i}_of_{parts}_dim{dim}": v for i, v in enumerate(views)}


def _as_saved(tree):
    """The state with every packed DTensor replaced by its parts."""
    if isinstance(tree, dict):
        return {k: _as_saved(v) for k, v in tree.items()}
    packing = _packing(tree)
    return _part_views(tree, *packing) if packing else tree


def _as_stored(tree, keys: set, prefix: str, later: list):
    """The state shaped as the checkpoint stores it: parts where it stored parts; a full
    buffer (copied in ``later``) where it stored a packed tensor whole."""
    if isinstance(tree, dict):
        return {k: _as_stored(v, keys, f"{prefix}{k}.", later) for k, v in tree.items()}
    key = prefix[:-1]
    stored = sorted(k[len(key) + 1:] for k in keys if k.startswith(key + ".part"))
    if stored:
        parts, dim = map(int, stored[0].split("_of_")[1].split("_dim"))
        return _part_views(tree, dim, parts)
    packing = _packing(tree)
    if packing:
        buffer = torch.empty(tree.shape, dtype=tree.dtype, device=tree.to_local().device)
        later.append((tree, buffer, packing))
        return buffer
    return tree


def save(path, model, optimizer=None) -> None:
    """Write ``model`` (and ``optimizer``) state to the directory ``path``; every rank calls it.

    >>> import tempfile, os, torch.nn as nn
    >>> model = nn.Linear(2, 2)
    >>> with tempfile.TemporaryDirectory() as d:
    ...     save(os.path.join(d, "step-1"), model)
    ...     sorted(os.listdir(d))
    ['step-1']
    """
    path = os.fspath(path)
    partial, previous = path + ".partial", path + ".previous"
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    dcp.save(_as_saved(_states(model, optimizer)), checkpoint_id=partial)
    _barrier()
    if _rank() == 0:
        if os.path.exists(path):
            shutil.rmtree(previous, ignore_errors=True)
            os.rename(path, previous)
        os.rename(partial, path)
        shutil.rmtree(previous, ignore_errors=True)
    _barrier()


def load(path, model, optimizer=None) -> None:
    """Read the checkpoint at ``path`` into ``model`` (and ``optimizer``), in place.

    The model may be parallelized over any number of ranks, or not at all. When a save was
    interrupted between its two renames, the previous checkpoint is read.
    """
    path = os.fspath(path)
    if not os.path.exists(path) and os.path.exists(path + ".previous"):
        path = path + ".previous"
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r} (nor a previous one beside it).")
    states = _states(model, optimizer)
    keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    later: list = []
    dcp.load(_as_stored(states, keys, "", later), checkpoint_id=path)
    for packed, buffer, (dim, parts) in later:  # a packed tensor stored whole
        mesh = packed.device_mesh
        mine = [p.chunk(mesh.size(), dim)[mesh.get_local_rank()] for p in buffer.chunk(parts, dim)]
        packed.to_local().copy_(torch.cat(mine, dim))
    if optimizer is None:
        set_model_state_dict(model, states["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=states["model"],
                       optim_state_dict=states["optim"])


def full_state_dict(model, *, cpu: bool = True) -> dict:
    """A copy of the model's state with every DTensor gathered to its full value, on every rank.

    >>> import torch.nn as nn
    >>> sorted(full_state_dict(nn.Linear(2, 3)))
    ['bias', 'weight']
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    device = "cpu" if cpu else None
    return {k: v.detach().to(device, copy=True) if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}
