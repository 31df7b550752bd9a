"""Gradient utilities for models whose parameters live on different meshes.

With tensor parallelism and FSDP2 together, the parameters tpfn shards live on the 2-D
(data, tensor) mesh while parameters no plan binds live on the data mesh alone (or are
plain tensors); ``torch.nn.utils.clip_grad_norm_`` cannot combine norms across meshes.
``clip_grad_norm_`` here takes the norm of each mesh's gradients, combines them into the
single-device norm, and scales every gradient by the same factor.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


def _group_norm(grads: list, norm_type: float) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on any mix of meshes and plain tensors.

    Returns the total norm (a plain tensor, the same on every rank), the one a single
    device would compute for the whole model.

    >>> import torch, torch.nn as nn
    >>> layer = nn.Linear(3, 1)
    >>> layer(torch.ones(2, 3)).sum().backward()
    >>> expected = torch.cat([p.grad.flatten() for p in layer.parameters()]).norm()
    >>> torch.allclose(clip_grad_norm_(layer.parameters(), 1.0), expected)
    True
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    groups: dict = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = torch.stack([_group_norm(gs, norm_type).float().cpu() for gs in groups.values()])
    total = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum().pow(1 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total.item()}; "
                           "pass error_if_nonfinite=False to clip anyway.")
    scale = min(1.0, max_norm / (total.item() + 1e-6))
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return total
