"""``parallelize``: the one place with side effects.

It resolves the plan (pure; any problem raises one ``PlanError`` and leaves the module
untouched), builds the DTensor parameters (the only communication), and only then changes
the module, in two ways and nowhere else:

- every parameter the plan places becomes a DTensor parameter (tied ones stay one);
- every bound module's ``forward`` becomes a ``Runtime``: its inputs through their slots,
  the module's own forward, its outputs through their slots. A module that computes on local
  shards (a ``Kernel``) is handed its parameters' local shards for the duration of its own
  forward only; a ``finally`` puts the DTensor parameters back, so no exception,
  ``KeyboardInterrupt`` or hook can see or keep the swap.

Hooks on a bound module see its inputs as they arrive and its outputs as its style hands
them on (a row-wise module's are summed), whenever they were registered.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tpfn._fqn import describe, join
from tpfn._torch import current_mesh
from tpfn.algebra import cotangent
from tpfn.errors import PlanError
from tpfn.interpret.moves import (Rows, Siblings, direct, dropout_slice, linear, local_params, param_slots,
                                  placements, reads_shared, shared, vocab_mask, writable)
from tpfn.interpret.prepare import (convert, global_shape, placed_tensor, prepare_inputs, prepare_outputs,
                                    shard_params, unpackable)
from tpfn.interpret.rng import sharded
from tpfn.interpret.state import State
from tpfn.layout import Partial, from_torch
from tpfn.plans.mount import Mount
from tpfn.plans.plan import Plan, resolve
from tpfn.style.style import Style

__all__ = ["parallelize", "mounted", "runtime", "Runtime"]

log = logging.getLogger("tpfn")


class Runtime:
    """A bound module's ``forward``: its mount run on ``mesh``, around the module's own
    forward. ``state`` is what the parallelized model remembers; ``cache`` keeps the specs
    of this module's moves; ``watch(label, value)``, when set, sees every slot's value as it
    arrives, and ``starts(args, kwargs)`` the inputs as the module's own computation starts
    (``tpfn.explain`` reads layouts, and where each slot's moves end, with them)."""

    def __init__(self, mount, mesh, state: State, module: nn.Module, overlap: bool = True, kernels: bool = True):
        self.mount, self.mesh, self.state, self.module = mount, mesh, state, module
        self.kernels = kernels
        self.overlap, self.cache, self.watch, self.starts = overlap, {}, None, None
        self.siblings = None  # the linears of its parent (parallelize sets them)
        kernel = mount.kernel
        own = None if kernel is None else kernel.forward  # the kind's forward reads global sizes
        self.forward = module.forward if own is None else functools.partial(own, module, mesh, mount.where)
        self.slots = param_slots(module, mount.owned) if kernel is not None else ()
        self.linear = kernels and kernel is not None and type(module) is nn.Linear and not kernel.vocab \
            and kernel.random is None and getattr(self.forward, "__func__", None) is nn.Linear.forward
        self.grads = tuple(
            kernel.inputs[i][1] if kernel is not None and i < len(kernel.inputs)
            and kernel.inputs[i][0] is not None else (None if s.untouched else cotangent(s.out)[0])
            for i, s in enumerate(mount.inputs.slots))
        out = mount.outputs.slots[0] if kernel is not None and kernel.output is not None else None
        self.out_grad = None if out is None else cotangent(out.out)[0]
        first = mount.inputs.slots[0] if self.linear and mount.inputs.slots \
            and mount.inputs.arity in (None, 1) else None
        # a column-wise linear may read a shared replica as it is (its gradient to the inbox)
        self.reader = kernels and first is not None and not first.untouched and first.grad is None and reads_shared(
            first.source, first.out, self.grads[0], mesh)
        # the forward's overlap: while an input's all-gather runs, the linear's own rows of it
        # (a parent's shared replica: its readers' rows, which parallelize sets)
        self.during = functools.partial(Rows.ahead, (module,)) if overlap and self.linear else None

    def __call__(self, *args, **kwargs):
        mount, kernel, mesh, shapes = self.mount, self.mount.kernel, self.mesh, self.state.shapes
        if self.watch is not None:
            for i, name in enumerate(mount.names or range(len(args))):
                self.watch(f"input {i}", args[i] if i < len(args) else kwargs.get(name))
            for name, _ in mount.inputs.kwargs:
                self.watch(f"input {name!r}", kwargs.get(name))
        if self.reader and len(args) == 1 and not kwargs and self.watch is None and self.starts is None \
                and direct(args[0]) and args[0].requires_grad and torch.is_grad_enabled():
            inbox = shared(args[0], mesh)
            if inbox is not None:  # a shared replica's reader: no move, its gradient to the inbox
                inbox.readers += 1
                out = linear(args[0], self.module, kernel, mesh, self.overlap, self.cache, inbox, self.siblings)
                return self._outputs(out, tuple(args[0].shape), owned=writable(out))
        first, shape = self._first(args, kwargs), None
        if kernel is not None and isinstance(first, torch.Tensor) and mount.inputs.slots \
                and not mount.inputs.slots[0].untouched:
            shape = global_shape(first, mount.inputs.slots[0], mesh, shapes,
                                 f"input 0 of {mount.where}", exact=kernel.random == "slice")
        during = self.during if self.during is not None and (
            kernel is None or len(args) == 1 and not kwargs and direct(args[0])) else None
        args, kwargs = prepare_inputs(args, kwargs, mount.inputs, mesh, names=mount.names,
                                      where=mount.where, grads=self.grads, shapes=shapes,
                                      cache=self.cache, first_shape=shape, share=kernel is None and self.kernels,
                                      during=during)
        if kernel is None:
            if self.starts is not None:
                self.starts(args, kwargs)
            return self._outputs(self.forward(*args, **kwargs), None)
        first, mask = self._first(args, kwargs), None
        if kernel.vocab:  # ids outside this rank's vocabulary slice are masked
            ids, mask = vocab_mask(first, self.module, mesh, f"input 0 of {mount.where}")
            args, kwargs = self._with_first(args, kwargs, ids)
        if kernel.random == "slice":  # nn.Dropout: this rank's slice of one device's noise
            if not (self.module.training and self.module.p > 0):
                return self._outputs(first, shape)
            dim = placements(kernel.output, first.ndim)[0].dim
            return self._outputs(first * dropout_slice(self.module, first, shape, dim, mesh), shape)
        if self.linear and len(args) == 1 and not kwargs and direct(args[0]):  # one node, no views
            if self.starts is not None:
                self.starts(args, kwargs)
            out = linear(args[0], self.module, kernel, mesh, self.overlap, self.cache, siblings=self.siblings)
            return self._outputs(out, shape, owned=writable(out))
        views = local_params(self.slots, kernel, mesh, self.cache)
        if self.starts is not None:
            self.starts(args, kwargs)
        saved = [(table, name, table[name]) for table, name, _ in views]
        try:
            for table, name, view in views:
                table[name] = view
            with sharded(mesh) if kernel.random == "fork" else contextlib.nullcontext():
                output = self.forward(*args, **kwargs)
        finally:
            for table, name, param in saved:
                table[name] = param
        if mask is not None and isinstance(output, torch.Tensor):  # a new tensor: its move may write it
            return self._outputs(output.masked_fill(mask.unsqueeze(-1), 0), shape, owned=True)
        return self._outputs(output, shape)

    def _first(self, args, kwargs):
        names = self.mount.names
        return args[0] if args else kwargs.get(names[0]) if names else None

    def _with_first(self, args, kwargs, x):
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, self.mount.names[0]: x}

    def _outputs(self, output, in_shape, owned: bool = False):
        """The module's output through its slots; a kernel's through its declared layout
        (``owned``: a tensor this forward made, which its move may write)."""
        mount, kernel = self.mount, self.mount.kernel
        if self.watch is not None:
            items = list(output.values()) if isinstance(output, dict) else (
                list(output) if isinstance(output, (tuple, list)) else [output])
            for i, x in enumerate(items):
                self.watch(f"output {i}", x)
            for key, _ in mount.outputs.keys:
                if isinstance(output, dict):
                    self.watch(f"output {key!r}", output.get(key))
        if kernel is None or kernel.output is None:
            return prepare_outputs(output, mount.outputs, self.mesh, where=mount.where,
                                   shapes=self.state.shapes, cache=self.cache)
        slot = mount.outputs.slots[0]
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"the output of {mount.where} is {type(output).__name__}, not a tensor, but "
                f"{mount.style!r} declares one output laid out {slot.given!r}; return one "
                "tensor, or leave out output= and lay out the items with prepare_out(..., given=...).")
        shape = kernel.out_shape(self.module, in_shape)
        return convert(output, slot, self.mesh, local=mount.outputs.local, grad=self.out_grad, shape=shape,
                       what=f"the output of {mount.where}", shapes=self.state.shapes, cache=self.cache,
                       owned=owned)


def runtime(module: nn.Module) -> Runtime | None:
    """The ``Runtime`` that ``parallelize`` made ``module``'s forward, or None."""
    forward = vars(module).get("forward")
    return forward if isinstance(forward, Runtime) else None


def mounted(module: nn.Module) -> Mount | None:
    """The ``Mount`` that ``parallelize`` put on ``module``, or None."""
    found = runtime(module)
    return None if found is None else found.mount


def _check_mesh(mesh, src_rank) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"'mesh' must be a torch.distributed DeviceMesh, e.g. init_device_mesh('cpu', (2,)), "
                        f"or given by an enclosing `with mesh:` (got {mesh!r} that is a {type(mesh)!r}).")
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        tp = "tp" if "tp" in names else names[-1] if names else None  # innermost: the fastest links
        hint = f"mesh[{tp!r}]" if tp else "mesh['tp'] (name the dims with mesh_dim_names)"
        raise ValueError(f"parallelize takes the 1-D tensor-parallel mesh, got a {mesh.ndim}-D mesh "
                         f"{tuple(mesh.shape)} with dims {names or 'unnamed'}; pass {hint}.")
    if src_rank is not None and (isinstance(src_rank, bool) or not isinstance(src_rank, int)
                                 or not 0 <= src_rank < mesh.size()):
        raise ValueError(f"'src_rank' must be a rank of the mesh (0..{mesh.size() - 1}) or None "
                         f"(got {src_rank!r}).")


def _placements(modules: dict, mounts: tuple, n: int) -> tuple:
    """``{fqn.name: placement}`` with one entry per parameter object, and the problems found."""
    by_param, found = {}, []
    for mount in mounts:
        sub = modules[mount.fqn]
        for name, placement in mount.params:
            param, full = placed_tensor(sub, name), join(mount.fqn, name)
            if id(param) in by_param:
                first, placed, first_style = by_param[id(param)]
                if placed != placement:
                    found.append(f"parameter {full!r} is tied to {first!r}: {first_style!r} places it "
                                 f"{placed!r} and {mount.style!r} places it {placement!r}; a tied tensor "
                                 "has one layout, so give both modules styles that agree.")
                continue
            by_param[id(param)] = (full, placement, mount.style)
            problem = unpackable(full, param.shape, placement, n)
            if problem:
                found.append(f"{problem[:-1]} ({mount.style!r} at {describe(sub, mount.fqn)}).")
            if isinstance(param, DTensor) and from_torch(param.placements) != (placement,):
                found.append(f"parameter {full!r} is already a DTensor laid out "
                             f"{from_torch(param.placements)}; it cannot become {placement!r}.")
    return {full: placement for full, placement, _ in by_param.values()}, found


def parallelize(module: nn.Module, mesh: DeviceMesh | None = None, plan: Plan | dict | Style | None = None,
                *, src_rank: int | None = 0, overlap: bool = True, kernels: bool = True) -> nn.Module:
    """Parallelize ``module`` over the 1-D ``mesh`` as ``plan`` says; returns ``module``.

    ``mesh`` defaults to that of the enclosing ``with mesh:`` block, as in PyTorch's
    ``parallelize_module``. ``plan`` is a ``tpfn.plan(...)``, a dict of FQN pattern -> style, or one
    style for the module itself. Parameters become DTensor parameters (tied ones stay one parameter);
    each bound module's forward runs its style (see the module docstring). ``src_rank`` is the rank
    whose parameter values every rank receives (PyTorch's ``src_data_rank``); ``None`` keeps each rank's
    own values and communicates nothing (for modules initialized identically, or on the meta device).
    ``overlap``: a column-wise ``nn.Linear`` whose input gradient is reduced (all-reduced, or
    reduce-scattered under sequence parallelism) starts that collective before its weight gradient and
    waits for it after, as Megatron-LM does; the weight gradients of the other linears of its parent
    that ran after it (k, v and o after q; the MLP's second after its first) are computed then too,
    by its backward; ``False`` waits at once (the same collectives, the same numbers, bit for bit).
    ``kernels``: ``False`` runs every bound module through the reference path alone (each input
    moved once to the layout its module computes with, the module's own forward on local views or
    DTensors, each output moved once), which defines what a plan computes.

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
    for flag, value in (("overlap", overlap), ("kernels", kernels)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag!r} must be True or False (got {value!r}).")
    if not isinstance(module, nn.Module):
        raise TypeError(f"'module' must be an nn.Module (got {module!r} that is a {type(module)!r}).")
    if plan is None:
        raise TypeError("parallelize needs a plan: a dict of FQN pattern -> style, a tpfn.plan(...), "
                        "or one style for the module itself (PyTorch plans: tpfn.from_torch(plan)).")
    mesh = current_mesh() if mesh is None else mesh
    _check_mesh(mesh, src_rank)
    bound = resolve(plan, module)
    modules = dict(module.named_modules())
    found = [f"{describe(modules[m.fqn], m.fqn)} is already parallelized "
             f"({mounted(modules[m.fqn]).style!r}); parallelize a fresh module, or "
             "leave it out of this plan." for m in bound if mounted(modules[m.fqn])]
    rule, tied = _placements(modules, bound, mesh.size())
    fits = [(m, m.kernel.fits(modules[m.fqn], mesh.size())) for m in bound
            if m.kernel is not None and m.kernel.fits is not None]  # n ranks and the kind's needs
    found += [f"{m.style!r} at {m.where}: {why}" for m, why in fits if why]
    if found + tied:
        raise PlanError(found + tied)

    new = shard_params(module, mesh, rule, src_rank=src_rank)
    replacement = {id(placed_tensor(module, name)): param for name, param in new.items()}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, param in list(table.items()):
                if param is not None and id(param) in replacement:
                    table[name] = replacement[id(param)]
    state, linears = State(), {}
    for m in bound:
        sub = modules[m.fqn]
        for name, layout in (m.kernel.grads if m.kernel else ()):
            if isinstance(layout, Partial) and sub.get_parameter(name).requires_grad:
                state.partial_grads.watch(sub.get_parameter(name), join(m.fqn, name))
        sub.forward = Runtime(m, mesh, state, sub, overlap, kernels)
        if sub.forward.linear:
            linears.setdefault(m.fqn.rpartition(".")[0], []).append(sub.forward)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", _described(m, sub))
    for parent, runtimes in linears.items():
        if len(runtimes) > 1:  # a window's siblings: their weight gradients overlap its reduction
            siblings = Siblings(tuple(r.module for r in runtimes))
            for r in runtimes:
                r.siblings = siblings
        owner, readers = runtime(modules[parent]), tuple(r.module for r in runtimes if r.reader)
        if overlap and kernels and readers and owner is not None and owner.mount.kernel is None:
            owner.during = functools.partial(Rows.ahead, readers)  # their rows while its input gathers
    return module


def _described(mount, module: nn.Module) -> str:
    """One line of what ``parallelize`` mounted on ``module``, for the ``tpfn`` logger."""
    slots = [*(f"input {i} {s.given!r} -> {s.out!r}" for i, s in enumerate(mount.inputs.slots)
               if not s.untouched),
             *(f"output {i} {s.given!r} -> {s.out!r}" for i, s in enumerate(mount.outputs.slots))]
    placed = ", ".join(f"{n} {p!r}" for n, p in mount.params) or "no parameters"
    how = "on local shards" if mount.kernel is not None else "on DTensors"
    return (f"parallelize: {describe(module, mount.fqn)} {mount.style!r}: {placed}; "
            f"{'; '.join(slots) or 'no slots'}; computes {how}")
