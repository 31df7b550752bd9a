"""What a choice costs: bytes moved per step (the algebra's ring model) and bytes held per rank.

``cost(moved, held)`` weighs them: a byte each rank holds for good counts as much as a byte
it sends in one step of the example inputs. Every choice suggest makes beyond the Megatron
pairs (a vocabulary-parallel embedding or left whole, a head column-wise or whole,
sequence parallelism or not) is the option of least cost, and the plan's comments give the
two numbers. A cost model that knows the links may take its place.

>>> moved([(Partial(), Replicate(), (1, 64, 32), 4)], 2)      # one all-reduce of 8 KiB
8192
>>> cost(moved=8192, held=2048)
10240
"""

from __future__ import annotations

from tpfn.algebra import comm_bytes, transition
from tpfn.layout import Partial, Replicate  # noqa: F401  (the doctest's names)

__all__ = ["cost", "moved"]


def cost(moved: int, held: int) -> int:
    """The cost of a choice that sends ``moved`` bytes per step and holds ``held`` bytes on
    each rank."""
    return moved + held


def moved(steps, n: int) -> int:
    """Bytes each of ``n`` ranks sends for ``(src, dst, shape, itemsize)`` moves."""
    return int(sum(comm_bytes(transition(src, dst, ndim=len(shape)), shape, (n,), itemsize)
                   for src, dst, shape, itemsize in steps))
