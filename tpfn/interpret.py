"""``parallelize``: the one place with side effects.

It resolves the plan and binds every style first (pure; any problem raises one
``PlanError`` and leaves the module untouched), builds the DTensor parameters (the only
communication), and only then swaps the parameters in and mounts the hooks.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tpfn.algebra import cotangent
from tpfn.bind import InputSpec, describe
from tpfn.errors import PlanError
from tpfn.fns import (
    checked, not_a_tensor, prepare_inputs, prepare_outputs, shard_params, unpackable,
)
from tpfn.grads import reduce_partial_grads
from tpfn.layout import Partial, from_torch
from tpfn.local import (
    dropout_slice, local_params, move, param_slots, placements, vocab_mask,
)
from tpfn.plan import mounts
from tpfn.rng import sharded
from tpfn.shapes import SHAPES, contiguous_strides
from tpfn.style import Slot

__all__ = ["parallelize", "mounted"]

_MOUNTED: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def mounted(module: nn.Module):
    """The ``Mount`` that ``parallelize`` put on ``module``, or None."""
    return _MOUNTED.get(module)


def _check_mesh(mesh, src_rank) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"'mesh' must be a torch.distributed DeviceMesh, e.g. init_device_mesh('cpu', (2,)) "
            f"(got {mesh!r} that is a {type(mesh)!r})."
        )
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        tp = "tp" if "tp" in names else names[-1] if names else None  # innermost: the fastest links
        hint = f"mesh[{tp!r}]" if tp else "mesh['tp'] (name the dims with mesh_dim_names)"
        raise ValueError(
            f"parallelize takes the 1-D tensor-parallel mesh, got a {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)} with dims {names or 'unnamed'}; pass {hint}."
        )
    if src_rank is not None and (isinstance(src_rank, bool) or not isinstance(src_rank, int)
                                 or not 0 <= src_rank < mesh.size()):
        raise ValueError(f"'src_rank' must be a rank of the mesh (0..{mesh.size() - 1}) or None "
                         f"(got {src_rank!r}).")


def _placements(modules: dict, mounts: list, n: int) -> tuple:
    """``{fqn.name: placement}`` with one entry per parameter object, and the problems found."""
    by_param: dict = {}
    found = []
    for mount in mounts:
        sub = modules[mount.fqn]
        for name, placement in mount.params:
            param = sub.get_parameter(name)
            full = ".".join(p for p in (mount.fqn, name) if p)
            if id(param) in by_param:
                first, placed, first_style = by_param[id(param)]
                if placed != placement:
                    found.append(
                        f"parameter {full!r} is tied to {first!r}: {first_style!r} places it "
                        f"{placed!r} and {mount.style!r} places it {placement!r}; a tied tensor "
                        "has one layout, so give both modules styles that agree."
                    )
                continue
            by_param[id(param)] = (full, placement, mount.style)
            problem = unpackable(full, param.shape, placement, n)
            if problem:
                found.append(f"{problem[:-1]} ({mount.style!r} at {describe(sub, mount.fqn)}).")
            if isinstance(param, DTensor) and from_torch(param.placements) != (placement,):
                found.append(f"parameter {full!r} is already a DTensor laid out "
                             f"{from_torch(param.placements)}; it cannot become {placement!r}.")
    return {full: placement for full, placement, _ in by_param.values()}, found


def parallelize(module: nn.Module, mesh: DeviceMesh, plan, *, src_rank: int | None = 0) -> nn.Module:
    """Parallelize ``module`` over the 1-D ``mesh`` as ``plan`` says; returns ``module``.

    ``plan`` is a ``tpfn.plan(...)``, a dict of FQN pattern -> style, or one style for the
    module itself. Parameters become DTensor parameters (tied ones stay one parameter);
    forward hooks prepare inputs and outputs. ``src_rank`` is the rank whose parameter values
    every rank receives (PyTorch's ``src_data_rank``); ``None`` keeps each rank's own values
    and communicates nothing (for modules initialized identically, or on the meta device).

    Every problem (a pattern that matches nothing, a style its module cannot take, a module
    already parallelized, tied parameters placed two ways) is raised as one ``PlanError``
    before anything changes.

    >>> import torch, torch.nn as nn, tpfn
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (1,))   # any 1-D mesh; here one rank
    >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    >>> mlp = tpfn.parallelize(mlp, mesh, {"0": tpfn.colwise(), "2": tpfn.rowwise()})
    >>> mlp[0].weight.placements, mlp(torch.ones(2, 8)).shape
    ((Shard(dim=0),), torch.Size([2, 8]))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"'module' must be an nn.Module (got {module!r} that is a {type(module)!r}).")
    _check_mesh(mesh, src_rank)
    bound = mounts(plan, module)
    modules = dict(module.named_modules())
    found = [f"{describe(modules[m.fqn], m.fqn)} is already parallelized "
             f"({mounted(modules[m.fqn]).style!r}); parallelize a fresh module, or "
             "leave it out of this plan." for m in bound if mounted(modules[m.fqn])]
    rule, tied = _placements(modules, bound, mesh.size())
    if found + tied:
        raise PlanError(found + tied)

    new = shard_params(module, mesh, rule, src_rank=src_rank)
    replacement = {id(module.get_parameter(name)): param for name, param in new.items()}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and id(param) in replacement:
                sub._parameters[name] = replacement[id(param)]
    for m in bound:
        sub = modules[m.fqn]
        for name, layout in (m.kernel.grads if m.kernel else ()):
            if isinstance(layout, Partial) and sub.get_parameter(name).requires_grad:
                reduce_partial_grads.watch(sub.get_parameter(name))
        if m.kernel is not None:
            hooks = _LocalHooks(m, mesh, sub)
            sub.register_forward_pre_hook(hooks.enter, with_kwargs=True)
            sub.register_forward_hook(hooks.leave, always_call=True)
        else:
            if m.inputs.slots or m.inputs.kwargs:
                sub.register_forward_pre_hook(_input_hook(m.inputs, mesh), with_kwargs=True)
            if m.outputs.slots or m.outputs.keys:
                sub.register_forward_hook(_output_hook(m.outputs, mesh))
        _MOUNTED[sub] = m
    return module


def _input_hook(spec, mesh):
    def hook(module, args, kwargs):
        return prepare_inputs(args, kwargs, spec, mesh)
    return hook


def _output_hook(spec, mesh):
    def hook(module, args, output):
        return prepare_outputs(output, spec, mesh)
    return hook


class _LocalHooks:
    """The hooks of a module whose core computes on local tensors (``tpfn.local``).

    ``enter`` moves each input the kernel computes with to its layout, prepares any other
    inputs, and hands the module its parameters' local shards; ``leave`` puts the
    parameters back (also when the forward raised) and moves the output to the wanted layout.
    """

    def __init__(self, mount, mesh, module):
        self.mount, self.mesh, self.kernel = mount, mesh, mount.kernel
        self.slots = param_slots(module)
        spec = mount.inputs
        computed = {i for i, (wanted, _) in enumerate(self.kernel.inputs) if wanted is not None}
        rest = tuple(Slot() if i in computed else s for i, s in enumerate(spec.slots))
        self.others = InputSpec(rest, spec.kwargs, spec.names, True, spec.where)
        self.prepare_others = any(not s.untouched for s in rest) or bool(spec.kwargs)
        self.whats = [f"input {i} of {spec.where}" for i in range(len(self.kernel.inputs))]
        out = mount.outputs.slots[0] if mount.outputs.slots else None
        self.made = None if out is None else out.given  # the kernel's output layout
        self.wanted = None if out is None else out.out
        self.back = None if self.wanted is None else cotangent(self.wanted)[0]
        self.calls: list = []

    def enter(self, module, args, kwargs):
        try:
            return self._enter(module, args, kwargs)
        except BaseException:
            self.calls.append(None)  # ``leave`` still runs (always_call): nothing to undo
            raise

    def _enter(self, module, args, kwargs):
        spec, kernel = self.mount.inputs, self.kernel
        args, kwargs = list(args), dict(kwargs)
        first, first_shape, mask, noise = None, None, None, None
        for i, (wanted, grad) in enumerate(kernel.inputs):
            if wanted is None:
                continue
            if i < len(args):
                holder, key = args, i
            elif i < len(spec.names) and spec.names[i] in kwargs:
                holder, key = kwargs, spec.names[i]
            else:
                continue  # an optional input not passed
            holder[key], shape = self._input(holder[key], spec.slots[i], grad, i)
            if i == 0:
                first, first_shape = holder[key], shape
                if kernel.vocab:
                    holder[key], mask = vocab_mask(holder[key], module, self.mesh)
        if self.prepare_others:
            args, kwargs = prepare_inputs(tuple(args), kwargs, self.others, self.mesh)
        views = local_params(self.slots, kernel, self.mesh)
        random = contextlib.ExitStack()
        if kernel.random == "slice" and module.training and module.p > 0:
            dim = placements(kernel.output, first.ndim)[0].dim
            noise = dropout_slice(module, first, first_shape, dim, self.mesh)
            random.callback(setattr, module, "training", True)
            module.training = False  # the noise is drawn here; the module passes x through
        elif kernel.random == "fork":
            random.enter_context(sharded(self.mesh))
        self.calls.append(([(o, n, o._parameters[n]) for o, n, _ in views], first_shape, mask,
                           noise, random))
        for owner, name, view in views:
            owner._parameters[name] = view
        return tuple(args), kwargs

    def _input(self, x, slot, grad, i):
        """An input in the kernel's layout, as a local tensor, and its global shape."""
        what = self.whats[i]
        if isinstance(x, DTensor):
            dt = checked(x, slot, self.mesh, what)
            wanted = placements(slot.desired, x.ndim) if slot.desired else dt.placements
            if wanted != dt.placements:  # a no-op redistribute would reduce partial gradients
                dt = dt.redistribute(self.mesh, wanted)
            grads = None if grad is None else placements(grad, x.ndim)
            return dt.to_local(grad_placements=grads), tuple(x.shape)
        if not isinstance(x, torch.Tensor):
            raise not_a_tensor(x, slot, what)
        given = slot.given if slot.given is not None else slot.desired
        shape = SHAPES.recall(x, placements(given, x.ndim), self.mesh)
        wanted = slot.desired if slot.desired is not None else given
        return move(x, given, wanted, grad, self.mesh, shape, what), shape

    def leave(self, module, args, output):
        call = self.calls.pop()
        if call is None:  # enter raised; its error propagates
            return None
        saved, shape, mask, noise, random = call
        for owner, name, param in saved:
            owner._parameters[name] = param
        random.close()
        if output is None:  # the forward raised; its error propagates
            return None
        spec = self.mount.outputs
        if self.kernel.output is None:
            return prepare_outputs(output, spec, self.mesh)
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"the output of {spec.where} is {type(output).__name__}, not a tensor, but "
                f"{self.mount.style!r} declares one output laid out {self.made!r}; return one "
                "tensor, or leave out output= and lay out the items with prepare_out(..., given=...).")
        if mask is not None:  # ids outside this rank's vocabulary
            output = output.masked_fill(mask.unsqueeze(-1), 0)
        if noise is not None:
            output = output * noise
        made, wanted = self.made, self.wanted
        out_shape = self.kernel.out_shape(module, shape) or SHAPES.recall(
            output, placements(made, output.ndim), self.mesh)
        out = move(output, made, wanted, self.back, self.mesh, out_shape,
                   f"the output of {spec.where}")
        handed = placements(wanted, out.ndim)
        if spec.local:
            SHAPES.remember(out, handed, out_shape, self.mesh)
            return out
        return DTensor.from_local(out, self.mesh, handed, run_check=False,
                                  shape=out_shape, stride=contiguous_strides(out_shape))
