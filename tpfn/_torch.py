"""Every private PyTorch API tpfn relies on, in one place: one file to fix per torch release."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._C._distributed_c10d import (  # noqa: F401
    FakeProcessGroup,
    ProcessGroup,
    _register_process_group as register_process_group,
    _resolve_process_group as resolve_process_group,
    _unregister_process_group as unregister_process_group,
)
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401
from torch.distributed.tensor._redistribute import redistribute_local_tensor  # noqa: F401
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401
from torch.nn.modules.dropout import _DropoutNd as DropoutNd  # noqa: F401
from torch.nn.modules import batchnorm, pooling
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
from torch.utils.weak import WeakTensorKeyDictionary  # noqa: F401

__all__ = [
    "FakeProcessGroup", "ProcessGroup", "register_process_group", "resolve_process_group",
    "unregister_process_group", "DTensorSpec", "TensorMeta", "redistribute_local_tensor",
    "StridedShard", "DropoutNd", "TorchDispatchMode", "WeakTensorKeyDictionary",
    "MIXING", "assert_async", "current_mesh", "private_mesh", "queue_callback", "swap_in_place",
    "in_a_graph", "local_tensor", "spec_of", "keep_mesh",
]


# Modules that combine positions (batch statistics, groups of channels, windows): computed on a
# shard of the sequence they give other numbers than on the whole sequence.
MIXING = (batchnorm._NormBase, nn.GroupNorm, nn.LocalResponseNorm, pooling._MaxPoolNd,
          pooling._AvgPoolNd, pooling._AdaptiveMaxPoolNd, pooling._AdaptiveAvgPoolNd,
          pooling._LPPoolNd, nn.Flatten, nn.Unflatten, nn.Upsample)


def queue_callback(fn) -> None:
    """Run ``fn`` when the running backward ends."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


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


def assert_async(condition: torch.Tensor, message: str) -> None:
    """Raise ``message`` where ``condition`` is False, without waiting for the device (on CPU
    at once, on CUDA as a device-side assert, as an out-of-range index does on one device)."""
    torch._assert_async(condition, message)


def private_mesh(name: str, group, world_size: int, rank: int):
    """A 1-D CPU mesh over ``group``, registered under ``name`` for the functional
    collectives, that never becomes (nor needs) the default process group."""
    from torch.distributed.device_mesh import DeviceMesh

    group._set_group_name(name)
    register_process_group(name, group)
    mesh = DeviceMesh("cpu", torch.arange(world_size), mesh_dim_names=(name,),
                      _init_backend=False, _rank=rank)
    mesh._dim_group_names = [name]
    mesh._pg_registry[name] = group
    return mesh


def current_mesh():
    """The mesh of the innermost ``with mesh:`` block, or None."""
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.mesh_stack[-1] if _mesh_resources.mesh_stack else None


def in_a_graph(t: torch.Tensor) -> bool:
    """Whether an autograd graph holds ``t`` (so that it cannot be swapped in place)."""
    return t._use_count() > (2 if t.is_leaf else 1)


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
