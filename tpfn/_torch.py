"""Every private PyTorch API tpfn relies on, in one place: one file to fix per torch release."""

from __future__ import annotations

import copy
import datetime
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._C._distributed_c10d import (  # noqa: F401
    FakeProcessGroup, ProcessGroup, _register_process_group as register_process_group,
    _resolve_process_group as resolve_process_group, _unregister_process_group as unregister_process_group)
from torch.distributed._local_tensor import LocalIntNode, enabled_local_tensor_mode
from torch.distributed._tools.mod_tracker import ModTracker
# per_rank(fn): ``fn`` run once per rank that ``LocalTensorMode`` simulates in one process, on
# that rank's values of the tensors and ints that differ by rank (else called as it is): what
# depends on the rank (its chunk of a replica), computed without communication.
from torch.distributed._local_tensor import maybe_run_for_local_tensor as per_rank  # noqa: F401
from torch.distributed.device_mesh import DeviceMesh, _mesh_resources
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401
from torch.distributed.tensor._redistribute import redistribute_local_tensor  # noqa: F401
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401
from torch.nn.modules.dropout import _DropoutNd as DropoutNd  # noqa: F401
from torch.nn.modules import batchnorm, pooling
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
from torch.utils.module_tracker import ModuleTracker
from torch.utils.weak import WeakTensorKeyDictionary  # noqa: F401

__all__ = [
    "FakeProcessGroup", "ProcessGroup", "register_process_group", "resolve_process_group",
    "unregister_process_group", "DTensorSpec", "TensorMeta", "redistribute_local_tensor", "StridedShard",
    "DropoutNd", "TorchDispatchMode", "WeakTensorKeyDictionary", "MIXING", "assert_async",
    "current_mesh", "private_mesh", "queue_callback", "swap_in_place", "in_a_graph", "local_tensor",
    "spec_of", "keep_mesh", "meta_dtensor", "next_sequence_nr", "has_pre_hook", "hooked",
    "tensor_observed", "sequence_nr", "current_node", "graph_task_id", "will_run", "per_rank",
    "rank_sizes", "simulated_shapes", "parameter", "gradient_hooks", "move_gradient_hooks", "op_packet",
    "CPU_ATTENTION", "nonzero_on_meta", "with_children"]


def _start_autograd_without_fake_devices() -> None:
    """Start autograd's engine now, on a CUDA build on a machine without a GPU (the default
    PyPI wheels of torch 2.14.1 for Linux x86_64 are such builds; a CPU build needs nothing).
    DTensor's sharding propagation enters FakeTensorMode, which registers a fake CUDA device
    guard of 8 devices; an engine started after that runs a thread per fake device and then
    refuses to run in a forked child ("Unable to handle autograd's threading in combination
    with fork-based multiprocessing"), which is what ``tpfn.verify``'s ranks are. Started
    before, it runs on the CPU only, as on a CPU build; once started it stays as it is."""
    if torch.backends.cuda.is_built() and torch.cuda.device_count() == 0:
        torch.zeros((), requires_grad=True).backward()


_start_autograd_without_fake_devices()


# Modules that combine positions (batch statistics, groups of channels, windows): computed on a
# shard of the sequence they give other numbers than on the whole sequence.
MIXING = (batchnorm._NormBase, nn.GroupNorm, nn.LocalResponseNorm, pooling._MaxPoolNd,
          pooling._AvgPoolNd, pooling._AdaptiveMaxPoolNd, pooling._AdaptiveAvgPoolNd,
          pooling._LPPoolNd, nn.Flatten, nn.Unflatten, nn.Upsample)


def queue_callback(fn) -> None:
    """Run ``fn`` when the running backward ends."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


_TRACKERS = (ModTracker, ModuleTracker)


def _user(hook) -> bool:
    """Whether ``hook`` is a user's: not one that only observes, tpfn's recording hooks (marked
    ``observes_only``) and torch's module trackers (``CommDebugMode``'s, ``FlopCounterMode``'s)."""
    return not (getattr(hook, "observes_only", False) or isinstance(getattr(hook, "__self__", None), _TRACKERS))


def has_pre_hook(module: nn.Module, hook) -> bool:
    """Whether ``hook`` is one of ``module``'s own forward pre-hooks."""
    return any(h is hook for h in module._forward_pre_hooks.values())


def hooked(module: nn.Module) -> bool:
    """Whether a user's module hook sees ``module``'s inputs or their gradients (a forward
    pre-hook, forward hook, backward hook or backward pre-hook, its own or a global one), which
    could keep them or read a partial sum; those that only observe (``_user``) aside."""
    m = nn.modules.module
    for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_hooks,
                  module._backward_pre_hooks, m._global_forward_pre_hooks, m._global_forward_hooks,
                  m._global_backward_hooks, m._global_backward_pre_hooks):
        if hooks and any(map(_user, hooks.values())):
            return True
    return False


def tensor_observed(t: torch.Tensor) -> bool:
    """Whether a tensor hook or ``retain_grad`` observes ``t``'s gradient, the hooks torch's
    module trackers put on a module's inputs (to see when its backward begins) aside."""
    return t.retains_grad or any(not _tracks(hook) for hook in (t._backward_hooks or {}).values())


def _tracks(hook, depth: int = 3) -> bool:
    """Whether a tensor hook is a module tracker's: ``register_multi_grad_hook``'s wrapper of a
    function of a tracker (its method, or a closure over it)."""
    if isinstance(getattr(hook, "__self__", None), _TRACKERS):
        return True
    fn = getattr(hook, "__wrapped__", hook)
    for cell in (getattr(fn, "__closure__", None) or ()) if depth else ():
        try:
            held = cell.cell_contents
        except ValueError:  # (an empty cell)
            continue
        if isinstance(held, _TRACKERS) or callable(held) and _tracks(held, depth - 1):
            return True
    return False


def sequence_nr(node) -> int:
    """Autograd node ``node``'s sequence number (the order nodes were made in, on one thread)."""
    return node._sequence_nr()


def current_node():
    """The autograd node the running backward is executing on this thread (None: none)."""
    return torch._C._current_autograd_node()


def graph_task_id() -> int:
    """The id of the running backward (graph task) on this thread, -1 outside one."""
    return torch._C._current_graph_task_id()


def will_run(node) -> bool:
    """Whether the running backward is still to run autograd ``node`` (or runs it now); True
    where torch cannot tell (a leaf's node under ``torch.autograd.grad``, which may take it)."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return True


def next_sequence_nr() -> int:
    """The sequence number autograd gives the next node made on this thread (none is made)."""
    return torch._C._autograd._get_sequence_nr()


def rank_sizes(shape) -> tuple:
    """``shape`` as a hashable tuple: a size that differs by rank under ``LocalTensorMode``
    (an uneven shard) as the ``(rank, size)`` pairs of its ranks."""
    shape = tuple(shape)
    for s in shape:
        if type(s) is not int:
            break
    else:  # plain sizes: the shape itself
        return shape
    return tuple(tuple(sorted(s.node._local_ints.items()))
                 if isinstance(s, torch.SymInt) and isinstance(s.node, LocalIntNode) else s
                 for s in shape)


def simulated_shapes(shape) -> list | None:
    """Under ``LocalTensorMode``, the local ``shape`` of every rank it simulates, in rank
    order (what an all-gather of the ranks' local shapes gives); None outside it."""
    mode = enabled_local_tensor_mode()
    if mode is None:
        return None
    return [tuple(s.node._local_ints[r] if isinstance(s, torch.SymInt)
                  and isinstance(s.node, LocalIntNode) else int(s) for s in shape)
            for r in sorted(mode.ranks)]


def parameter(module: nn.Module, name: str):
    """The parameter ``name`` (dotted) of ``module``, from its owner's ``_parameters``
    (``Module.get_parameter`` rejects one deep-copied under ``LocalTensorMode``)."""
    owner, _, leaf = name.rpartition(".")
    return module.get_submodule(owner)._parameters[leaf]


def local_tensor(dt):
    """A DTensor's local tensor, without autograd (DTensor's own field)."""
    return dt._local_tensor


def spec_of(dt):
    """A DTensor's spec (mesh, placements, global shape and strides)."""
    return dt._spec


def keep_mesh(dt, mesh):
    """``dt`` on ``mesh`` itself: DTensor's sharding caches key on mesh equality, which
    ignores the process group, so an op on a DTensor can hand back one that names another
    mesh over the same ranks (and its group)."""
    if dt.device_mesh is not mesh:
        dt._spec = DTensorSpec(mesh, dt._spec.placements, tensor_meta=dt._spec.tensor_meta)
    return dt


def meta_dtensor(tensor: torch.Tensor, mesh, placements) -> DTensor:
    """The DTensor ``distribute_tensor`` makes of a meta tensor, without splitting it and
    scattering nothing: a meta local tensor of this rank's shape, built at once."""
    placements = tuple(_normal(p, tensor.ndim) for p in placements)
    shape, _ = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(tensor.shape, tensor.stride(), tensor.dtype))
    return DTensor(torch.empty(shape, dtype=tensor.dtype, device="meta"), spec, requires_grad=tensor.requires_grad)


def _normal(placement, ndim: int):
    """``placement`` with a negative shard dim counted from the front, as ``distribute_tensor`` has it."""
    if type(placement) is Shard and placement.dim < 0:
        return Shard(placement.dim % ndim)
    if type(placement) is StridedShard and placement.dim < 0:
        return StridedShard(placement.dim % ndim, split_factor=placement.split_factor)
    return placement


def assert_async(condition: torch.Tensor, message: str) -> None:
    """Raise ``message`` where ``condition`` is False, without waiting for the device (on CPU
    at once, on CUDA as a device-side assert, as an out-of-range index does on one device)."""
    torch._assert_async(condition, message)


def private_mesh(name: str, group, world_size: int, rank: int):
    """A 1-D CPU mesh over ``group``, registered under ``name`` for the functional
    collectives, that never becomes (nor needs) the default process group."""
    group._set_group_name(name)
    register_process_group(name, group)
    mesh = DeviceMesh("cpu", torch.arange(world_size), mesh_dim_names=(name,), _init_backend=False,
                      _rank=rank)
    mesh._dim_group_names = [name]
    mesh._pg_registry[name] = group
    return mesh


def current_mesh():
    """The mesh of the innermost ``with mesh:`` block, or None."""
    return _mesh_resources.mesh_stack[-1] if _mesh_resources.mesh_stack else None


def in_a_graph(t: torch.Tensor) -> bool:
    """Whether an autograd graph holds ``t`` (so that it cannot be swapped in place): saved, or
    a leaf whose gradient accumulator lives (only a graph keeps it; ``swap_tensors`` would let
    the swap through and poison it, and the graph's backward would then fail)."""
    return t._use_count() > 1


def gradient_hooks(t: torch.Tensor) -> int:
    """How many gradient hooks a user registered on the leaf ``t`` (``register_hook``,
    ``register_post_accumulate_grad_hook``)."""
    return len(t._backward_hooks or {}) + len(t._post_accumulate_grad_hooks or {})


def move_gradient_hooks(old: torch.Tensor, new: torch.Tensor) -> None:
    """Give the leaf ``new`` the gradient hooks of the leaf ``old`` that it replaces: the very
    dicts, so that the handles ``register_hook`` returned still remove them."""
    if old._backward_hooks:
        new._backward_hooks = old._backward_hooks
    if old._post_accumulate_grad_hooks:
        new._post_accumulate_grad_hooks = old._post_accumulate_grad_hooks


def swap_in_place(old: torch.Tensor, new: torch.Tensor) -> None:
    """``old`` becomes ``new`` in place (one object: ties, optimizers and names all see it),
    keeping its attributes and its gradient hooks, which live on the tensor swapped out."""
    hooks, post = old._backward_hooks, old._post_accumulate_grad_hooks
    extra = dict(old.__dict__)
    torch.utils.swap_tensors(old, new)
    for k, v in extra.items():
        old.__dict__.setdefault(k, v)
    if hooks:
        old._backward_hooks = hooks
    if post:
        old._post_accumulate_grad_hooks = post


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group, options):
    """Start gathering the ranks' ``x`` into ``out`` (rank-major) on ``group``, any group
    (registered or not), with ``options`` (``collective_options("allgather", ...)``); returns
    the work to wait on."""
    return group._allgather_base(out, x, options)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group, options):
    """Start summing the ranks' ``x`` and scattering it (rank-major) into ``out`` on ``group``,
    with ``options``; returns the work to wait on."""
    return group._reduce_scatter_base(out, x, options)


def all_to_all_into(out: torch.Tensor, x: torch.Tensor, group, options):
    """Start sending chunk ``s`` of ``x`` (equal chunks of dim 0) to rank ``s`` of ``group`` and
    receiving rank ``s``'s chunk for this rank into chunk ``s`` of ``out``, with ``options``
    (``collective_options("alltoall", ...)``); returns the work to wait on."""
    return group.alltoall_base(out, x, [], [], options)


# --- process groups: their backends, timeouts, stores and counts ---------------------------

from torch._C._distributed_c10d import (  # noqa: E402
    AllgatherOptions, AllreduceOptions, AllToAllOptions, BarrierOptions, ReduceScatterOptions)

_OPTIONS = {"allreduce": AllreduceOptions, "allgather": AllgatherOptions,
            "reduce_scatter": ReduceScatterOptions, "alltoall": AllToAllOptions, "barrier": BarrierOptions}


def collective_options(kind: str, timeout: datetime.timedelta, **fields):
    """The options of one ``kind`` of collective (``"allreduce"``, ``"allgather"``,
    ``"reduce_scatter"``, ``"alltoall"``, ``"barrier"``) with its own ``timeout`` and ``fields`` (``reduceOp``)."""
    options = _OPTIONS[kind]()
    options.timeout = timeout
    for name, value in fields.items():
        setattr(options, name, value)
    return options


def backend_of(group, device: str):
    """``group``'s backend for tensors on ``device`` (``"cpu"``, ``"cuda"``), or None."""
    try:
        return group._get_backend(torch.device(device))
    except RuntimeError:
        return None


def backend_timeout(backend) -> datetime.timedelta | None:
    """The timeout a backend gives a collective that names none (None: it has no such setting)."""
    return getattr(getattr(backend, "options", None), "_timeout", None)


def set_backend_timeout(backend, timeout: datetime.timedelta) -> None:
    """Give the collectives issued on ``backend`` from now on ``timeout`` (gloo: per operation;
    NCCL: the watchdog's deadline of each work, read as the work is made)."""
    backend._set_default_timeout(timeout)


def collectives_issued(group) -> int | None:
    """How many collectives this rank has issued on ``group`` (alike on ranks running alike);
    None where its backend does not count them (a group made by hand)."""
    try:
        return group._get_sequence_number_for_group()
    except RuntimeError:
        return None


def group_store(group):
    """The store ``group``'s ranks share (its own prefix of the job's store)."""
    return group.get_group_store()


_VIEWS = itertools.count()  # the number of each heads view this process makes (its names)


def heads_mesh(mesh, heads: int):
    """A 2-D view of the 1-D ``mesh``: ``heads`` groups of consecutive ranks, dim 0 across
    the groups and dim 1 within one (``DeviceMesh._unflatten``; an unnamed mesh of the
    whole world is viewed anew). Its process groups are made, a collective of every rank.
    A mesh of no default group (a dry run's fake one, ``tpfn.verify``'s private gloo one)
    gets groups of its own kind, made from its group's store, registered by name. Each view's
    dim names are its own: meshes compare by ranks and names, so DTensor's caches would hand
    one model's gradients the view (and process groups) of another's."""
    n, names, group = mesh.size(), mesh.mesh_dim_names, mesh.get_group()
    replicas = n // heads
    fake = isinstance(group._get_backend(torch.device("cpu")), FakeProcessGroup)
    if not fake and dist.is_initialized():
        base = f"{names[0] if names else 'tp'}_heads{heads}_{next(_VIEWS)}"
        if names:
            return mesh._unflatten(0, (heads, replicas), (base, base + "_replicas"))
        return DeviceMesh(mesh.device_type, mesh.mesh.view(heads, replicas), mesh_dim_names=(base, base + "_replicas"))
    rank, store = mesh.get_coordinate()[0], group_store(group)
    callers = 1 if fake else n  # a fake mesh is rank 0's alone
    epoch = (store.add("tpfn/heads-views", 1) - 1) // callers  # this view's number, alike on all ranks
    base = f"{names[0]}-heads{heads}-{epoch}"
    grid = torch.arange(n).view(heads, replicas)
    view = DeviceMesh("cpu", grid, mesh_dim_names=(base, base + "-replicas"), _init_backend=False, _rank=rank)
    view._dim_group_names = []
    row, column = divmod(rank, replicas)
    for name, members in zip(view.mesh_dim_names, (grid[:, column], grid[row])):
        size, mine = len(members), int((members == rank).nonzero())
        prefix = f"tpfn/heads-views/{epoch}/{name == base}/{members.tolist()}"
        backend = fake_backend(mine, size) if fake else dist.ProcessGroupGloo(
            dist.PrefixStore(prefix + "/gloo", store), mine, size, datetime.timedelta(seconds=300))
        sub = cpu_group(dist.PrefixStore(prefix, store), mine, size, backend)
        sub._set_group_name(f"{name}-{members.tolist()}")
        register_process_group(sub.group_name, sub)
        view._dim_group_names.append(sub.group_name)
        view._pg_registry[sub.group_name] = sub
    return view


from torch.nn.modules._functions import BackwardHookFunction as _BackwardHookFunction  # noqa: E402

HookIdentity = _BackwardHookFunction._backward_cls
"""The autograd node of the identity that module backward hooks wrap inputs and outputs in."""


# --- autograd nodes of Functions ----------------------------------------------------------


def node_type(function: type) -> type:
    """The class of the autograd nodes that ``torch.autograd.Function`` subclass ``function``
    makes (what ``y.grad_fn`` is an instance of)."""
    return function._backward_cls


# --- ops and functional collectives --------------------------------------------------------


def with_children(module: nn.Module, children: dict) -> nn.Module:
    """A shallow copy of ``module`` whose children are ``children`` (name -> module, in order):
    its parameters, buffers, settings and hooks are ``module``'s own."""
    new = copy.copy(module)
    new._modules = dict(children)
    return new


def nonzero_on_meta():
    """A context in which ``nonzero`` (``torch.where(mask)``, boolean indexing) of a meta tensor
    returns a shape as if every element were nonzero, instead of raising (the routing of a
    sparse mixture of experts, on meta router scores)."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(meta_nonzero_assume_all_nonzero=True)


def grouped_mm_op():
    """ATen's grouped matrix product (transformers' fused experts), or None in a torch without it."""
    packet = getattr(torch.ops.aten, "_grouped_mm", None)
    return getattr(packet, "default", None)


def functional_overload(op):
    """The out-of-place overload of an in-place ATen op (``add_.Tensor`` -> ``add.Tensor``), or None."""
    name = op.overloadpacket.__name__
    packet = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None
    return getattr(packet, op._overloadname, None) if packet is not None else None


def argument_names(op) -> tuple:
    """The names of an ATen/c10d op overload's arguments, in schema order (to read its call's
    ``args`` by name)."""
    return tuple(a.name for a in op._schema.arguments)


def op_packet(op):
    """The overload packet of an op overload (``aten.mm`` of ``aten.mm.default``): what torch's
    FLOP formulas (``torch.utils.flop_counter``) are keyed by."""
    return op._overloadpacket


# the CPU's attention kernels (forward, backward), which the FLOP formulas leave out
CPU_ATTENTION = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)


import torch.distributed._functional_collectives as _funcol  # noqa: E402 (registers _c10d_functional)


def all_reduced(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """The ranks' ``t`` reduced with ``op`` (``"sum"``, ``"max"``, ...) on ``group`` (a group, its
    name, or ``(mesh, dim)``), as a new tensor, waited on; not differentiable."""
    return _funcol.wait_tensor(_funcol.all_reduce(t, op, group))


def all_to_all(t: torch.Tensor, group) -> torch.Tensor:
    """Chunk ``s`` of ``t`` (equal chunks of dim 0) sent to rank ``s`` of ``group`` (as
    ``all_reduced`` takes it), rank ``s``'s chunk for this rank received in chunk ``s``, as a new
    tensor, waited on; not differentiable."""
    return _funcol.wait_tensor(_funcol.all_to_all_single(t.contiguous(), None, None, group))


# --- a module's own tables -----------------------------------------------------------------


def parameters_of(module: nn.Module) -> dict:
    """``module``'s own parameter table, live (``{name: Parameter or None}``, its submodules'
    aside; an entry set here skips ``Module.__setattr__``'s checks)."""
    return module._parameters


def buffers_of(module: nn.Module) -> dict:
    """``module``'s own buffer table, live (``{name: tensor or None}``, its submodules' aside)."""
    return module._buffers


def persistent(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s own buffer ``name`` goes into its ``state_dict``."""
    return name not in module._non_persistent_buffers_set


# --- process groups made by hand -----------------------------------------------------------


def fake_backend(rank: int, size: int):
    """A fake backend (``FakeProcessGroup``) for rank ``rank`` of ``size``: its collectives
    return at once and move nothing."""
    return FakeProcessGroup._create_internal(rank, size)


def cpu_group(store, rank: int, size: int, backend) -> ProcessGroup:
    """A process group over ``store`` whose CPU backend is ``backend`` (a ``ProcessGroupGloo``
    or a ``fake_backend``), unregistered and never the default group."""
    group = ProcessGroup(store, rank, size)
    kind = (ProcessGroup.BackendType.CUSTOM if isinstance(backend, FakeProcessGroup)
            else ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), kind, backend)
    return group


def fake_ranks(mesh) -> bool:
    """Whether ``mesh``'s ranks are fake ones (a ``fake_backend``), which cannot answer."""
    try:
        return isinstance(mesh.get_group()._get_backend(torch.device(mesh.device_type)), FakeProcessGroup)
    except RuntimeError:  # no backend for that device
        return False


__all__ += [
    "all_to_all_into", "all_to_all", "collective_options", "backend_of", "backend_timeout", "set_backend_timeout", "collectives_issued", "group_store",
    "node_type", "argument_names", "functional_overload", "grouped_mm_op", "all_reduced", "parameters_of",
    "buffers_of", "persistent", "fake_backend", "cpu_group", "fake_ranks", "forget_default_group", "unsupported_mode",
    "batched", "CONTROL_FLOW", "unsafe_view"]


_DDP_CLASS = nn.parallel.DistributedDataParallel
_DDP = ("DistributedDataParallel syncs and all-reduces each parameter and gradient as a whole tensor, "
        "and a parallelized model's are DTensors, each rank's shard; for data parallelism with tpfn, "
        "fully_shard the parallelized model on the data-parallel mesh (docs/training.md).")


def unsupported_mode() -> str | None:
    """Why a parallelized module cannot run in the mode torch is in now (what to do instead),
    or None: ``detect_anomaly`` (its check of every gradient is an op DTensor has no sharding
    rule for), ``torch.func`` transforms (they do not run through DTensor parameters), and the
    forward of a ``DistributedDataParallel`` around the model."""
    if _DDP_CLASS._active_ddp_module is not None:
        return _DDP
    if torch.is_anomaly_enabled():
        return ("torch.autograd.detect_anomaly() checks every gradient with aten._is_any_true, which "
                "DTensor has no sharding rule for; find the NaN on one device (the model unparallelized), "
                "or with tpfn.verify, which names the first module whose numbers differ.")
    if batched():
        return ("torch.func transforms (grad, vmap, jacrev, ...) do not run through DTensor parameters; "
                "take gradients with torch.autograd (loss.backward() or torch.autograd.grad).")
    return None


from torch.utils.checkpoint import _StopRecomputationError  # noqa: E402

CONTROL_FLOW = (_StopRecomputationError,)
"""Exceptions torch raises through a module to steer its own control flow, no error (a
non-reentrant checkpoint's early stop of its recomputation)."""


def unsafe_view(t: torch.Tensor, shape) -> torch.Tensor:
    """``t`` in ``shape``, as ATen's own linear hands its rows back: a tensor autograd does not
    track as a view of ``t`` (an in-place op on it is an ordinary one)."""
    return torch.ops.aten._unsafe_view(t, shape)


def batched(t: torch.Tensor | None = None) -> bool:
    """Whether a ``torch.func`` transform runs now (``vmap``, ``grad``), or ``t`` is one of a batch
    (a batched gradient's, ``autograd.grad(..., is_grads_batched=True)``)."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return True
    return t is not None and (torch._C._functorch.is_legacy_batchedtensor(t) or torch._C._functorch.is_batchedtensor(t))


def _collective_on_dtensors(op, args, kwargs):
    raise RuntimeError(f"{op} got DTensors, which a torch.distributed collective cannot move (one of your "
                       f"own takes dtensor.to_local()). {_DDP}")


# DistributedDataParallel(model) broadcasts the parameters first: named there, not as an op
# DTensor has no sharding strategy for (the only thing these ops ever did on DTensors).
DTensor._op_dispatcher._custom_op_handlers.update(
    {op: _collective_on_dtensors for op in (torch.ops.c10d.broadcast_.default, torch.ops.c10d.allreduce_.default)})


_SET_ASIDE: list = []  # in a forked child: the caller's process groups, kept and never used


def forget_default_group() -> None:
    """In a forked child: ``torch.distributed`` as if never initialized, so that the child can
    make its own default group. The caller's groups, copied by the fork, are set aside, never
    used and never freed (their sockets are the caller's)."""
    from torch.distributed import distributed_c10d as c10d

    _SET_ASIDE.append(c10d._world)
    c10d._world = c10d._World()


def global_offset(dt) -> tuple:
    """Where a DTensor's local tensor begins in its global tensor, per dim."""
    return tuple(compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)[1])


def meta_like(dt: DTensor) -> DTensor:
    """A DTensor laid out as ``dt`` whose local tensor is a meta tensor of its local shape (a dry
    run that keeps real values where it can meets a DTensor of real values, ``tpfn.analysis.hybrid``)."""
    return DTensor(dt._local_tensor.to("meta"), dt._spec, requires_grad=dt.requires_grad)


__all__ += ["global_offset", "meta_like"]
