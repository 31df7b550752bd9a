"""Parameter groups that ``foreach`` and ``fused`` optimizers take.

A parallelized model holds DTensor parameters (the ones its plan places) beside plain ones
(norms and the rest). PyTorch's multi-tensor optimizers batch every parameter of a group
into one op, and DTensor refuses a batch that mixes the two kinds ("got mixed torch.Tensor
and DTensor"), so ``Adam(model.parameters(), fused=True)`` fails. The default single-tensor
loop works but pays DTensor's dispatch on every op of every parameter: on the benchmarks'
reference Transformer (2 ranks, CPU) it takes twice the time of the same loop over plain
tensors. ``param_groups`` splits the parameters so that each group holds one kind (and one
mesh); fused Adam over them runs within about 1.5x of fused Adam over plain local shards
(``python -m benchmarks.profile_step``).

>>> import torch, torch.nn as nn, tpfn
>>> from torch.distributed.device_mesh import init_device_mesh
>>> mesh = init_device_mesh("cpu", (1,))
>>> mlp = tpfn.parallelize(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4)), mesh,
...                        {"0": tpfn.colwise(), "2": tpfn.rowwise()})
>>> [len(group["params"]) for group in tpfn.param_groups(mlp)]
[4, 2]
>>> opt = torch.optim.Adam(tpfn.param_groups(mlp), lr=1e-3, fused=True)
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["param_groups"]


def param_groups(module: nn.Module, **options: object) -> list[dict]:
    """``module``'s parameters as optimizer groups, one per kind: the DTensor parameters of
    each mesh (in order of first appearance), then the plain ones. ``options`` (``lr=...``,
    ``weight_decay=...``) go into every group; empty groups are left out."""
    groups: dict = {}
    for param in module.parameters():
        key = ("dtensor", id(param.device_mesh)) if isinstance(param, DTensor) else ("plain",)
        groups.setdefault(key, []).append(param)
    plain = groups.pop(("plain",), [])
    return [{"params": params, **options} for params in (*groups.values(), plain) if params]
