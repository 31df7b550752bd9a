"""``parallelize``: the one place with side effects.

It resolves the plan (pure; any problem raises one ``PlanError`` and leaves the module
untouched), builds the DTensor parameters (the only communication), and only then changes
the module, in two ways and nowhere else:

- every parameter the plan places becomes a DTensor parameter (tied ones stay one);
- every bound module's ``forward`` becomes a ``Runtime``: a context around its computation, by
  the fast kernel its row names (``tpfn.kernels``) where that takes the call, else by the
  reference route (``tpfn.interpret.reference``); and ``load_state_dict`` of one device's whole
  tensors gives each rank its part (a load pre-hook). PyTorch's fused encoder path, which reads a
  layer's weights past its submodules, is turned off for the layers it parallelizes.

Everything a call reads of the module is read as it is then: its parameters (one replaced after
``parallelize`` is used where it is laid out as the plan placed it, else refused by name), its
hooks, whether it trains. Hooks on a bound module see its inputs as they arrive and its outputs
as its style hands them on (a row-wise module's are summed), whenever they were registered.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import threading
import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tpfn._fqn import describe, join
from tpfn._torch import (CONTROL_FLOW, buffers_of, current_mesh, has_pre_hook, move_gradient_hooks, parameters_of,
                         rank_sizes, unsupported_mode)
from tpfn.algebra import cotangent, unpackable
from tpfn.bounded import Bound, announce, seconds
from tpfn.errors import ModuleError, PlanError, module_error
from tpfn.interpret.invariant import caveats, problems, sums_positions
from tpfn.interpret.moves import Move
from tpfn.interpret.prepare import local_value, placed_tensor, shard_params
from tpfn.interpret.reference import Call, param_slots, reference
from tpfn.interpret.state import PartialGrads, State
from tpfn.layout import Partial, Replicate, Shard, from_torch
from tpfn.plans.mount import Mount, local_sizes
from tpfn.plans.plan import Plan, resolve
from tpfn.plans.refusals import refusals, tied_outside
from tpfn.style.style import Style
from tpfn.tree import chunks_of

__all__ = ["parallelize", "mounted", "runtime", "Runtime", "FAST", "INVARIANT", "PROOFS"]

log = logging.getLogger("tpfn")

FAST: dict = {}
"""The fast kernels by the name a row gives them (``Meaning.fast``): ``call(c)`` computes the call
``c`` (a ``tpfn.interpret.reference.Call``), or returns None for the reference route to compute
it. ``tpfn.kernels`` registers them."""

INVARIANT: dict = {}
"""The kernels of invariant mode by the same names: ``call(c)`` computes the call ``c`` in the
canonical order (``tpfn.tree``), or raises an error naming the module; never None."""

PROOFS: dict = {}
"""What proves a plan before ``parallelize(..., check=...)`` changes anything:
``PROOFS["check"](module, plan, world_size, example_inputs)`` raises its findings as one
``PlanError`` (``tpfn.analysis`` registers ``tpfn.check``'s ``prove``)."""

_STREAMS = itertools.count()  # numbers the bound modules' random streams, in the order they are bound
_CALLS = threading.local()  # how many bound modules' calls this thread is inside


class Runtime:
    """A bound module's ``forward``: its ``mount`` run on ``mesh``. Around the computation, a
    context: a mode tpfn cannot follow refused; the parameters checked as they are now; the
    attributes its style holds per rank set; an error named (the module, the likely cause) and,
    where it leaves the outermost bound module, told to the other ranks (torch's control flow,
    a checkpoint's early stop, is no error). Inside, ``fast(call)`` (the kernel its row names),
    else ``reference(call)``. ``state`` is what the parallelized model shares; ``cache`` keeps
    this module's moves and gradient specs; ``partial`` watches its parameters whose gradients
    are partial sums until the end of the backward. In invariant mode ``tree`` is the number of
    chunks of the canonical tree (``tpfn.tree``; None: the default mode) and ``tokens`` whether the
    reference route runs it per chunk of the sequence (``tpfn.interpret.invariant``)."""

    def __init__(self, mount: Mount, mesh, state: State, module: nn.Module, overlap: bool = True, fast=None):
        self.mount, self.mesh, self.state, self.module = mount, mesh, state, module
        self.overlap, self.fast, self.tree = overlap, fast, state.tree
        self.forward, self.cache = module.forward, {}
        self.tokens = state.tree is not None and sums_positions(mount)
        shards = mount.shards
        self.grads = tuple(  # the layout of each input's gradient: as it computes, else the cotangent
            shards.grads[i] if shards is not None and i < len(shards.desired) and shards.desired[i] is not None
            else None if s.untouched else cotangent(s.out)[0] for i, s in enumerate(mount.inputs.slots))
        self.slots = param_slots(module, mount) if shards is not None else ()
        self.placed = tuple(_placed(module, mount.fqn, name, layout) for name, layout in mount.params
                            if isinstance(placed_tensor(module, name), DTensor))
        self.seen = [None] * len(self.placed)  # the tensors found laid out as placed
        self.partial = PartialGrads(None if state.bound is None else state.bound.seconds, state.tree is not None)
        whole = state.tree is not None and fast is not None  # (invariant kernels: their heads' gradients summed)
        for name, layout in (shards.param_grads if shards is not None and not whole else ()):
            if isinstance(layout, Partial):  # partial sums, summed at the end of a backward through its output
                self.partial.watch(module, name, join(mount.fqn, name))  # (frozen or not: it may be unfrozen)
        self.sizes = tuple((*path.rpartition(".")[::2], *v) for path, *v in local_sizes(mount, module, mesh.size())[0])
        self.stream = f"{next(_STREAMS)}:{mount.fqn}"  # its own random stream's key, the same run to run
        self.readers = ()  # its children whose fast kernels read its local replicas (parallelize sets them)
        first = mount.inputs.slots[0] if mount.inputs.slots else None  # a fast kernel's input: a replica whose
        self.reads = fast is not None and first is not None and first.grad is None and mount.inputs.arity in (
            None, 1) and first.source == first.out == Replicate() and self.grads[0] == Partial()  # gradient is partial

    def move(self, src, dst, grad, shape: tuple, dtype, to=None) -> Move:
        """The ``Move`` of a local tensor of global ``shape`` and ``dtype`` (``tpfn.interpret.moves``), made once."""
        key = (src, dst, grad, rank_sizes(shape), dtype, to)  # (sizes that differ by simulated rank: hashable)
        found = self.cache.get(key)
        if found is None:
            found = self.cache[key] = Move(src, dst, grad, self.mesh, shape, self.state.bound, to,
                                           self.tree is not None)
        return found

    def __call__(self, *args, **kwargs):
        compiling = torch.compiler.is_compiling()
        if not compiling:
            if (refused := unsupported_mode()) is not None:
                raise RuntimeError(f"{self.mount.where}: {refused}")
            self._check()
        if self.state.observer is not None:
            self.state.observer.inputs(self, args, kwargs)
        depth = 0 if compiling else getattr(_CALLS, "depth", 0)
        call, held = Call(self, args, kwargs), []
        try:
            if not compiling:
                _CALLS.depth = depth + 1
            for owner, name, whole, value in self.sizes:  # its attributes hold their per-rank values (per_rank)
                holder = operator.attrgetter(owner)(self.module) if owner else self.module
                if (now := getattr(holder, name)) not in (whole, value):
                    raise ModuleError(f"{self.mount.where}: {join(owner, name)} is {now!r}, not the {whole} whose "
                                      f"per-rank value parallelize made {value}; set it before parallelize.")
                held.append((holder, name, now))
                setattr(holder, name, value)
            output = None if self.fast is None else self.fast(call)
            if output is None:
                output = reference(call)
        except BaseException as error:
            if compiling or isinstance(error, CONTROL_FLOW):  # (torch's own control flow: no error)
                raise
            named = module_error(error, self.mount, self.module, call.first)
            if depth == 0:  # leaving every bound module: the other ranks stop waiting for this one
                announce(error if named is None else named, self.state.bound)
            if named is not None:
                raise named from error
            raise
        finally:
            if not compiling:
                _CALLS.depth = depth
            for holder, name, value in reversed(held):
                setattr(holder, name, value)
        if self.partial.watched and torch.is_grad_enabled():
            self.partial.arm(output)
        return output

    def _check(self) -> None:
        """Refuse, by name, a parameter replaced since ``parallelize`` by one not laid out as placed."""
        for i, (table, leaf, owner, layout, placements, mesh) in enumerate(self.placed):
            now = table[leaf]
            if now is self.seen[i]:
                continue
            if not (isinstance(now, DTensor) and now.placements == placements and now.device_mesh == mesh):
                held = (f"a DTensor laid out {now.placements} on {now.device_mesh}" if isinstance(now, DTensor)
                        else f"a {type(now).__name__}")
                raise ModuleError(
                    f"{self.mount.where}: parameter {leaf!r} of {owner!r} is {held}, but parallelize placed it "
                    f"{layout!r} ({placements} on {mesh}): it was replaced after parallelize. Replace it by a "
                    "DTensor laid out alike (nn.Parameter(distribute_tensor(value, mesh, placements))), or "
                    "copy values into the one there (load_state_dict, or copy_ under torch.no_grad()).")
            self.seen[i] = now


def _placed(module: nn.Module, fqn: str, name: str, layout) -> tuple:
    """``(table, leaf, owner's FQN, layout, torch placements, mesh)`` of the parameter ``name``
    of the bound ``module`` (``fqn``) that ``parallelize`` placed, as it is now."""
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner)
    table = parameters_of(sub) if leaf in parameters_of(sub) else buffers_of(sub)
    return table, leaf, join(fqn, owner) or "<root>", layout, table[leaf].placements, table[leaf].device_mesh


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
                timeout: float | None = None, invariant: bool | int = False, check: object = False) -> nn.Module:
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
    (``tpfn.bounded``; docs/errors.md). ``invariant``: every sum over a dim the ranks split (a
    row-wise linear's, a column-wise one's input gradient, a sequence-parallel norm's parameter
    gradients) in one canonical order, the same at every degree: the same bits on 1, 2, 4 or 8 ranks
    (True: 8 chunks, ``tpfn.tree.CHUNKS``; a power of two: that many, at least the mesh size;
    docs/invariance.md). What it cannot order is refused by name.

    ``check``: ``True``, or the example inputs of one forward, proves the plan first, op by op
    on fake ranks (``tpfn.check``): its findings are problems of the ``PlanError`` below.

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
    >>> same = tpfn.parallelize(nn.Linear(8, 8), mesh, tpfn.rowwise(), invariant=True)  # any degree, one bit pattern
    """
    for flag, value in (("overlap", overlap), ("kernels", kernels)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag!r} must be True or False (got {value!r}).")
    if not isinstance(module, nn.Module):
        raise TypeError(f"'module' must be an nn.Module (got {module!r} that is a {type(module)!r}).")
    if plan is None:
        raise TypeError("parallelize needs a plan: a dict of FQN pattern -> style, a tpfn.plan(...), "
                        "or one style for the module itself (PyTorch plans: tpfn.from_torch(plan)).")
    chunks = chunks_of(invariant)
    if chunks is not None and not kernels:
        raise ValueError("invariant=True computes every linear with its kernel in the canonical order, and "
                         "kernels=False runs none; leave kernels at True.")
    mesh = current_mesh() if mesh is None else mesh
    _check_mesh(mesh, src_rank)
    if check is not False:
        PROOFS["check"](module, plan, mesh.size(), None if check is True else check)
    state = State(Bound(mesh.get_group(), mesh.device_type, seconds(timeout)), chunks)
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
    fits = [(m, m.row.fits(modules[m.fqn], mesh.size())) for m in bound
            if m.row is not None and m.row.fits is not None]  # n ranks and the kind's needs
    found += [f"{m.style!r} at {m.where}: {why}" for m, why in fits if why]
    found += [why for m in bound for why in local_sizes(m, modules[m.fqn], mesh.size())[1]]
    found += refusals(modules, bound, mesh.size())
    if state.tree is not None:
        found += problems(modules, bound, mesh.size(), state.tree)
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
    for m in bound:
        sub = modules[m.fqn]
        fast = (FAST if state.tree is None else INVARIANT).get(m.row.fast) if kernels and m.row is not None else None
        sub.forward = Runtime(m, mesh, state, sub, overlap, fast)
        if m.params:
            sub.register_load_state_dict_pre_hook(_whole_to_shards)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("parallelize: %s", m)
    for m in bound:  # a parent's local replica, read by its children's fast kernels
        parent = runtime(modules[m.fqn.rpartition(".")[0]]) if m.fqn else None
        if parent is not None and parent.mount.shards is None and parent.mount.inputs.local \
                and runtime(modules[m.fqn]).reads:
            parent.readers += (modules[m.fqn],)
    for fqn, problem in tied_outside(modules, bound).items():
        modules[fqn].register_forward_pre_hook(functools.partial(_refused, problem))
    for caveat in caveats(bound, mesh.size()) if state.tree is not None else ():
        warnings.warn(caveat, stacklevel=3)
    _no_fused_paths(module)
    return module


def _refused(problem: str, module, args) -> None:
    """A forward pre-hook on a module that would compute with another's shard: refused by name,
    unless a later ``parallelize`` bound it (a model parallelized part by part)."""
    if runtime(module) is None:
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
