"""Fake meshes: ``world_size`` ranks seen from rank 0, whose collectives do nothing.

A fake mesh's process group is private: it is registered under a name of its own for the
functional collectives and never becomes the default group, so a dry run also runs inside a
job (or a test rank) whose default group is initialized, and after the user's own
``init_process_group``/``destroy_process_group``. Meshes compare by ranks and dim names, not
by process group, so DTensor's caches would take a fake mesh for a real one of the same
size: its dim name, unique to it, keeps them apart.

>>> mesh = fake_mesh(8)
>>> mesh.size(), mesh.mesh_dim_names[0].startswith("tpfn-fake-8-"), fake_mesh(8) is mesh
(8, True, True)
"""

from __future__ import annotations

import contextlib
import uuid

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tpfn._torch import (
    cpu_group, fake_backend, private_mesh, resolve_process_group, unregister_process_group,
)

__all__ = ["fake_mesh", "new_fake_mesh", "release"]

_KEPT: dict = {}


def fake_mesh(world_size: int) -> DeviceMesh:
    """A 1-D mesh of ``world_size`` fake ranks seen from rank 0, for code that needs one
    outside a dry run: one per size, kept, and made anew once its group is gone (after
    ``destroy_process_group()``). ``explain`` makes its own with ``new_fake_mesh``."""
    mesh = _KEPT.get(world_size)
    if mesh is not None:
        with contextlib.suppress(RuntimeError, ValueError):  # its group is gone
            resolve_process_group(mesh.mesh_dim_names[0])
            return mesh
    mesh = _KEPT[world_size] = new_fake_mesh(world_size)
    return mesh


def new_fake_mesh(world_size: int) -> DeviceMesh:
    """A new 1-D mesh of ``world_size`` fake ranks seen from rank 0; its group stays
    registered until ``release``."""
    name = f"tpfn-fake-{world_size}-{uuid.uuid4().hex[:8]}"
    group = cpu_group(dist.HashStore(), 0, world_size, fake_backend(0, world_size))
    return private_mesh(name, group, world_size, 0)


def release(mesh: DeviceMesh) -> None:
    """Unregister the group of a fake mesh from ``new_fake_mesh`` (gone already after
    ``destroy_process_group()``)."""
    with contextlib.suppress(Exception):
        unregister_process_group(mesh.mesh_dim_names[0])
