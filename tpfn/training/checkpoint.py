"""Checkpoints through ``torch.distributed.checkpoint``, loadable at any tensor-parallel degree.

Each rank writes the shards it holds; the checkpoint records every tensor's global shape
and layout, so it loads into a model parallelized over another number of ranks, or into a
plain module in one process (DCP reshards on load). Optimizer state travels with the model.

A packed shard (``Shard(dim, parts=k)``, a fused gate and up projection; ``parts=(q, k,
v)``, a GQA ``qkv_proj``) is stored as its parts, each an ordinary shard. Any layout loads
into any other, exactly: a tensor stored as parts loads part by part into views of a
tensor packed the same way, replicated, otherwise sharded or plain; where no such view
exists (parts loaded into a ``Shard(dim)`` without the packing or packed otherwise, a whole
tensor loaded into a packed one) each rank reads the full tensor into a temporary buffer
and copies its shard out of it. Parts that do not make the model's tensor are refused by
name. KV heads replicated over groups of ranks (``Shard(dim, heads=h)``) are DTensors on a
2-D view of the mesh, which DCP reads and writes as they are.

A save is atomic: it writes ``PATH.partial`` and only a finished write replaces ``PATH``
(the old one is kept as ``PATH.previous`` until the swap completes), so a save interrupted
at any point leaves the previous checkpoint loadable.

``full_state_dict(model)`` gathers the unsharded values, e.g. to export a Hugging Face
checkpoint with ``model.save_pretrained(dir, state_dict=...)``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict,
)

from tpfn._torch import StridedShard
from tpfn.algebra import contiguous_strides
from tpfn.bounded import barrier, collective
from tpfn.interpret.layouts import full_value, layouts
from tpfn.interpret.prepare import local_value, placed_tensor
from tpfn.layout import Shard as _Shard

__all__ = ["save", "load", "full_state_dict"]


def _ranks(what: str):
    """Inside, the default group's collectives wait its timeout, at most 10 minutes, and one that
    fails raises a ``CollectiveError`` naming ``what`` (``tpfn.bounded``; one process alone:
    nothing to wait for)."""
    return collective(what) if dist.is_available() and dist.is_initialized() else contextlib.nullcontext()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _states(model, optimizer) -> dict:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _packing(value, layout):
    """(dim, part sizes) of a DTensor packed over a 1-D mesh (``layout``: its tpfn layout,
    for unequal parts, which DTensor does not describe), else None."""
    if not isinstance(value, DTensor) or len(value.placements) != 1:
        return None
    p = value.placements[0]
    if isinstance(layout, _Shard) and isinstance(layout.parts, tuple):
        return layout.dim % value.ndim, layout.parts
    if isinstance(p, StridedShard):
        dim = p.dim % value.ndim
        return dim, (value.shape[dim] // p.split_factor,) * p.split_factor
    return None


def _on_mesh(local: torch.Tensor, like: DTensor, placements, shape) -> DTensor:
    """The DTensor of global ``shape`` whose local tensor is ``local``, on ``like``'s mesh."""
    return DTensor.from_local(local, like.device_mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=contiguous_strides(list(shape)))


def _part_views(value, dim: int, sizes: tuple) -> dict:
    """The parts (of ``sizes`` along ``dim``) of a packed DTensor or a plain tensor, as
    views, by their key."""
    if not isinstance(value, DTensor):
        return _keyed(value.split(list(sizes), dim), dim)
    n, shape = value.device_mesh.size(), tuple(value.shape)
    chunks = value.to_local().split([s // n for s in sizes], dim)
    return _keyed([_on_mesh(chunk, value, [Shard(dim)], shape[:dim] + (size,) + shape[dim + 1:])
                   for size, chunk in zip(sizes, chunks)], dim)


def _keyed(views, dim: int) -> dict:
    return {f"part{i}_of_{len(views)}_dim{dim}": v for i, v in enumerate(views)}


def _whole_along(value, dim: int) -> bool:
    """Whether every rank holds ``value``'s whole extent along ``dim`` (no placement splits it)."""
    return all(not (p.is_shard() or isinstance(p, StridedShard)) or p.dim % value.ndim != dim
               for p in value.placements)


def _layout_at(path: tuple, placed: dict):
    """The tpfn layout of the tensor at ``path`` in the state: a parameter's, or that of the
    parameter whose optimizer state it is."""
    if len(path) == 2 and path[0] == "model":
        return placed.get(path[1])
    if len(path) == 4 and path[:2] == ("optim", "state"):
        return placed.get(path[2])
    return None


def _as_saved(tree, placed: dict, path: tuple = ()):
    """The state with every packed DTensor replaced by its parts."""
    if isinstance(tree, dict):
        return {k: _as_saved(v, placed, path + (k,)) for k, v in tree.items()}
    packing = _packing(tree, _layout_at(path, placed))
    return _part_views(tree, *packing) if packing else tree


_PART = re.compile(r"(.+)\.part(\d+)_of_(\d+)_dim(\d+)")


def _parts_index(metadata: dict) -> dict:
    """By tensor key, the parts the checkpoint stores it as: {(part, parts, dim): size}."""
    index: dict = {}
    for k, v in metadata.items():
        m = _PART.fullmatch(k)
        if m and hasattr(v, "size"):
            index.setdefault(m.group(1), {})[tuple(map(int, m.groups()[1:]))] = v.size
    return index


def _stored_parts(key: str, index: dict):
    """(dim, parts, their sizes) where the checkpoint stores ``key`` as parts, else None."""
    found = index.get(key)
    if not found:
        return None
    packings = {(parts, dim) for _, parts, dim in found}
    parts, dim = min(packings)
    sizes = [found.get((i, parts, dim)) for i in range(parts)]
    if len(packings) != 1 or None in sizes:
        raise ValueError(f"the checkpoint holds {key!r} as parts {sorted(found)} (part, of, "
                         f"dim), not one complete set: it is damaged, save it again.")
    return dim, parts, sizes


def _as_stored(tree, metadata: dict, index: dict, later: list, placed: dict, path: tuple = ()):
    """The state shaped as the checkpoint stores it: as parts, or whole. Where the model's layout
    has no such view (parts of dim ``d`` loaded sharded along ``d`` without that packing; a whole
    tensor loaded packed), a full buffer is read instead, and ``later`` copies this rank's shard
    of it into the tensor."""
    if isinstance(tree, dict):
        return {k: _as_stored(v, metadata, index, later, placed, path + (k,)) for k, v in tree.items()}
    if not isinstance(tree, torch.Tensor):
        return tree
    key, layout = ".".join(path), _layout_at(path, placed)
    stored = _stored_parts(key, index)
    if stored:
        dim, parts, sizes = stored
        shape = list(tree.shape)
        if dim >= tree.ndim or any(
                list(s[:dim]) + list(s[dim + 1:]) != shape[:dim] + shape[dim + 1:] for s in sizes) \
                or sum(s[dim] for s in sizes) != shape[dim]:
            raise ValueError(f"the checkpoint holds {key!r} as {parts} parts of shapes "
                             f"{[tuple(s) for s in sizes]} (along dim {dim}), which do not make the "
                             f"model's {tuple(shape)}: load it into a model of the architecture that "
                             "saved it.")
        along = tuple(s[dim] for s in sizes)
        if not isinstance(tree, DTensor):
            return _keyed(tree.split(list(along), dim), dim)
        if _packing(tree, layout) == (dim, along):
            return _part_views(tree, dim, along)
        if _whole_along(tree, dim):  # replicated, or sharded along another dim
            local = tree.to_local().split(list(along), dim)
            return _keyed([_on_mesh(c, tree, tree.placements, s) for c, s in zip(local, sizes)], dim)
        return _keyed(_buffer(tree, later, layout).split(list(along), dim), dim)
    if _packing(tree, layout) and key in metadata:
        return _buffer(tree, later, layout)
    return tree


def _buffer(tree, later: list, layout) -> torch.Tensor:
    buffer = torch.empty(tree.shape, dtype=tree.dtype, device=tree.to_local().device)
    later.append((tree, buffer, layout))
    return buffer


def _copy_shard(target, buffer, layout) -> None:
    """Copy this rank's shard of the full ``buffer`` into the DTensor ``target`` laid out
    ``layout`` (no communication: every rank holds the whole buffer)."""
    if isinstance(layout, _Shard) and isinstance(layout.parts, tuple):
        mine = local_value(buffer, layout, target.device_mesh)
    else:
        mine = distribute_tensor(buffer, target.device_mesh, target.placements,
                                 src_data_rank=None).to_local()
    target.to_local().copy_(mine)


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
    barrier(f"the barrier before writing checkpoint {path!r}")
    with _ranks(f"torch.distributed.checkpoint's collectives writing checkpoint {path!r}"):
        dcp.save(_as_saved(_states(model, optimizer), layouts(model)), checkpoint_id=partial)
    barrier(f"the barrier after writing the shards of checkpoint {path!r}")
    if _rank() == 0:
        if os.path.exists(path):
            shutil.rmtree(previous, ignore_errors=True)
            os.rename(path, previous)
        os.rename(partial, path)
        shutil.rmtree(previous, ignore_errors=True)
    barrier(f"the barrier after checkpoint {path!r} replaced the previous one")


def load(path, model, optimizer=None) -> None:
    """Read the checkpoint at ``path`` into ``model`` (and ``optimizer``), in place.

    The model may be parallelized over any number of ranks, in any packing, or not at all.
    When a save was interrupted between its two renames, the previous checkpoint is read.
    Raises ``ValueError`` naming the tensor when its stored parts do not make the model's."""
    path = os.fspath(path)
    if not os.path.exists(path) and os.path.exists(path + ".previous"):
        path = path + ".previous"
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r} (nor a previous one beside it).")
    states = _states(model, optimizer)
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    later: list = []
    with _ranks(f"torch.distributed.checkpoint's collectives reading checkpoint {path!r}"):
        dcp.load(_as_stored(states, metadata, _parts_index(metadata), later, layouts(model)),
                 checkpoint_id=path)
    for target, buffer, layout in later:  # stored in another packing than the model's
        _copy_shard(target, buffer, layout)
    if optimizer is None:
        set_model_state_dict(model, states["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=states["model"],
                       optim_state_dict=states["optim"])


def full_state_dict(model, *, cpu: bool = True) -> dict:
    """A copy of the model's state with every DTensor gathered to its full value, on every rank
    (unequal packed parts put back in their places).

    >>> import torch.nn as nn
    >>> sorted(full_state_dict(nn.Linear(2, 3)))
    ['bias', 'weight']
    """
    placed = layouts(model)
    with _ranks("full_state_dict's gathering of the sharded tensors"):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        for name, layout in placed.items():
            if name in state and isinstance(layout, _Shard) and isinstance(layout.parts, tuple):
                state[name] = full_value(placed_tensor(model, name), layout)
    device = "cpu" if cpu else None
    return {k: v.detach().to(device, copy=True) if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}
