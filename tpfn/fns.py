"""The three functions that do the work: shard parameters, prepare inputs, prepare outputs.

None of them mutates its arguments; ``parallelize`` mounts them on modules.

- ``shard_params(module, mesh, rule)``: ``{name: nn.Parameter(DTensor)}`` for the named
  parameters of ``module``, each laid out as ``rule`` says.
- ``prepare_inputs(args, kwargs, spec, mesh)``: the inputs annotated with their given layout,
  redistributed to the desired one, as local tensors or DTensors; ``spec`` is a
  ``prepare_in(...)`` style.
- ``prepare_outputs(outputs, spec, mesh)``: the same for a module's outputs (a tensor, the
  items of a tuple or list, the values of a dict), with a ``prepare_out(...)`` style.

A local tensor that leaves a slot sharded remembers its global shape (``tpfn.shapes``), so
a sequence the mesh does not divide keeps its length when the next module annotates it
again (PyTorch infers an even split there, torchtitan#1306).
"""

from __future__ import annotations

import functools

import attrs
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tpfn.bind import bind
from tpfn.errors import LayoutError
from tpfn.layout import Shard, from_torch, to_torch
from tpfn.local import failed, placements
from tpfn.shapes import SHAPES, contiguous_strides
from tpfn.style import Inputs, Outputs, Style

__all__ = ["shard_params", "prepare_inputs", "prepare_outputs"]


def shard_params(module: nn.Module, mesh, rule: dict, *, src_rank: int | None = 0) -> dict:
    """``{name: nn.Parameter(DTensor)}`` for each parameter named in ``rule`` (a name -> layout map).

    Dotted names reach into submodules. ``src_rank`` is the rank whose values every rank
    receives (``None``: each rank keeps its own values, no communication). A parameter that
    is already a DTensor with that layout on ``mesh`` is returned as it is.
    """
    out = {}
    for name, layout in rule.items():
        param = module.get_parameter(name)
        problem = unpackable(name, param.shape, layout, mesh.size())
        if problem:
            raise LayoutError(problem)
        placements = to_torch(layout)
        if isinstance(param, DTensor):
            if param.device_mesh != mesh or param.placements != placements:
                raise LayoutError(
                    f"parameter {name!r} is already a DTensor laid out {from_torch(param.placements)} "
                    f"on {param.device_mesh}; it cannot also be {layout!r} on {mesh}."
                )
            out[name] = param
            continue
        dt = distribute_tensor(param, mesh, placements, src_data_rank=src_rank)
        out[name] = nn.Parameter(dt, requires_grad=param.requires_grad)
    return out


def unpackable(name: str, shape, layout, n: int) -> str | None:
    """Why ``n`` ranks cannot hold packed parts of parameter ``name`` evenly (None: they can).

    Each rank holds its chunk of every part, so each part must split evenly over the ranks.

    >>> unpackable("gate_up.weight", (12, 8), Shard(0, parts=2), 4)
    "parameter 'gate_up.weight' packs 2 parts in dim 0 (12): each part (6) must split evenly over 4 ranks, so dim 0 must be a multiple of 8; pad each part, or choose a mesh size that divides 6."
    """
    if not isinstance(layout, Shard) or layout.parts == 1:
        return None
    dim, parts = layout.dim % len(shape), layout.parts
    if shape[dim] % (parts * n) == 0:
        return None
    if shape[dim] % parts:
        return (f"parameter {name!r} packs {parts} parts in dim {dim}, but {shape[dim]} does not "
                f"split into {parts} equal parts; give the number of parts it packs.")
    part = shape[dim] // parts
    return (f"parameter {name!r} packs {parts} parts in dim {dim} ({shape[dim]}): each part "
            f"({part}) must split evenly over {n} ranks, so dim {dim} must be a multiple of "
            f"{parts * n}; pad each part, or choose a mesh size that divides {part}.")


def checked(x: DTensor, slot, mesh, what: str) -> DTensor:
    """``x``, after checking it lives on ``mesh`` in the layout ``slot`` declares."""
    if x.device_mesh != mesh:
        raise LayoutError(f"{what} is a DTensor on {x.device_mesh}, not on the plan's {mesh}; "
                          "parallelize the producing and the consuming module over one mesh.")
    if slot.given is not None and not _agree(x.placements, placements(slot.given, x.ndim)):
        current = from_torch(x.placements)[0]
        raise LayoutError(
            f"{what} arrives laid out {current!r} but the plan declares {slot.given!r}; "
            f"declare {current!r} there, or redistribute it before the call."
        )
    return x


def _agree(have: tuple, want: tuple) -> bool:
    """Equal placements; DTensor's partial kinds (an embedding's masked partial) count as
    the partial sum they are."""
    return have == want or all(
        h == w or (h.is_partial() and w.is_partial() and h.reduce_op == w.reduce_op)
        for h, w in zip(have, want))


def not_a_tensor(x, slot, what: str) -> TypeError:
    if slot.given is None:
        layout = repr(slot.desired)
    elif slot.desired is None:
        layout = repr(slot.given)
    else:
        layout = f"{slot.given!r} -> {slot.desired!r}"
    return TypeError(f"{what} is declared {layout} but is {type(x).__name__}, not a tensor; "
                     "mark it None to leave it alone.")


def _convert(x, slot, mesh, local: bool, what: str):
    """One input or output through its slot."""
    if x is None or slot.untouched:
        return x
    if isinstance(x, DTensor):
        dt = checked(x, slot, mesh, what)
        current = dt.placements
    elif isinstance(x, torch.Tensor):
        current = placements(slot.given if slot.given is not None else slot.desired, x.ndim)
        shape = SHAPES.recall(x, current, mesh)
        dt = DTensor.from_local(x, mesh, current, run_check=False,
                                shape=shape, stride=contiguous_strides(shape))
    else:
        raise not_a_tensor(x, slot, what)
    if slot.desired is not None:
        wanted = placements(slot.desired, x.ndim)
        if wanted != current:
            try:
                dt = dt.redistribute(mesh, wanted)
            except RuntimeError as error:
                raise failed(what, from_torch(current), from_torch(wanted), error) from error
    if not local:
        return dt
    out = dt.to_local()
    SHAPES.remember(out, dt.placements, dt.shape, dt.device_mesh)
    return out


class _Anything(nn.Module):
    def forward(self, *args, **kwargs):
        return args, kwargs


@functools.lru_cache(maxsize=256)
def _spec_of(style: Style, side: str):
    kind, name = (Inputs, "prepare_in") if side == "inputs" else (Outputs, "prepare_out")
    if not all(isinstance(s, kind) for s in style.stages):
        raise TypeError(f"prepare_{side}: 'spec' must be a {name}(...) style or the spec a "
                        f"mounted module holds (got {style!r}).")
    mount = bind(style, _Anything())
    return attrs.evolve(mount.inputs if side == "inputs" else mount.outputs,
                        where=f"prepare_{side}")


def prepare_inputs(args: tuple, kwargs: dict, spec, mesh) -> tuple:
    """``(args, kwargs)`` with every input that ``spec`` names converted (new containers).

    ``spec``: a ``prepare_in(...)`` style, or the ``InputSpec`` of a mounted module.

    >>> import torch, tpfn
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (1,))
    >>> (x,), _ = prepare_inputs((torch.ones(2, 3),), {}, tpfn.prepare_in(tpfn.Shard(0)), mesh)
    >>> x.placements, x.shape
    ((Shard(dim=0),), torch.Size([2, 3]))
    """
    if isinstance(spec, Style):
        spec = _spec_of(spec, "inputs")
    args, kwargs = list(args), dict(kwargs)
    for i, slot in enumerate(spec.slots):
        what = f"input {i} of {spec.where}"
        if i < len(args):
            args[i] = _convert(args[i], slot, mesh, spec.local, what)
        elif i < len(spec.names) and spec.names[i] in kwargs:
            name = spec.names[i]
            kwargs[name] = _convert(kwargs[name], slot, mesh, spec.local, what)
    for name, slot in spec.kwargs:
        if name in kwargs:
            kwargs[name] = _convert(kwargs[name], slot, mesh, spec.local,
                                    f"keyword input {name!r} of {spec.where}")
    return tuple(args), kwargs


def prepare_outputs(outputs, spec, mesh):
    """``outputs`` with every output that ``spec`` names converted (a new container).

    ``spec``: a ``prepare_out(...)`` style, or the ``OutputSpec`` of a mounted module.

    >>> import torch, tpfn
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (1,))
    >>> out = prepare_outputs(torch.ones(4, 2), tpfn.prepare_out(tpfn.Replicate(),
    ...                       given=tpfn.Partial()), mesh)
    >>> type(out).__name__, out.shape              # a local tensor, the partial sums summed
    ('Tensor', torch.Size([4, 2]))
    """
    if isinstance(spec, Style):
        spec = _spec_of(spec, "outputs")
    if isinstance(outputs, dict):
        out = type(outputs)(outputs) if type(outputs) is not dict else dict(outputs)
        names = list(out)
        if len(spec.slots) > len(names):
            raise LayoutError(f"{spec.where} returned {len(names)} outputs; the plan prepares "
                              f"{len(spec.slots)}: give prepare_out one layout (or None) per output.")
        for i, slot in enumerate(spec.slots):
            out[names[i]] = _convert(out[names[i]], slot, mesh, spec.local, f"output {i} of {spec.where}")
        for key, slot in spec.keys:
            if key in out:
                out[key] = _convert(out[key], slot, mesh, spec.local,
                                    f"output {key!r} of {spec.where}")
        return out
    if isinstance(outputs, (tuple, list)):
        if len(spec.slots) > len(outputs):
            raise LayoutError(f"{spec.where} returned {len(outputs)} outputs; the plan prepares "
                              f"{len(spec.slots)}: give prepare_out one layout (or None) per output.")
        items = list(outputs)
        for i, slot in enumerate(spec.slots):
            items[i] = _convert(items[i], slot, mesh, spec.local, f"output {i} of {spec.where}")
        if isinstance(outputs, list):
            return items
        return type(outputs)(*items) if hasattr(outputs, "_fields") else type(outputs)(items)
    if len(spec.slots) > 1:
        raise LayoutError(f"{spec.where} returned one output; the plan prepares {len(spec.slots)}: "
                          "give prepare_out one layout.")
    if not spec.slots:
        return outputs
    return _convert(outputs, spec.slots[0], mesh, spec.local, f"the output of {spec.where}")

