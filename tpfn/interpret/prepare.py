"""The three functions that do the work, none of which mutates its arguments (``parallelize``
mounts them on modules):

- ``shard_params(module, mesh, rule)``: ``{name: nn.Parameter(DTensor)}``, laid out as ``rule`` says;
- ``prepare_inputs(args, kwargs, spec, mesh)``: the inputs annotated with their given layout,
  redistributed to the desired one, as local tensors or DTensors (``spec``: ``prepare_in(...)``);
- ``prepare_outputs(outputs, spec, mesh)``: the same for a module's outputs (a tensor, the
  items of a tuple or list, the values of a dict; ``spec``: ``prepare_out(...)``).

The last two convert each slot as the reference route does (``tpfn.interpret.reference``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed import tensor as _dt
from torch.distributed.tensor import DTensor, distribute_tensor

from tpfn._torch import heads_mesh, keep_mesh, meta_dtensor, parameters_of, per_rank
from tpfn.algebra import shard_ranges, unpackable
from tpfn.bounded import Bound, collective
from tpfn.errors import LayoutError
from tpfn.interpret.moves import Move
from tpfn.interpret.reference import inputs
from tpfn.interpret.reference import outputs as _outputs
from tpfn.interpret.state import State
from tpfn.layout import Shard, exact_in_torch, from_torch, to_torch
from tpfn.plans.mount import Mount
from tpfn.style.stages import Inputs, Outputs
from tpfn.style.style import Style

__all__ = ["shard_params", "placed_tensor", "local_value", "prepare_inputs", "prepare_outputs"]


def shard_params(module: nn.Module, mesh: DeviceMesh, rule: dict, *, src_rank: int | None = 0,
                 timeout: float | None = None) -> dict:
    """``{name: nn.Parameter(DTensor)}`` for each parameter named in ``rule`` (a name -> layout
    map), ``{name: DTensor}`` for each buffer. Dotted names reach into submodules. ``src_rank``
    is the rank whose values every rank receives (``None``: each rank keeps its own values, no
    communication), each transfer waiting ``timeout`` seconds at most (``tpfn.bounded``). A
    parameter already a DTensor with that layout on ``mesh`` is returned as is.

    A layout DTensor has no placement for: unequal parts (``Shard(d, parts=(q, k, v))``) become a
    DTensor ``Shard(d)`` of the ranks' chunks of every part, rank after rank; heads replicated over more
    ranks than heads (``Shard(d, heads=h)``), a DTensor ``(Shard(d), Replicate())`` on the view of
    ``mesh`` as ``h`` groups of ranks (``tpfn._torch.heads_mesh``), exact, made once per call."""
    out, views = {}, {}
    for name, layout in rule.items():
        param, is_param = _placed(module, name)
        problem = unpackable(name, param.shape, layout, mesh.size())
        if problem:
            raise LayoutError(problem)
        desired = to_torch(layout)
        if isinstance(param, DTensor):
            if param.device_mesh != mesh or param.placements != desired or not exact_in_torch(layout):
                raise LayoutError(f"parameter {name!r} is already a DTensor laid out "
                                  f"{from_torch(param.placements)} on {param.device_mesh}; it cannot "
                                  f"also be {layout!r} on {mesh}.")
            out[name] = param
            continue
        if param.is_meta and exact_in_torch(layout):  # no values to send: its DTensor at once
            dt, on = meta_dtensor(param, mesh, desired), mesh
        else:
            with collective(f"parallelize's transfer of parameter {name!r} from rank {src_rank}", mesh, timeout):
                dt, on = (distribute_tensor(param, mesh, desired, src_data_rank=src_rank), mesh) \
                    if exact_in_torch(layout) else _beyond_dtensor(param, mesh, layout, src_rank, views)
        if is_param:
            dt = nn.Parameter(dt, requires_grad=param.requires_grad)
        out[name] = keep_mesh(dt, on)
    return out


def placed_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter, or else the buffer, that ``name`` (dotted) names in ``module``."""
    return _placed(module, name)[0]


def _placed(module: nn.Module, name: str) -> tuple:
    """``(placed_tensor(module, name), whether it is a parameter)``: one in the owner's ``_parameters``
    (not an ``isinstance`` test: one deep-copied under ``LocalTensorMode`` is no ``nn.Parameter``)."""
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner)
    params = parameters_of(sub)
    return (params[leaf], True) if leaf in params else (sub.get_buffer(leaf), False)


def local_value(full: torch.Tensor, layout, mesh, rank: int | None = None) -> torch.Tensor:
    """What rank ``rank`` (by default this process's) of the 1-D ``mesh`` holds of the global
    value ``full`` laid out ``layout``: its chunk of every packed part, its group's heads.

    >>> import tpfn
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (1,))
    >>> local_value(torch.arange(8), tpfn.Shard(0, parts=(4, 2, 2)), mesh).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    if not isinstance(layout, Shard):
        return full
    return _local_value(full, layout, mesh.size(), mesh.get_coordinate()[0] if rank is None else rank)


@per_rank  # LocalTensorMode: each simulated rank its own chunks
def _local_value(full: torch.Tensor, layout: Shard, n: int, rank: int) -> torch.Tensor:
    dim = layout.dim % full.ndim
    return torch.cat([full.narrow(dim, start, size)
                      for start, size in shard_ranges(full.shape[dim], layout, n, rank)], dim)


def _beyond_dtensor(param, mesh, layout: Shard, src_rank, views: dict) -> tuple:
    """(the DTensor, its mesh) of a parameter laid out as DTensor has no placement for."""
    whole = param.detach() if src_rank is None else distribute_tensor(
        param.detach(), mesh, [_dt.Replicate()], src_data_rank=src_rank).to_local()
    local, dim, n = local_value(whole, layout, mesh), layout.dim % param.ndim, mesh.size()
    on, placements = mesh, [_dt.Shard(dim)]
    if layout.copies(n) > 1:
        if layout.heads not in views:
            views[layout.heads] = heads_mesh(mesh, layout.heads)
        on, placements = views[layout.heads], [_dt.Shard(dim), _dt.Replicate()]
    dt = DTensor.from_local(local.contiguous(), on, placements, run_check=False,
                            shape=param.shape, stride=param.stride())
    return dt, on


class _Alone:
    """What the reference route reads of a runtime, for a conversion outside any bound module:
    no module, no kernels, a fresh shape memory."""

    grads, readers = (), ()

    def __init__(self, mesh: DeviceMesh, names: tuple, where: str):
        self.mesh, self.cache = mesh, {}
        self.state = State(Bound(mesh.get_group(), mesh.device_type))
        self.mount = Mount("", Style(()), (), Inputs(), Outputs(), names=names, where=where)

    def move(self, src, dst, grad, shape: tuple, dtype, to=None) -> Move:
        return Move(src, dst, grad, self.mesh, shape, self.state.bound, to)


def _spec(spec, kind, name: str, side: str):
    if isinstance(spec, Style) and all(isinstance(s, kind) for s in spec.stages):
        return getattr(spec.normal, side)
    if not isinstance(spec, kind):
        raise TypeError(f"prepare_{side}: 'spec' must be a {name}(...) style or the spec a "
                        f"mounted module holds (got {spec!r}).")
    return spec


def prepare_inputs(args: tuple, kwargs: dict, spec: Style | Inputs, mesh: DeviceMesh, *, names: tuple = (),
                   where: str = "prepare_inputs") -> tuple:
    """``(args, kwargs)`` with every input that ``spec`` (a ``prepare_in(...)`` style, or the
    ``Inputs`` of a mounted module) names converted (new containers); ``names``: the forward's
    positional input names, for inputs passed by keyword; ``where`` names the caller in errors.

    >>> import torch, tpfn
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (1,))
    >>> (x,), _ = prepare_inputs((torch.ones(2, 3),), {}, tpfn.prepare_in(tpfn.Shard(0)), mesh)
    >>> x.placements, x.shape
    ((Shard(dim=0),), torch.Size([2, 3]))
    """
    spec = _spec(spec, Inputs, "prepare_in", "inputs")
    return inputs(args, kwargs, spec, _Alone(mesh, names, where), where)


def prepare_outputs(outputs: object, spec: Style | Outputs, mesh: DeviceMesh, *,
                    where: str = "prepare_outputs") -> object:
    """``outputs`` with every output that ``spec`` (a ``prepare_out(...)`` style, or the
    ``Outputs`` of a mounted module) names converted (a new container).

    >>> import torch, tpfn
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (1,))
    >>> out = prepare_outputs(torch.ones(4, 2), tpfn.prepare_out(tpfn.Replicate(),
    ...                       given=tpfn.Partial()), mesh)
    >>> type(out).__name__, out.shape              # a local tensor, the partial sums summed
    ('Tensor', torch.Size([4, 2]))
    """
    spec = _spec(spec, Outputs, "prepare_out", "outputs")
    return _outputs(outputs, spec, _Alone(mesh, (), where), where)
