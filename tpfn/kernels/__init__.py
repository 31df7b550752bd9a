"""Fast kernels: what a module kind's row may compute in place of the reference route, each in a
file of its own that states its protocol at the top. ``KERNELS`` maps a row's ``Kernel.fast``
name to the kernel; a kernel returns None for a call it cannot compute as the reference route
does, and the interpreter takes that route."""

from tpfn.kernels import linear
from tpfn.kernels.linear import Group

__all__ = ["KERNELS", "Group"]

KERNELS = {"linear": linear.kernel}
