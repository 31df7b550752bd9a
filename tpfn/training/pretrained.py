"""Hugging Face checkpoints, shard by shard: each rank reads only its slices.

``load_pretrained(model, path)`` fills a parallelized model (DTensor parameters over a 1-D
mesh, usually still on meta) from a Hugging Face checkpoint directory: one
``model.safetensors``, or the shards ``model.safetensors.index.json`` names. Through
``safetensors.safe_open(...).get_slice`` each rank reads only what it holds: its
``torch.chunk`` range of dim ``d`` for ``Shard(d)``; its chunk of every part for a packed
``Shard(d, parts=k)`` (``colwise(parts=2)``) or ``parts=(q, k, v)``; its group's heads for KV
heads replicated over more ranks than heads (``colwise(heads=h)``); the whole tensor for
``Replicate()`` and plain tensors; converted to the parameter's dtype (or ``dtype=``).

Parameters are filled in place (``torch.utils.swap_tensors``, as ``Module.to_empty`` does):
tied parameters stay one object, filled once, and the hooks ``parallelize`` put on them (the
partial gradients of replicated per-head norms) keep working. Buffers are taken from the
checkpoint when it holds them; non-persistent ones (rotary ``inv_freq``) never are, so they
must be real: build the model inside ``empty_weights()`` (parameters on meta, buffers computed
by ``__init__``, as transformers computes them) or on a real device.

Everything is checked before anything changes, on every rank alike (the ranks exchange what
they found, so all raise the same ``CheckpointError``): a missing key, an unexpected one
(``strict=False`` accepts those), a shape or dtype that does not fit, a truncated or corrupt
file, a checkpoint of another model, a meta buffer with nothing to fill it. Then every slice
is read, and only then swapped in: nothing is ever half-loaded or left on the meta device.

``save_pretrained(model, path)`` is the reverse: it gathers one tensor at a time and rank 0
writes safetensors shards, their index and the model's config, which
``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads on one device, bit for bit.
``from_pretrained(path, mesh)`` builds the model from the checkpoint's config on meta,
parallelizes it with its own ``tp_plan`` (``from_hf``) or ``plan=``, and loads it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import re
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tpfn._torch import buffers_of, in_a_graph, local_tensor, parameters_of, persistent, swap_in_place
from tpfn.algebra import contiguous_strides, shard_ranges
from tpfn.bounded import barrier, collective
from tpfn.errors import CheckpointError
from tpfn.interpret.layouts import full_value, layouts
from tpfn.layout import Partial, from_torch
from tpfn.layout import Shard as _Shard
from tpfn.plans.plan import Plan
from tpfn.style.style import Style
from tpfn.training.progress import Progress, enabled, log
from tpfn.training.progress import size as readable

__all__ = ["load_pretrained", "save_pretrained", "from_pretrained", "empty_weights",
           "CheckpointError", "SINGLE", "INDEX"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_CAP = 20  # problems listed per kind; the rest are counted

_DTYPES = {code: getattr(torch, name) for code, name in {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "C64": "complex64", "C128": "complex128", "BOOL": "bool",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8"}.items() if hasattr(torch, name)}


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real.

    Every parameter registered inside the block is moved to meta as it is registered (no
    memory is touched), while buffers are computed by the modules' ``__init__`` as usual:
    rotary ``inv_freq`` gets the value transformers computes. Not thread-safe.

    >>> with empty_weights():
    ...     layer = nn.Linear(4, 4)
    ...     layer.register_buffer("scale", torch.ones(4), persistent=False)
    >>> layer.weight.is_meta, layer.scale.is_meta
    (True, False)
    """
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            moved = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            parameters_of(module)[name] = moved

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


# -- the checkpoint's side: files, keys, shapes, dtypes (headers only) ----------------------

class _Checkpoint:
    """The headers of a checkpoint: for each key, its file, shape and dtype code."""

    def __init__(self, path):
        path = os.fspath(path)
        self.files, self.problems, self.config = [], [], None
        self.where, self.shapes, self.codes = {}, {}, {}  # by key: its file, shape, dtype code
        if os.path.isfile(path):
            directory, self.files = os.path.dirname(path), [path]
        elif os.path.isfile(os.path.join(path, INDEX)):
            directory, weight_map = path, self._weight_map(os.path.join(path, INDEX))
            if weight_map is None:
                return
            self.files = sorted({os.path.join(path, f) for f in weight_map.values()})
            self.listed = {k: os.path.join(path, f) for k, f in weight_map.items()}
        elif os.path.isfile(os.path.join(path, SINGLE)):
            directory, self.files = path, [os.path.join(path, SINGLE)]
        else:
            raise FileNotFoundError(
                f"no {SINGLE} nor {INDEX} in {path!r}: point at a directory that "
                "save_pretrained (tpfn's or transformers') wrote, or at one .safetensors file.")
        config = os.path.join(directory, "config.json")
        if os.path.isfile(config):
            try:
                with open(config) as f:
                    self.config = json.load(f)
            except (OSError, ValueError) as e:
                self.problems.append(f"cannot read {config}: {e}; save the checkpoint again.")
        for file in self.files:
            self._header(file)
        for key, file in getattr(self, "listed", {}).items():
            if os.path.isfile(file) and self.where.get(key) != file \
                    and not any(file in p for p in self.problems):
                self.problems.append(f"{INDEX} lists {key!r} in {file}, which does not hold it: the "
                                     "checkpoint is incomplete; download or save it again.")

    def _weight_map(self, index: str):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise ValueError("'weight_map' is not a mapping")
            return weight_map
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.problems.append(f"cannot read the index {index}: {e!r}; it is truncated or "
                                 "corrupt: download or save the checkpoint again.")
            return None

    def _header(self, file: str) -> None:
        from safetensors import safe_open

        if not os.path.isfile(file):
            self.problems.append(f"{file} is missing (named by {INDEX}); download or save the "
                                 "checkpoint again.")
            return
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    piece = f.get_slice(key)
                    self.where.setdefault(key, file)
                    self.shapes[key] = tuple(piece.get_shape())
                    self.codes[key] = piece.get_dtype()
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError
            self.problems.append(f"cannot read {file}: {e}; the file is truncated or corrupt: "
                                 "download or save it again.")


# -- the model's side: one entry per tensor object, with every name it goes by --------------

class _Target:
    def __init__(self, tensor, kind: str):
        self.tensor, self.kind = tensor, kind
        self.layout = None  # the tpfn layout a plan gave it (None: as its placements say)
        self.names, self.slots = [], []  # every name it goes by; (module, attribute name) of each
        self.persistent = False

    @property
    def meta(self) -> bool:
        t = self.tensor
        return (local_tensor(t) if isinstance(t, DTensor) else t).is_meta


def _targets(model: nn.Module) -> list:
    found: dict = {}
    placed = layouts(model)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for table, kind in ((parameters_of(module), "parameter"), (buffers_of(module), "buffer")):
            for name, t in table.items():
                if t is None:
                    continue
                target = found.setdefault(id(t), _Target(t, kind))
                full = f"{prefix}.{name}" if prefix else name
                target.layout = placed.get(full, target.layout)
                if full not in target.names:
                    target.names.append(full)
                if not any(m is module and n == name for m, n in target.slots):
                    target.slots.append((module, name))
                if kind == "parameter" or persistent(module, name):
                    target.persistent = True
    return list(found.values())


def _mesh_group(targets: list):
    return next((t.tensor.device_mesh for t in targets
                 if isinstance(t.tensor, DTensor) and t.tensor.device_mesh.ndim == 1), None)


def _refuse(problems: list, mesh) -> None:
    """Raise a ``CheckpointError`` of every rank's problems, if any, on every rank alike
    (alone: of one's own)."""
    if mesh is not None and mesh.size() > 1 and dist.is_initialized():
        gathered = [None] * mesh.size()
        with collective("the exchange of the ranks' checks of the checkpoint", mesh):
            dist.all_gather_object(gathered, problems, group=mesh.get_group())
        problems = []
        for rank_problems in gathered:
            problems += [p for p in rank_problems if p not in problems]
    if problems:
        raise CheckpointError(problems)


def _capped(lines: list, what: str) -> list:
    more = len(lines) - _CAP
    return lines if more <= 0 else lines[:_CAP] + [f"... and {more} more {what}"]


def _convertible(stored: torch.dtype, wanted: torch.dtype) -> bool:
    return stored == wanted or (stored.is_floating_point and wanted.is_floating_point)


def _misfit(ckpt: _Checkpoint, source: str, expected: tuple, wanted, whose: str) -> str | None:
    """Why the checkpoint's ``source`` cannot fill ``whose`` (of shape ``expected``, dtype
    ``wanted``), or None."""
    file, shape, code = ckpt.where[source], ckpt.shapes[source], ckpt.codes[source]
    if shape != expected:
        return (f"{source!r} in {file} has shape {shape}, but the model's {whose} is {expected}: "
                "load the checkpoint of this model (same architecture and sizes).")
    stored = _DTYPES.get(code)
    if stored is None or not _convertible(stored, wanted):
        return (f"{source!r} in {file} is stored as {code} ({stored or 'unknown to torch'}), which "
                f"does not convert to the model's {wanted} without changing its values: load a "
                "checkpoint that stores it as a floating-point tensor, or build the model with "
                "this dtype.")
    return None


def _check(model, targets: list, ckpt: _Checkpoint, strict: bool, dtype) -> tuple:
    """(what to read: [(target, key, dtype)], problems), from the headers alone."""
    problems, missing, plan = list(ckpt.problems), [], []
    if ckpt.problems:  # unreadable files: their keys would all look missing
        return plan, problems
    theirs = (ckpt.config or {}).get("model_type")
    ours = getattr(getattr(model, "config", None), "model_type", None)
    if theirs and ours and theirs != ours:
        problems.append(f"the checkpoint's config.json ({os.path.dirname(ckpt.files[0])}) is a "
                        f"{theirs!r} model and this model is {ours!r}: this is a checkpoint of "
                        "another model; load the checkpoint of this architecture.")
    known = set()
    for target in targets:
        known.update(target.names)
        t = target.tensor
        key = next((n for n in target.names if n in ckpt.where), None)
        if key is None and target.persistent:  # transformers' per-expert (or renamed) layout
            key = _converted(target, ckpt)
            if isinstance(key, _Experts):
                known.update(key.keys())
                absent = [k for k in key.keys() if k not in ckpt.where]
                if absent:
                    missing += [f"missing key {k!r}: the expert weights of the model's "
                                f"parameter {target.names[0]!r} {tuple(t.shape)} are in "
                                f"{_files(ckpt)} one by one, but this one is in none of them; "
                                "load the checkpoint of this model." for k in absent]
                    continue
            elif key is not None:
                known.add(key)
        tied = f" (tied: also {', '.join(map(repr, target.names[1:]))})" if len(target.names) > 1 else ""
        if key is None or (not target.persistent and not target.meta):
            if target.persistent:
                missing.append(f"missing key {target.names[0]!r}{tied}: the model's {target.kind} "
                               f"of shape {tuple(t.shape)} is in none of {_files(ckpt)}; load the "
                               "checkpoint of this model (a missing key is never accepted: the "
                               f"{target.kind} would be left unwritten).")
            elif target.meta:
                problems.append(
                    f"buffer {target.names[0]!r} is on the meta device and not in {_files(ckpt)} (a "
                    "non-persistent buffer: its module's __init__ computes it); build the model inside "
                    "tpfn.training.pretrained.empty_weights() (parameters on meta, buffers computed), "
                    "or on a real device.")
            continue
        wanted = dtype if dtype is not None and t.is_floating_point() else t.dtype
        sources = key.sources(tuple(t.shape)) if isinstance(key, _Experts) else \
            [(key, tuple(t.shape))]
        whose = f"{target.kind}{tied}" if not isinstance(key, _Experts) else \
            f"{target.kind} {target.names[0]!r} {tuple(t.shape)} needs one expert's part of"
        misfit = next(filter(None, (_misfit(ckpt, s, e, wanted, whose) for s, e in sources)), None)
        if misfit:
            problems.append(misfit)
            continue
        reason = _unfillable(target)
        if reason:
            file = ckpt.where[sources[0][0]]
            problems.append(f"{target.kind} {target.names[0]!r} ({key!r} in {file}) {reason}")
            continue
        plan.append((target, key, wanted))
    problems += _capped(missing, "missing keys")
    unexpected = sorted(k for k in ckpt.where if k not in known)
    if unexpected and strict:
        lines = [f"unexpected key {k!r} in {ckpt.where[k]}: the model has no parameter or "
                 "buffer of that name; pass strict=False to ignore it." for k in unexpected]
        problems += _capped(lines, "unexpected keys")
    if any(".experts.0." in k for k in unexpected) and any(".experts." in m for m in missing):
        example = next(k for k in unexpected if ".experts.0." in k)
        problems.append(
            f"the checkpoint stores the experts one by one ({example!r} in {ckpt.where[example]}), "
            "as transformers saves mixtures of experts, and the model holds them fused (3-D "
            "'experts.gate_up_proj'), but under names load_pretrained does not know how to fuse "
            "(it knows Mixtral's experts.E.w1/w3/w2 and Qwen2-MoE's "
            "experts.E.gate_proj/up_proj/down_proj): convert it once (transformers' "
            "from_pretrained, then tpfn.training.pretrained.save_pretrained writes the fused layout).")
    return plan, problems


# transformers' per-expert checkpoints (its conversion_mapping.py, "mixtral" and "qwen2_moe"):
# experts.gate_up_proj[e] = cat(gate_e, up_e) and experts.down_proj[e] = down_e, and Mixtral's
# ".block_sparse_moe." is the model's ".mlp.".
_EXPERT_PARTS = {"gate_up_proj": (("w1", "w3"), ("gate_proj", "up_proj")),
                 "down_proj": (("w2",), ("down_proj",))}
_RENAMES = ((".mlp.", ".block_sparse_moe."),)


class _Experts:
    """A fused 3-D expert parameter read from one 2-D tensor per expert and part:
    ``value[e] = cat([part_0 of expert e, part_1 of expert e, ...], dim=0)``."""

    def __init__(self, parts: list):
        self.parts = parts  # [[key of each part] for each expert]

    def keys(self) -> list:
        return [k for keys in self.parts for k in keys]

    def sources(self, shape: tuple) -> list:
        """(key, the shape it must have) for each source of a fused parameter of ``shape``."""
        if len(shape) != 3 or shape[0] != len(self.parts) or shape[1] % len(self.parts[0]):
            return [(k, ("a 3-D fused parameter",)) for k in self.keys()[:1]]
        rows = shape[1] // len(self.parts[0])
        return [(k, (rows, shape[2])) for k in self.keys()]

    def __repr__(self) -> str:
        return repr(self.parts[0][0])


def _converted(target, ckpt: _Checkpoint):
    """The checkpoint key, or ``_Experts``, that holds ``target`` in transformers' saved
    layout (per-expert and renamed keys), or None."""
    for name in target.names:
        candidates = [name] + [name.replace(a, b) for a, b in _RENAMES if a in name]
        for candidate in candidates[1:]:
            if candidate in ckpt.where:
                return candidate
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith("experts") or leaf not in _EXPERT_PARTS or target.tensor.ndim != 3:
            continue
        for base in dict.fromkeys(c.rpartition(".")[0] for c in candidates):
            for parts in _EXPERT_PARTS[leaf]:
                if f"{base}.0.{parts[0]}.weight" in ckpt.where:
                    return _Experts([[f"{base}.{e}.{p}.weight" for p in parts]
                                     for e in range(target.tensor.shape[0])])
    return None


def _files(ckpt: _Checkpoint) -> str:
    return ckpt.files[0] if len(ckpt.files) == 1 else \
        f"the {len(ckpt.files)} files of {os.path.join(os.path.dirname(ckpt.files[0]), INDEX)}"


def _unfillable(target) -> str | None:
    """Why ``target`` cannot be filled (the end of a sentence about it), or None."""
    t = target.tensor
    if isinstance(t, DTensor):
        placement = _layout(target)
        if placement is None or isinstance(placement, Partial):
            return (f"is laid out {t.placements} on a {t.device_mesh.ndim}-D mesh; load_pretrained "
                    "fills Shard and Replicate DTensors on the 1-D tensor-parallel mesh: load before "
                    "fully_shard, right after parallelize.")
    if target.kind != "parameter":
        return None
    if weakref.getweakrefs(t):
        return "is weakly referenced, so it cannot be filled in place; load before anything " \
               "keeps a weak reference to it."
    if in_a_graph(t):
        return "is referenced by an autograd graph (a forward's outputs are alive), so it cannot be " \
               "filled in place; run its backward if it is to run, drop its outputs (del loss), then load."
    return None


# -- reading this rank's slice --------------------------------------------------------------

def _layout(target: _Target):
    """The tpfn placement of a target on the 1-D tensor-parallel mesh (None: a DTensor on
    another mesh, which load_pretrained does not fill), or None for a plain tensor."""
    t = target.tensor
    if target.layout is None and isinstance(t, DTensor) and t.device_mesh.ndim == 1:
        return from_torch(t.placements)[0]
    return target.layout


def _dim_ranges(target: _Target) -> list:
    """For each dim of the target, this rank's ``[start, stop)`` ranges, in the order it
    holds them (the whole dim where it is not sharded)."""
    t = target.tensor
    ranges = [[(0, size)] for size in t.shape]
    placement = _layout(target) if isinstance(t, DTensor) else None
    if isinstance(placement, _Shard):
        mesh = t.device_mesh  # a view of the tensor-parallel mesh: ranks numbered row by row
        rank = sum(c * s for c, s in zip(mesh.get_coordinate(), contiguous_strides(mesh.shape)))
        dim = placement.dim % t.ndim
        ranges[dim] = [(start, start + size) for start, size in
                       shard_ranges(t.shape[dim], placement, mesh.size(), rank)]
    return ranges


def _read(handle, key: str, target: _Target, dtype) -> torch.Tensor:
    t, piece = target.tensor, handle(key).get_slice(key)
    ranges = _dim_ranges(target)
    sharded = [d for d, r in enumerate(ranges) if r != [(0, t.shape[d])]]
    if not sharded:  # Replicate(), or a plain tensor: whole
        return _placed(handle(key).get_tensor(key), key, target, dtype)
    dim, pieces = sharded[0], []
    for start, stop in ranges[dim]:
        if stop <= start:
            empty = t.shape[:dim] + (0,) + t.shape[dim + 1:]
            pieces.append(torch.empty(empty, dtype=_DTYPES[piece.get_dtype()]))
        else:
            pieces.append(piece[tuple(slice(start, stop) if d == dim else slice(None)
                                      for d in range(t.ndim))])
    value = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
    return _placed(value, key, target, dtype)


def _read_experts(handle, experts: _Experts, target: _Target, dtype) -> torch.Tensor:
    """This rank's slice of a fused expert parameter, read from the per-expert tensors:
    only the experts, rows (of each part) and columns it holds."""
    t = target.tensor
    on_experts, on_rows, on_cols = _dim_ranges(target)
    rows_per_part = t.shape[1] // len(experts.parts[0])
    width, blocks = sum(b - a for a, b in on_cols), []
    for e in (e for start, stop in on_experts for e in range(start, stop)):
        rows = []
        for start, stop in on_rows:
            for i, key in enumerate(experts.parts[e]):
                lo, hi = max(start, i * rows_per_part), min(stop, (i + 1) * rows_per_part)
                if lo >= hi:
                    continue
                piece = handle(key).get_slice(key)
                cols = [piece[lo - i * rows_per_part:hi - i * rows_per_part, a:b]
                        for a, b in on_cols if b > a]
                rows.append(cols[0] if len(cols) == 1 else torch.cat(cols, 1))
        blocks.append(torch.cat(rows, 0) if rows else torch.empty(0, width, dtype=dtype))
    value = torch.stack([b.to(dtype) for b in blocks]) if blocks else \
        torch.empty(0, sum(b - a for a, b in on_rows), width, dtype=dtype)
    return _placed(value, repr(experts), target, dtype)


def _placed(value: torch.Tensor, key: str, target: _Target, dtype) -> torch.Tensor:
    t = target.tensor
    expected = tuple((local_tensor(t) if isinstance(t, DTensor) else t).shape)
    if tuple(value.shape) != expected:  # tpfn's arithmetic against DTensor's: a bug
        raise RuntimeError(f"tpfn read {tuple(value.shape)} of {key!r} for this rank, but its "
                           f"{getattr(t, 'placements', 'plain')} shard is {expected}: please report this.")
    device = (local_tensor(t) if isinstance(t, DTensor) else t).device
    if device.type == "meta":  # where the mesh computes (a plain meta tensor: the CPU)
        kind = t.device_mesh.device_type if isinstance(t, DTensor) else "cpu"
        device = torch.device(kind) if kind == "cpu" else \
            torch.device(kind, torch.get_device_module(kind).current_device())
    return value.to(device=device, dtype=dtype).contiguous()


def _fill(target: _Target, value: torch.Tensor):
    """Put ``value`` (this rank's slice) in ``target``'s place; returns what undoes it."""
    t = target.tensor
    if isinstance(t, DTensor):
        value = DTensor.from_local(value, t.device_mesh, t.placements, run_check=False,
                                   shape=t.shape, stride=t.stride())
    if target.kind == "buffer":
        old = [(module, name, buffers_of(module)[name]) for module, name in target.slots]
        for module, name in target.slots:
            buffers_of(module)[name] = value
        return lambda: [buffers_of(module).__setitem__(name, b) for module, name, b in old]
    new = nn.Parameter(value, requires_grad=t.requires_grad)
    swap_in_place(t, new)
    return functools.partial(swap_in_place, t, new)  # new now holds the old values: swap back


def _fill_all(plan: list, values: list) -> None:
    """Fill every target, or none: an interrupt (``KeyboardInterrupt``) or an error part way
    undoes what was filled before it is raised on."""
    undo = []
    try:
        with torch.no_grad():
            for (target, _, _), value in zip(plan, values):
                undo.append(_fill(target, value))
    except BaseException:
        for step in reversed(undo):
            step()
        raise


def load_pretrained(model: nn.Module, path: str | os.PathLike, *, strict: bool = True,
                    dtype: torch.dtype | None = None, progress: bool | None = None) -> nn.Module:
    """Fill every parameter and buffer of ``model`` with this rank's slice of the checkpoint
    at ``path``; returns ``model``. Every rank of the model's mesh calls it.

    ``path`` is a directory holding ``model.safetensors`` or ``model.safetensors.index.json``
    and its shards (or one ``.safetensors`` file). ``model`` is parallelized (DTensor
    parameters on a 1-D mesh, e.g. built inside ``empty_weights()`` and parallelized with
    ``src_rank=None``) or plain. ``dtype`` converts floating-point tensors (default: each
    parameter's own dtype). ``strict=False`` ignores keys the model lacks; a key the
    checkpoint lacks always raises. Raises ``CheckpointError`` listing every problem, each
    naming the key and the file, before anything changes. ``progress``: the bar of this rank's
    bytes read (default: on rank 0 unless ``TPFN_PROGRESS=0``; ``tpfn.training.progress``).

    >>> import os, tempfile
    >>> torch.manual_seed(0) and None
    >>> mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    >>> source = nn.Linear(4, 6)
    >>> with empty_weights():
    ...     empty = tpfn.parallelize(nn.Linear(4, 6), mesh, tpfn.colwise(), src_rank=None)
    >>> with tempfile.TemporaryDirectory() as d:
    ...     save_pretrained(source, d)
    ...     model = load_pretrained(empty, d)
    >>> torch.equal(model.weight.full_tensor(), source.weight), model.weight.is_meta
    (True, False)
    """
    from safetensors import safe_open

    ckpt = _Checkpoint(path)
    targets = _targets(model)
    mesh = _mesh_group(targets)
    plan, problems = _check(model, targets, ckpt, strict, dtype)
    _refuse(problems, mesh)
    values, failed = [], []
    total = sum((local_tensor(t.tensor) if isinstance(t.tensor, DTensor) else t.tensor).numel() * wanted.itemsize
                for t, _, wanted in plan)  # this rank's bytes
    with contextlib.ExitStack() as stack, \
            Progress("load_pretrained", total, enabled=enabled(progress)) as bar:
        handles: dict = {}
        def handle(key):
            file = ckpt.where[key]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            return handles[file]

        for target, key, wanted in plan:
            experts = isinstance(key, _Experts)
            file = ckpt.where[key.keys()[0] if experts else key]
            try:
                values.append((_read_experts if experts else _read)(handle, key, target, wanted))
            except RuntimeError:
                raise
            except Exception as e:  # noqa: BLE001 - a read that fails after the headers did not
                failed.append(f"cannot read {key!r} from {file}: {e}; the file is truncated or "
                              "corrupt: download or save it again.")
                break
            bar.update(values[-1].numel() * values[-1].element_size(),
                       f"{len(values)}/{len(plan)} tensors, {len(handles)}/{len(ckpt.files)} files")
            log.debug("load_pretrained: %r from %s, this rank's %s of %s", key, os.path.basename(file),
                      tuple(values[-1].shape), tuple(target.tensor.shape))
    _refuse(failed, mesh)
    _fill_all(plan, values)
    left = [n for t in _targets(model) if t.meta for n in t.names[:1]]
    if left:  # _check refuses this; kept as the last word on "nothing unwritten"
        raise RuntimeError(f"after loading, {left} are still on the meta device: please report this.")
    log.info("load_pretrained: %d tensors from %d files of %s, this rank's slices (%s), in %.2f s",
             len(values), len(ckpt.files), path, readable(bar.done), bar.seconds)
    return model


# -- saving ---------------------------------------------------------------------------------

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _bytes(size) -> int:
    """``max_shard_size`` in bytes: an int, or "20KB", "5GB", "2GiB" (transformers' units)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size must be a number of bytes or a size such as '20KB', "
                         f"'5GB' or '2GiB' (got {size!r}).")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def save_pretrained(model: nn.Module, path: str | os.PathLike, *,
                    max_shard_size: int | str = "5GB", progress: bool | None = None) -> None:
    """Write ``model`` as a Hugging Face checkpoint in the directory ``path``; every rank
    calls it, rank 0 writes.

    Each DTensor is gathered to its full value one at a time (at most one tensor, and one
    shard of at most ``max_shard_size`` on rank 0, are held at once). One file is written
    as ``model.safetensors``; more as ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``. Tied parameters are written once, under their first
    name; non-persistent buffers not at all; ``model.config`` (and ``generation_config``),
    when the model has them, beside them. Earlier ``model*.safetensors`` files in ``path``
    are replaced. ``progress``: the bar of the bytes gathered and written (default: on rank 0
    unless ``TPFN_PROGRESS=0``; ``tpfn.training.progress``).

    >>> import os, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     save_pretrained(nn.Linear(4, 4), d)
    ...     sorted(os.listdir(d))
    ['model.safetensors']
    """
    from safetensors.torch import save_file

    limit = _bytes(max_shard_size)
    entries = []  # (name, tensor, its tpfn layout, bytes)
    for target in (target for target in _targets(model) if target.persistent):
        if target.meta:
            raise ValueError(f"{target.kind} {target.names[0]!r} is on the meta device: there is "
                             "nothing to save; load the model's weights first.")
        t = target.tensor
        entries.append((target.names[0], t, target.layout, t.numel() * t.element_size()))
    shards, size = [[]], 0
    for entry in entries:
        if shards[-1] and size + entry[3] > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[3]
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    path = os.fspath(path)
    distributed = dist.is_available() and dist.is_initialized()
    writer = not distributed or dist.get_rank() == 0
    if writer:
        os.makedirs(path, exist_ok=True)
        for old in os.listdir(path):
            if _SHARD.fullmatch(old) or old == INDEX:
                os.remove(os.path.join(path, old))
    weight_map = {}
    with torch.no_grad(), Progress("save_pretrained", sum(e[3] for e in entries),
                                   enabled=enabled(progress)) as bar:
        for i, (name, shard) in enumerate(zip(names, shards)):
            tensors = {}
            for key, t, layout, nbytes in shard:
                full = full_value(t, layout)
                if writer:
                    tensors[key] = full.detach().to("cpu", copy=True).contiguous()
                    weight_map[key] = name
                del full
                bar.update(nbytes, f"file {i + 1}/{n}")
            if writer:
                file = os.path.join(path, name)
                save_file(tensors, file + ".partial", metadata={"format": "pt"})
                os.replace(file + ".partial", file)
                log.debug("save_pretrained: wrote %s (%d tensors)", file, len(tensors))
            del tensors
    if writer:
        if n > 1:
            index = {"metadata": {"total_size": sum(e[3] for e in entries)}, "weight_map": weight_map}
            with open(os.path.join(path, INDEX), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        config = getattr(model, "config", None)
        if hasattr(config, "save_pretrained"):
            config = copy.deepcopy(config)
            config.architectures = [type(model).__name__]
            floating = next((t.dtype for _, t, _, _ in entries if t.is_floating_point()), None)
            if floating is not None and hasattr(config, "dtype"):
                config.dtype = floating  # what the files hold, as transformers records it
            config.save_pretrained(path)
        if hasattr(getattr(model, "generation_config", None), "save_pretrained"):
            model.generation_config.save_pretrained(path)
        log.info("save_pretrained: %d tensors (%s) in %d files to %s in %.2f s",
                 len(entries), readable(bar.done), n, path, bar.seconds)
    barrier(f"the barrier after writing {path!r}")


# -- the one call ---------------------------------------------------------------------------

def build(config, model_class: type | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """The transformers model of ``config``: ``model_class``'s (default: the causal LM, else the
    base model), in ``dtype`` (default: the config's)."""
    import transformers

    kwargs = {} if dtype is None else {"dtype": dtype}
    if model_class is None:
        try:
            return transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        except ValueError:
            return transformers.AutoModel.from_config(config, **kwargs)
    if hasattr(model_class, "_from_config"):
        return model_class._from_config(config, **kwargs)
    if hasattr(model_class, "from_config"):  # transformers' auto classes
        return model_class.from_config(config, **kwargs)
    return model_class(config)


def auto_plan(model: nn.Module, world_size: int, example_inputs=None):
    """The model's own plan (``from_hf``), else ``tpfn.suggest``'s over ``world_size`` ranks
    (at ``example_inputs``, if given), logged at INFO; a plan that shards nothing is logged at
    WARNING. What ``from_pretrained(plan="auto")`` and the command line take."""
    from tpfn.adapters.from_hf import from_hf
    from tpfn.suggest.suggest import sharded_share, suggest

    if getattr(model, "tp_plan", None):
        return from_hf(model.tp_plan, model)
    found = suggest(model, world_size, example_inputs=example_inputs)
    sharded, total = sharded_share(model, found)
    log.log(logging.INFO if sharded else logging.WARNING,
            "%s declares no tensor-parallel plan; tpfn.suggest's %s:\n%s", type(model).__name__,
            "shards its parameters" if sharded else "shards nothing, and every rank holds the whole model",
            found)
    return found


def from_pretrained(path: str | os.PathLike, mesh: DeviceMesh, *, model_class: type | None = None,
                    plan: Plan | dict | Style | str | None = "auto",
                    dtype: torch.dtype | None = None, progress: bool | None = None) -> nn.Module:
    """The model of the Hugging Face checkpoint directory ``path``, parallelized over the 1-D
    ``mesh``, each rank holding and having read only its slices; in eval mode, as
    transformers returns it. Every rank of the mesh calls it.

    The model is built from the checkpoint's ``config.json`` inside ``empty_weights()``
    (``model_class``, a transformers model class or auto class, defaults to
    ``AutoModelForCausalLM``, then ``AutoModel``), in ``dtype`` (default: the config's),
    parallelized with ``plan`` and filled by ``load_pretrained``. ``plan="auto"`` (the
    default) is the model's own plan, ``tpfn.from_hf(model.tp_plan, model)``, where it declares
    one, else ``tpfn.suggest(model, mesh.size())``'s, logged at INFO on the ``tpfn`` logger
    (at WARNING where it shards nothing); ``plan=None`` loads the whole model on every rank,
    logged at WARNING. tpfn's ``from_pretrained(path, mesh)`` is transformers'
    ``from_pretrained(path, tp_plan="auto")``, for models without a plan too. Where ``plan``
    leaves the logits sharded over the vocabulary (``lm_head`` ending in
    ``colwise(local=False)``), ``labels=`` computes the vocabulary-parallel
    ``tpfn.causal_lm_loss`` on them. ``progress``: ``load_pretrained``'s bar.

    >>> import tempfile
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    >>> config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...                      num_hidden_layers=1, num_attention_heads=2)
    >>> with tempfile.TemporaryDirectory() as d:
    ...     LlamaForCausalLM(config).save_pretrained(d)
    ...     model = from_pretrained(d, mesh)
    >>> model.model.layers[0].mlp.up_proj.weight.placements, model.training
    ((Shard(dim=0),), False)
    """
    from transformers import AutoConfig

    from tpfn.interpret.parallelize import parallelize
    from tpfn.training.hf import set_loss

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a directory: from_pretrained reads a local "
                                "checkpoint directory (config.json and safetensors); download "
                                "it first, e.g. with huggingface_hub.snapshot_download.")
    config = AutoConfig.from_pretrained(path)
    with empty_weights():
        model = build(config, model_class, dtype)
    model.eval()
    if isinstance(plan, str) and plan != "auto":
        raise ValueError(f"plan={plan!r}: give 'auto' (the model's own plan, else tpfn.suggest's), a "
                         "plan, or None (the whole model on every rank).")
    if plan is None:
        log.warning("from_pretrained(plan=None): every rank holds and computes the whole %s",
                    type(model).__name__)
    else:
        parallelize(model, mesh, auto_plan(model, mesh.size()) if isinstance(plan, str) else plan, src_rank=None)
        set_loss(model)  # a plan that leaves the logits sharded: labels= computes a vocab-parallel loss
    return load_pretrained(model, path, progress=progress)
