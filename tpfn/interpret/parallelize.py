"""``parallelize``: the one place with side effects.

It resolves the plan (pure; any problem raises one ``PlanError`` and leaves the module
untouched), builds the DTensor parameters (the only communication), and only then changes
the module, in two ways and nowhere else:

- every parameter the plan places becomes a DTensor parameter (tied ones stay one);
- every bound module's ``forward`` becomes a ``Runtime``: its inputs through their slots,
  its computation (a fast kernel's, ``tpfn.kernels``, or the module's own forward), its
  outputs through their slots; and ``load_state_dict`` of one device's whole tensors gives each
  rank its part (a load pre-hook). PyTorch's fused encoder path, which reads a layer's weights
  past its submodules, is turned off for the layers it parallelizes. A module that computes on local shards (a ``Kernel``) is handed
  its parameters' local shards for the duration of its own forward only; a ``finally`` puts the
  DTensor parameters back, so no exception, ``KeyboardInterrupt`` or hook can see or keep the swap.
  The attributes its style holds per rank (``per_rank``) hold those values for the same span.

Hooks on a bound module see its inputs as they arrive and its outputs as its style hands
them on (a row-wise module's are summed), whenever they were registered.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import operator
import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tpfn._fqn import describe, join
from tpfn._torch import buffers_of, current_mesh, has_pre_hook, move_gradient_hooks, parameters_of, unsupported_mode
from tpfn.algebra import cotangent, unpackable
from tpfn.bounded import Bound, announce, seconds
from tpfn.errors import ModuleError, PlanError, module_error
from tpfn.interpret.moves import Moves, dropout_slice, local_params, param_slots, placements, vocab_mask
from tpfn.interpret.prepare import (Context, convert, global_shape, inputs, local_value, outputs_of, per_head,
                                    placed_tensor, shard_params)
from tpfn.interpret.rng import sharded
from tpfn.interpret.state import State
from tpfn.kernels import KERNELS, Group
from tpfn.layout import Partial, Replicate, Shard, from_torch
from tpfn.plans.mount import Mount, local_sizes
from tpfn.plans.plan import Plan, resolve
from tpfn.plans.refusals import refusals, tied_outside
from tpfn.style.style import Style

__all__ = ["parallelize", "mounted", "runtime", "Runtime"]

log = logging.getLogger("tpfn")

_STREAMS = itertools.count()  # numbers the bound modules' random streams, in the order they are bound


class Runtime:
    """A bound module's ``forward``: its mount run on ``mesh``, in three steps: its inputs
    through their slots; its computation, by the fast kernel its row names where it takes the
    call (``tpfn.kernels``), else by the reference route (the module's own forward on local views
    of its parameters' shards, or on DTensors); its outputs through their slots. ``state`` is what
    the parallelized model remembers; ``cache`` keeps the steps of this module's moves; ``group``
    is the ``tpfn.kernels.Group`` of the parent whose local replica this module may read as it is,
    ``ctx.group`` the one of the replicas this module makes (``parallelize`` sets both);
    ``watch(label, value)``, when set, sees every slot's value as it arrives, and
    ``starts(args, kwargs, made)`` the inputs as the module's own computation starts, with the
    node that moved each where a kernel moved it (``tpfn.explain`` reads layouts, and where each
    slot's moves end, with them). Neither changes the route."""

    def __init__(self, mount, mesh, state: State, module: nn.Module, overlap: bool = True, kernels: bool = True):
        self.mount, self.mesh, self.state, self.module = mount, mesh, state, module
        self.overlap, self.cache, self.watch, self.starts, self.group = overlap, Moves(state.bound), None, None, None
        kernel = mount.kernel
        own = None if kernel is None else kernel.forward  # the kind's forward reads global sizes
        self.forward = module.forward if own is None else functools.partial(own, module, mesh, mount.where)
        self.slots = param_slots(module, mount.owned) if kernel is not None else ()
        self.fast = KERNELS[kernel.fast] if kernels and kernel is not None and kernel.fast else None
        self.grads = tuple(
            kernel.inputs[i][1] if kernel is not None and i < len(kernel.inputs)
            and kernel.inputs[i][0] is not None else (None if s.untouched else cotangent(s.out)[0])
            for i, s in enumerate(mount.inputs.slots))
        out = mount.outputs.slots[0] if kernel is not None and kernel.output is not None else None
        self.out_grad = None if out is None else cotangent(out.out)[0]
        self.ctx = Context(mount.where, mount.names or (), self.grads, state.shapes, self.cache)
        # its parameters' gradients are partial sums: a backward through its output sums them at its end
        self.arms = kernel is not None and any(isinstance(layout, Partial) for _, layout in kernel.grads)
        self.sizes = tuple((*path.rpartition(".")[::2], *v) for path, *v in local_sizes(mount, module, mesh.size())[0])
        self.stream = f"{next(_STREAMS)}:{mount.fqn}"  # its own random stream's key, the same run to run

    def __call__(self, *args, **kwargs):
        if not torch.compiler.is_compiling() and (refused := unsupported_mode()) is not None:
            raise RuntimeError(f"{self.mount.where}: {refused}")
        if self.watch is not None:
            for i, name in enumerate(self.mount.names or range(len(args))):
                self.watch(f"input {i}", args[i] if i < len(args) else kwargs.get(name))
            for name, _ in self.mount.inputs.kwargs:
                self.watch(f"input {name!r}", kwargs.get(name))
        group, held = None if torch.compiler.is_compiling() else self.ctx.group, []
        try:
            for owner, name, whole, value in self.sizes:  # its attributes hold their per-rank values (per_rank)
                holder = operator.attrgetter(owner)(self.module) if owner else self.module
                if (now := getattr(holder, name)) not in (whole, value):
                    raise ModuleError(f"{self.mount.where}: {join(owner, name)} is {now!r}, not the {whole} whose "
                                      f"per-rank value parallelize made {value}; set it before parallelize.")
                held.append((holder, name, now))
                setattr(holder, name, value)
            for name, heads in self.mount.per_head:  # the rows of its heads
                args, kwargs = self._with(args, kwargs, name, lambda x: per_head(
                    x, heads, self.mesh, f"input {name!r} of {self.mount.where}", self.cache))
            if group is None:
                output, shape = self._compute(args, kwargs)
            else:  # its replicas' readers: whether they may leave their gradients partial, as it ends
                group.open()
                output = None
                try:
                    output, shape = self._compute(args, kwargs)
                finally:
                    group.close(output)
        except BaseException as error:  # told to the other ranks; torch's bare error: the module and cause named
            named = module_error(error, self.mount, self.module, self._first(args, kwargs))
            announce(error if named is None else named, self.state.bound)
            if named is not None:
                raise named from error
            raise
        finally:
            for holder, name, value in reversed(held):
                setattr(holder, name, value)
        if self.arms and torch.is_grad_enabled():
            self.state.partial_grads.arm(output)
        return self._outputs(output, shape)

    def _compute(self, args, kwargs) -> tuple:
        """``(the module's output, input 0's global shape or None)``: inputs moved, then computed."""
        mount, kernel, mesh = self.mount, self.mount.kernel, self.mesh
        if kernel is None:
            args, kwargs = inputs(args, kwargs, mount.inputs, mesh, self.ctx)
            if self.starts is not None:
                self.starts(args, kwargs)
            compiling = torch.compiler.is_compiling()  # (DTensor's collectives as it computes: bounded)
            with contextlib.nullcontext() if compiling else self.state.bound.issuing():
                return self.forward(*args, **kwargs), None
        first, shape = self._first(args, kwargs), None
        if first is None and mount.inputs.slots and not mount.inputs.slots[0].untouched:
            raise TypeError(f"input 0 of {mount.where} is None, but {mount.style!r} computes on it "
                            f"({mount.inputs.slots[0].out!r}); pass it a tensor.")
        if isinstance(first, torch.Tensor) and mount.inputs.slots and not mount.inputs.slots[0].untouched:
            shape = global_shape(first, mount.inputs.slots[0], mesh, self.state.shapes,
                                 f"input 0 of {mount.where}", exact=kernel.random == "slice")
        if self.fast is not None and shape is not None and len(args) == 1 and not kwargs:
            found = self.fast(self, first, shape)
            if found is not None:
                if self.starts is not None:  # (its input moved inside the kernel's node)
                    self.starts((found[1],), {}, (found[0].grad_fn,))
                return found[0], shape
        args, kwargs = inputs(args, kwargs, mount.inputs, mesh, self.ctx, first_shape=shape)
        first, mask = self._first(args, kwargs), None
        if kernel.vocab:  # ids outside this rank's vocabulary slice are masked
            ids, mask = vocab_mask(first, self.module, mesh, f"input 0 of {mount.where}")
            args, kwargs = self._with(args, kwargs, 0, lambda _: ids)
        if kernel.random == "slice":  # nn.Dropout: this rank's slice of one device's noise
            if not (self.module.training and self.module.p > 0):
                return first, shape
            dim = placements(kernel.output, first.ndim)[0].dim
            return first * dropout_slice(self.module, first, shape, dim, mesh), shape
        views = local_params(self.slots, kernel, mesh, self.cache)
        if self.starts is not None:
            self.starts(args, kwargs)
        saved = [(table, name, table[name]) for table, name, _ in views]
        try:
            for table, name, view in views:
                table[name] = view
            # in training a seed is drawn, so every call's masks are new; in eval mode the
            # default stream goes on as one device's (tpfn.interpret.rng)
            with sharded(mesh, None if self.module.training else self.stream) if kernel.random == "fork" \
                    else contextlib.nullcontext():
                output = self.forward(*args, **kwargs)
        finally:
            for table, name, param in saved:
                table[name] = param
        if mask is not None and isinstance(output, torch.Tensor):
            output = output.masked_fill(mask.unsqueeze(-1), 0)
        return output, shape

    def _first(self, args, kwargs):
        names = self.mount.names
        return args[0] if args else kwargs.get(names[0]) if names else None

    def _with(self, args, kwargs, key, change):
        """``(args, kwargs)`` with input ``key`` (a position, or a name, passed by keyword or by
        position) changed by ``change``."""
        names = self.mount.names
        i = key if isinstance(key, int) else names.index(key) if key in names else len(args)
        if i < len(args):
            return (*args[:i], change(args[i]), *args[i + 1:]), kwargs
        name = names[i] if isinstance(key, int) else key
        return args, {**kwargs, name: change(kwargs[name])} if kwargs.get(name) is not None else kwargs

    def _outputs(self, output, in_shape):
        """The module's output through its slots; a kernel's through its declared layout."""
        mount, kernel = self.mount, self.mount.kernel
        if self.watch is not None:
            items = list(output.values()) if isinstance(output, dict) else (
                list(output) if isinstance(output, (tuple, list)) else [output])
            for i, x in enumerate(items):
                self.watch(f"output {i}", x)
            for key, _ in mount.outputs.keys:
                if isinstance(output, dict):
                    self.watch(f"output {key!r}", output.get(key))
        if kernel is None or kernel.output is None or mount.outputs.keys:  # (keys: only a dict has them)
            return outputs_of(output, mount.outputs, self.mesh, self.ctx)
        slot = mount.outputs.slots[0]
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"the output of {mount.where} is {type(output).__name__}, not a tensor, but "
                f"{mount.style!r} declares one output laid out {slot.given!r}; return one "
                "tensor, or leave out output= and lay out the items with prepare_out(..., given=...).")
        shape = kernel.out_shape(self.module, in_shape)
        return convert(output, slot, self.mesh, local=mount.outputs.local, grad=self.out_grad, shape=shape,
                       what=f"the output of {mount.where}", shapes=self.state.shapes, cache=self.cache)


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
    if mesh.get_coordinate() is None:
        raise ValueError(f"this rank ({torch.distributed.get_rank()}) is not in the mesh of ranks "
                         f"{mesh.mesh.tolist()}; call parallelize on the mesh's ranks only, or pass each rank "
                         "the mesh it belongs to (mesh['tp'] of init_device_mesh over every rank).")
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
            if isinstance(param, nn.parameter.UninitializedParameter):  # (refused: _unrunnable)
                continue
            if id(param) in by_param:
                first, placed, first_style = by_param[id(param)]
                if placed != placement:
                    found.append(f"parameter {full!r} is tied to {first!r}: {first_style!r} places it "
                                 f"{placed!r} and {mount.style!r} places it {placement!r}; a tied tensor "
                                 "has one layout, so give both modules styles that agree.")
                continue
            by_param[id(param)] = (full, placement, mount.style)
            if isinstance(placement, Shard) and not -param.dim() <= placement.dim < param.dim():
                found.append(f"parameter {full!r} has {param.dim()} dim{'s' * (param.dim() != 1)} "
                             f"(shape {tuple(param.shape)}), so it cannot be {placement!r} "
                             f"({mount.style!r} at {describe(sub, mount.fqn)}); shard a dim in "
                             f"[{-param.dim()}, {param.dim() - 1}], or Replicate() it.")
                continue
            problem = unpackable(full, param.shape, placement, n)
            if problem:
                found.append(f"{problem[:-1]} ({mount.style!r} at {describe(sub, mount.fqn)}).")
            if isinstance(param, DTensor) and from_torch(param.placements) != (placement,):
                found.append(f"parameter {full!r} is already a DTensor laid out "
                             f"{from_torch(param.placements)}; it cannot become {placement!r}.")
    return {full: placement for full, placement, _ in by_param.values()}, found


def parallelize(module: nn.Module, mesh: DeviceMesh | None = None, plan: Plan | dict | Style | None = None,
                *, src_rank: int | None = 0, overlap: bool = True, kernels: bool = True,
                timeout: float | None = None) -> nn.Module:
    """Parallelize ``module`` over the 1-D ``mesh`` as ``plan`` says; returns ``module``.

    ``mesh`` defaults to that of the enclosing ``with mesh:`` block, as in PyTorch's
    ``parallelize_module``. ``plan`` is a ``tpfn.plan(...)``, a dict of FQN pattern -> style, or one
    style for the module itself. Parameters become DTensor parameters (tied ones stay one parameter);
    each bound module's forward runs its style (see the module docstring). ``src_rank`` is the rank
    whose parameter values every rank receives (PyTorch's ``src_data_rank``); ``None`` keeps each rank's
    own values and communicates nothing (for modules initialized identically, or on the meta device).
    ``overlap``: a linear kernel whose input gradient its slot reduces (all-reduced, or
    reduce-scattered under sequence parallelism) starts that collective before its weight
    gradient and waits for it after, as Megatron-LM does; ``False`` waits at once (the same
    collectives, the same numbers, bit for bit). ``kernels``: ``False`` runs every bound module
    through the reference route alone (each input moved once to the layout its module computes
    with, the module's own forward on local views or DTensors, each output moved once), which
    defines what a plan computes; ``True`` lets a module kind's fast kernel compute a call where it
    gives the same numbers and observer behaviour (docs/semantics.md). ``timeout``: seconds (or a
    ``timedelta``) each of the model's collectives waits at most, from ``parallelize``'s own
    transfer on; None takes the process group's timeout, at most 10 minutes. A collective that
    fails or passes it raises a ``CollectiveError`` naming it, its slot and the ranks that had not
    reached it, and an error raised in a bound module stops the ranks waiting for this one at once
    (``tpfn.bounded``; docs/errors.md).

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
    state = State(Bound(mesh.get_group(), mesh.device_type, seconds(timeout)))
    try:
        return _parallelize(module, mesh, plan, src_rank, overlap, kernels, state)
    except BaseException as error:  # a rank that raises alone: the others stop at once
        announce(error, state.bound)
        raise


def _parallelize(module, mesh, plan, src_rank, overlap: bool, kernels: bool, state: State) -> nn.Module:
    bound = resolve(plan, module)
    if not bound:  # as parallelize_module with no plan: the module as it is, with a word
        warnings.warn(f"the plan binds no module of {type(module).__name__}: parallelize shards nothing, "
                      "and every rank holds and computes the whole model; give it rules (docs/plans.md).",
                      stacklevel=2)
    modules = dict(module.named_modules())
    found = [f"{describe(modules[m.fqn], m.fqn)} is already parallelized "
             f"({mounted(modules[m.fqn]).style!r}); parallelize a fresh module, or "
             "leave it out of this plan." for m in bound if mounted(modules[m.fqn])]
    rule, tied = _placements(modules, bound, mesh.size())
    fits = [(m, m.kernel.fits(modules[m.fqn], mesh.size())) for m in bound
            if m.kernel is not None and m.kernel.fits is not None]  # n ranks and the kind's needs
    found += [f"{m.style!r} at {m.where}: {why}" for m, why in fits if why]
    found += [why for m in bound for why in local_sizes(m, modules[m.fqn], mesh.size())[1]]
    found += refusals(modules, bound, mesh.size())
    if found + tied:
        raise PlanError(found + tied)

    new = shard_params(module, mesh, rule, src_rank=src_rank, timeout=state.bound.seconds)
    replacement = {}
    for name, param in new.items():
        old = placed_tensor(module, name)
        move_gradient_hooks(old, param)  # a user's hooks stay with the parameter they were put on
        replacement[id(old)] = param
    for sub in module.modules():
        for table in (parameters_of(sub), buffers_of(sub)):
            for name, param in list(table.items()):
                if param is not None and id(param) in replacement:
                    table[name] = replacement[id(param)]
    readers = {}
    for m in bound:
        sub = modules[m.fqn]
        for name, layout in (m.kernel.grads if m.kernel else ()):
            if isinstance(layout, Partial):  # (frozen now or not: it may be unfrozen later)
                state.partial_grads.watch(sub, name, join(m.fqn, name))
        sub.forward = Runtime(m, mesh, state, sub, overlap, kernels)
        if m.params:
            sub.register_load_state_dict_pre_hook(_whole_to_shards)
        if _reads_replica(sub.forward):
            readers.setdefault(m.fqn.rpartition(".")[0], []).append(sub.forward)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("parallelize: %s", m)
    for parent, readers in readers.items():
        owner = runtime(modules[parent])
        if kernels and owner is not None and owner.mount.kernel is None:  # its replicas, read as they are
            owner.ctx.group = Group()
            for reader in readers:
                reader.group = owner.ctx.group
    for fqn, problem in tied_outside(modules, bound).items():
        modules[fqn].register_forward_pre_hook(functools.partial(_refused, problem))
    _no_fused_paths(module)
    return module


def _refused(problem: str, module, args) -> None:
    """A forward pre-hook on a module that would compute with another's shard: refused by name."""
    raise PlanError([problem])


def _whole_to_shards(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """``load_state_dict`` of a whole (plain) tensor into a parameter the bound ``module``'s style
    placed: this rank's part of it, as a DTensor laid out as the parameter (each rank holds the
    whole state, as one device's ``state_dict()`` gives it). A parameter laid out on more mesh
    dims than its layout's (``fully_shard`` since) is left to torch."""
    rt = runtime(module)
    for name, layout in rt.mount.params if rt is not None else ():
        key, target = prefix + name, placed_tensor(module, name)
        value = state_dict.get(key)
        dims = 2 if isinstance(layout, Shard) and layout.heads is not None and rt.mesh.size() > layout.heads else 1
        if isinstance(target, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                and value.shape == target.shape and len(target.placements) == dims:
            state_dict[key] = DTensor.from_local(local_value(value, layout, rt.mesh), target.device_mesh,
                                                 target.placements, run_check=False, shape=target.shape,
                                                 stride=target.stride())


def _observes(module, args) -> None:
    """A forward pre-hook that does nothing: a layer with hooks computes by its submodules."""


_observes.observes_only = True


def _no_fused_paths(module: nn.Module) -> None:
    """PyTorch's fused encoder path (eval under no_grad) reads a layer's weights directly, past
    its bound submodules: an ``nn.TransformerEncoderLayer`` holding DTensor parameters gets a
    pre-hook that only observes (which turns that path off), an ``nn.TransformerEncoder`` of
    such layers no nested tensors."""
    for sub in module.modules():
        if isinstance(sub, (nn.TransformerEncoderLayer, nn.TransformerEncoder)) \
                and any(isinstance(p, DTensor) for p in sub.parameters()):
            if isinstance(sub, nn.TransformerEncoder):
                sub.use_nested_tensor = False
            elif not has_pre_hook(sub, _observes):
                sub.register_forward_pre_hook(_observes)


def _reads_replica(rt: Runtime) -> bool:
    """Whether ``rt``'s fast kernel may read its parent's local replica as it is: one input, a
    replica left so, whose gradient comes back as partial sums."""
    slots, grads = rt.mount.inputs.slots, rt.grads
    if rt.fast is None or not slots or rt.mount.inputs.arity not in (None, 1) or rt.mesh.size() == 1:
        return False
    first = slots[0]
    return not first.untouched and first.grad is None and isinstance(first.source, Replicate) \
        and isinstance(first.out, Replicate) and isinstance(grads[0], Partial) and grads[0].op == "sum"
