"""What a choice costs: the collectives it adds per step and the bytes it holds per rank.

A choice is a list of moves ``(src, dst, shape, itemsize)`` it makes per step and the
bytes of parameters it holds on each of ``n`` ranks. ``cost`` weighs them:

- without a machine, in bytes: a byte each rank holds for good counts as much as a byte it
  sends in one step of the example inputs (the algebra's ring model, ``comm_bytes``);
- with a ``tpfn.dryrun.cost.Machine`` (``calibrate``, or given), in seconds per step, as
  ``explain``'s predicted step time counts them: each collective ``Machine.collective``
  (latency per ring step, bytes at its link's bandwidth), and the bytes held the optimizer
  step's time on them (``Machine.optimizer``).

Every choice suggest makes beyond the Megatron pairs (an embedding vocabulary-parallel or
whole, a head column-wise or whole, sequence parallelism or not) is the option of least
cost, and the plan's comments give the figures (``say``) and the model that decided.

>>> reduce = [(Partial(), Replicate(), (1, 64, 32), 4)]      # one all-reduce of 8 KiB
>>> cost(reduce, held=2048, n=2)
10240
>>> from tpfn.dryrun.cost import Link, Machine
>>> slow = Machine(flops=1e11, bandwidth=7e9, op=5e-6, links=(("all_reduce", Link(1e-3, 1e9)),))
>>> say(reduce, held=2048, n=2, machine=slow)    # 2 ring steps and 8 KiB; Adam on 2 KiB
'takes 2.01 ms per step (collectives 2.01 ms, optimizer 2.05 µs)'
"""

from __future__ import annotations

from tpfn.algebra import comm_bytes, transition
from tpfn.dryrun.units import fmt_bytes, fmt_seconds
from tpfn.layout import Partial, Replicate  # noqa: F401  (the doctest's names)

__all__ = ["cost", "moved", "say", "seconds"]


def moved(steps, n: int) -> int:
    """Bytes each of ``n`` ranks sends for ``(src, dst, shape, itemsize)`` moves."""
    return int(sum(comm_bytes(transition(src, dst, ndim=len(shape)), shape, (n,), itemsize)
                   for src, dst, shape, itemsize in steps))


def seconds(steps, n: int, machine) -> float:
    """Seconds the collectives of ``(src, dst, shape, itemsize)`` moves take on ``machine``."""
    return sum(machine.collective(step.collective, n, float(comm_bytes((step,), shape, (n,), itemsize)))
               for src, dst, shape, itemsize in steps
               for step in transition(src, dst, ndim=len(shape)) if step.collective is not None)


def cost(steps, held: int, n: int, machine=None) -> float:
    """The cost of a choice that makes ``steps`` moves per step and holds ``held`` bytes on
    each of ``n`` ranks: bytes, or seconds on ``machine`` (see the module docstring)."""
    if machine is None:
        return moved(steps, n) + held
    return seconds(steps, n, machine) + machine.optimizer(held)


def say(steps, held: int, n: int, machine=None) -> str:
    """The figures ``cost`` weighs, in words: bytes moved and held, or seconds on ``machine``."""
    if machine is None:
        return f"moves {fmt_bytes(moved(steps, n))} per step, holds {fmt_bytes(held)} per rank"
    return (f"takes {fmt_seconds(cost(steps, held, n, machine))} per step (collectives "
            f"{fmt_seconds(seconds(steps, n, machine))}, optimizer {fmt_seconds(machine.optimizer(held))})")
