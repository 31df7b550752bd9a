"""Fast kernels: what a module kind's row may compute in place of the reference route, each in a
file of its own that states its protocol at the top, registered by the name rows give it
(``tpfn.interpret.parallelize.FAST``). A kernel computes a call as the reference route does, or
returns None and that route computes it. Invariant mode's kernels (``INVARIANT``) compute a call
in the canonical order (``tpfn.tree``) or raise."""

from tpfn.interpret.parallelize import FAST, INVARIANT
from tpfn.kernels import canonical, linear

__all__ = ["linear", "canonical"]

FAST["linear"] = linear.call
INVARIANT["linear"] = canonical.call
