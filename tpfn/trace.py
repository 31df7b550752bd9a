"""Name the collectives torch issues with the algebra's words.

``CommDebugMode`` keys its counts by torch op (``c10d_functional.all_reduce``,
``c10d.allreduce_``, ...). ``kind`` maps any of those ops to the name the algebra's steps
use (``step.collective``), and ``counts`` turns a ``CommDebugMode`` into a plain dict.

>>> import torch
>>> import torch.distributed._functional_collectives  # registers the functional ops
>>> kind(torch.ops._c10d_functional.reduce_scatter_tensor)
'reduce_scatter'
>>> kind(torch.ops.c10d.allreduce_.default)
'all_reduce'
>>> kind(torch.ops.aten.mm) is None
True
"""

from __future__ import annotations

from collections import Counter

__all__ = ["kind", "counts"]

_KINDS = {
    "all_gather": ("all_gather_into_tensor", "all_gather_into_tensor_coalesced", "allgather_",
                   "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"),
    "all_reduce": ("all_reduce", "all_reduce_coalesced", "allreduce_", "allreduce_coalesced_"),
    "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
                       "reduce_scatter_", "_reduce_scatter_base_",
                       "reduce_scatter_tensor_coalesced_"),
    "all_to_all": ("all_to_all_single", "alltoall_", "alltoall_base_"),
    "broadcast": ("broadcast", "broadcast_"),
    "scatter": ("scatter_",),
    "gather": ("gather_",),
    "reduce": ("reduce_",),
}
_BY_NAME = {name: k for k, names in _KINDS.items() for name in names}
_NAMESPACES = ("c10d_functional", "_c10d_functional", "c10d", "_c10d_functional_autograd")


def kind(op) -> str | None:
    """The collective's kind (``"all_gather"``, ``"all_reduce"``, ...) or None for other ops."""
    namespace, _, rest = str(op).partition(".")
    return _BY_NAME.get(rest.split(".")[0]) if namespace in _NAMESPACES else None


def counts(mode) -> dict:
    """Collective counts of a ``CommDebugMode`` by kind, e.g. ``{"all_reduce": 2}``."""
    total: Counter = Counter()
    for op, n in mode.get_comm_counts().items():
        total[kind(op) or str(op)] += n
    return dict(total)

