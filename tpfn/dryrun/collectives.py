"""Measure the collectives a run issues, each attributed to the module that issued it.

``kind`` names a torch collective op with the algebra's words (``CommDebugMode`` keys its
counts by op: ``c10d_functional.all_reduce``, ``c10d.allreduce_``, ...), ``counts`` turns a
``CommDebugMode`` into a plain dict, and ``record`` measures a run.

>>> kind(torch.ops.c10d.reduce_scatter_.default), kind(torch.ops.c10d.allreduce_.default)
('reduce_scatter', 'all_reduce')
>>> kind(torch.ops.aten.mm) is None
True

``record(module)`` is a context manager that yields a list, to which every collective dispatched
inside is appended as a ``tpfn.report.Comm``. The same measurement serves a dry run on a fake
process group (``tpfn.explain``) and a real run, so the two can be compared entry by entry.

A forward collective belongs to the module whose forward (or forward hooks) is running.
A backward collective belongs to the module that created the autograd node running it:
each module's forward spans an interval of autograd sequence numbers, and the innermost
interval holding the node's number names the module; one that a column-wise linear starts
before the weight gradients it computes (``Comm.overlaps``) belongs to the move it serves. One
that runs in a callback at the end of the backward (e.g. gradients reduced in bulk) belongs to no
module. A forward all-gather's ``Comm.overlaps`` counts the matrix products of its own input
(the rows of this rank's slice, computed while it runs).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter

import torch
import torch.nn as nn

from tpfn._torch import (ProcessGroup, TorchDispatchMode, argument_names, current_node, graph_task_id, next_sequence_nr,
                         resolve_process_group, sequence_nr)
from tpfn.dryrun.report import KINDS, Comm

__all__ = ["record", "kind", "counts"]

_KINDS = {
    "all_gather": ("all_gather_into_tensor", "all_gather_into_tensor_coalesced", "allgather_",
                   "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"),
    "all_reduce": ("all_reduce", "all_reduce_coalesced", "allreduce_", "allreduce_coalesced_"),
    "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "reduce_scatter_",
                       "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"),
    "all_to_all": ("all_to_all_single", "alltoall_", "alltoall_base_"),
    "broadcast": ("broadcast", "broadcast_"), "scatter": ("scatter_",), "gather": ("gather_",),
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


_PROBE = torch.zeros((), requires_grad=True)


def _sequence_nr():
    """The autograd sequence number the next node will get (None where no node is made)."""
    node = _PROBE.view(()).grad_fn
    return None if node is None else sequence_nr(node)


def _group_size(named: dict) -> int:
    if "group_size" in named:
        return named["group_size"]
    if "process_group" in named:  # a c10d op: the group as a script object
        return ProcessGroup.unbox(named["process_group"]).size()
    group = named["group_name"]
    return (resolve_process_group(group) if isinstance(group, str) else group).size()


def _numel(x) -> int:
    """Elements of a tensor or of (nested lists of) tensors."""
    return x.numel() if isinstance(x, torch.Tensor) else sum(map(_numel, x))


def _itemsize(x) -> int:
    return x.dtype.itemsize if isinstance(x, torch.Tensor) else _itemsize(x[0])


# The input of a functional collective (``_c10d_functional``) or of a c10d one (``dist.*``).
_INPUTS = ("input", "inputs", "input_tensor", "input_tensors", "tensors")


class _Recorder(TorchDispatchMode):
    def __init__(self, nodes: list | None):
        super().__init__()
        self.comms: list = []
        self.nodes = nodes  # where given: the autograd position of each collective
        self.open: list = []  # (fqn, first sequence number) of the modules running forward
        self.spans: list = []  # (first, end, fqn) of finished forwards

    def enter(self, fqn):
        self.open.append((fqn, _sequence_nr()))

    def leave(self):
        fqn, first = self.open.pop()
        if first is not None:
            self.spans.append((first, _sequence_nr(), fqn))

    def _creator(self, seq):  # seq None: a callback at the end of the backward
        inside = [s for s in self.spans if seq is not None and s[0] <= seq < s[1]]
        return max(inside)[2] if inside else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op_kind = kind(func)
        if op_kind is not None:
            seq, early = None, 0
            if graph_task_id() == -1:
                fqn, phase = (self.open[-1][0] if self.open else None), "forward"
            else:  # the node running it, or the move whose collective a linear starts early
                node = current_node()
                if node is not None:  # (a linear kernel's node: 1 where its weight gradients overlap)
                    seq, early = sequence_nr(node), node.metadata.get("overlaps", 0)
                fqn, phase = self._creator(seq), "backward"
            if op_kind not in KINDS:
                where = "code outside every module" if fqn is None else repr(fqn or "<root>")
                raise ValueError(
                    f"{where} issued {func} ({op_kind}) in the {phase}: tpfn measures the collectives "
                    f"tensor parallelism uses, {', '.join(KINDS)}; record a region without it.")
            named = dict(zip(argument_names(func), args)) | kwargs
            sent = next(named[k] for k in _INPUTS if k in named)
            n = _group_size(named)
            whole = _numel(sent) * (n if op_kind in ("all_gather", "all_to_all") else 1)
            self.comms.append(Comm(fqn, phase, op_kind, whole, n, _itemsize(sent), early))
            if self.nodes is not None:
                self.nodes.append(next_sequence_nr() if phase == "forward" else seq)
        return func(*args, **kwargs)


def _enter(recorder: _Recorder, fqn: str, *_) -> None:
    recorder.enter(fqn)


def _leave(recorder: _Recorder, *_) -> None:
    recorder.leave()


@contextlib.contextmanager
def record(module: nn.Module, *, nodes: list | None = None):
    """Collect the collectives run inside the block, attributed to submodules of ``module``.

    Yields the list that fills with ``Comm`` values as the block runs (hooks and the
    dispatch mode are removed on exit). ``nodes``, where given, fills alongside with each
    collective's autograd position: in the backward the sequence number of the node running
    it (None for a callback at its end), in the forward the number the next node will get,
    so that sequence numbers noted around a part of a forward tell which part issued it.

    >>> from tpfn.dryrun import fake_mesh
    >>> from tpfn.record import record
    >>> with torch.device("meta"):
    ...     mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    ...     x = torch.ones(2, 4, requires_grad=True)
    >>> mlp = tpfn.parallelize(mlp, fake_mesh(2), {"0": colwise(), "1": rowwise()}, src_rank=None)
    >>> with record(mlp) as comms:
    ...     mlp(x).sum().backward()
    >>> [(c.fqn, c.phase, c.kind, c.numel, c.bytes) for c in comms]
    [('1', 'forward', 'all_reduce', 8, 32), ('0', 'backward', 'all_reduce', 8, 32)]
    """
    recorder = _Recorder(nodes)
    handles = []
    for fqn, sub in module.named_modules():
        enter = functools.partial(_enter, recorder, fqn)
        enter.observes_only = True  # it changes no module (see tpfn._torch.hooked)
        leave = functools.partial(_leave, recorder)
        leave.observes_only = True
        handles += [sub.register_forward_pre_hook(enter, prepend=True),
                    sub.register_forward_hook(leave, always_call=True)]
    try:
        with recorder:
            yield recorder.comms
    finally:
        for handle in handles:
            handle.remove()
