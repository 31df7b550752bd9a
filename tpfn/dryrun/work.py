"""Count the local work of a run: floating-point operations, bytes touched, ops dispatched.

``count()`` is a context manager yielding a ``Counts`` that fills, phase by phase, with what
every op dispatched inside does on this rank: the FLOPs of matrix products and attention
(``torch.utils.flop_counter``'s formulas), the bytes that every other op reads and writes
(its tensor arguments and results; views touch none), and the number of ops. It works on
meta tensors, so ``tpfn.explain`` counts a dry run's work as it records its collectives, and
``tpfn.dryrun.cost`` turns the counts into time.

>>> import torch
>>> with count() as counts:
...     a, b = torch.ones(4, 8, device="meta"), torch.ones(8, 2, device="meta")
...     c = (a @ b).relu()
>>> counts.of("forward")
Work(flops=128, bytes=256, ops=4)
"""

from __future__ import annotations

import contextlib

import attrs
import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from tpfn._torch import CPU_ATTENTION, TorchDispatchMode, op_packet

__all__ = ["Work", "Counts", "count"]


@attrs.frozen
class Work:
    """One phase's local work on one rank: ``flops`` of matrix products and attention,
    ``bytes`` read and written by every other op, ``ops`` dispatched (views included).

    >>> Work(10, 4, 1) + Work(2, 0, 1)
    Work(flops=12, bytes=4, ops=2)
    """

    flops: int = 0
    bytes: int = 0
    ops: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes + other.bytes, self.ops + other.ops)


def _tensors(value, out: list) -> list:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out)
    return out


def _attention(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _attention_backward(grad, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad.shape, query.shape, key.shape, value.shape)


# the CPU's own attention kernels, which the flop counter's table leaves out
_FORMULAS = dict(zip(CPU_ATTENTION, (_attention, _attention_backward)))


class Counts(TorchDispatchMode):
    """The work of each phase so far (``of(phase)``); ``phase`` names the one running
    (``"forward"`` until set otherwise). Collectives are left out (``tpfn.record`` measures them)."""

    def __init__(self):
        super().__init__()
        self.phase, self._work = "forward", {}

    def of(self, phase: str) -> Work:
        """The work counted in ``phase`` (nothing: ``Work()``)."""
        return self._work.get(phase, Work())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace = func.namespace
        if namespace.startswith(("c10d", "_c10d")):
            return out
        packet, flops, nbytes = op_packet(func), 0, 0
        if packet in _FORMULAS:
            flops = _FORMULAS[packet](*args, **kwargs)
        elif packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        elif not func.is_view:
            nbytes = sum(t.numel() * t.element_size() for t in _tensors((args, kwargs, out), []))
        self._work[self.phase] = self.of(self.phase) + Work(int(flops), int(nbytes), 1)
        return out


@contextlib.contextmanager
def count():
    """Count the work dispatched inside the block (see the module docstring)."""
    counts = Counts()
    with counts:
        yield counts
