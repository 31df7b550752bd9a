"""The analysis below the tools: dry runs with parameters on meta and inputs real, one
traced forward and how each ATen op carries sharded dims (its rules), a plan replayed on fake
ranks op by op, and ``check``, which proves a plan that way. ``tpfn.explain``, ``tpfn.verify``
and ``tpfn.suggest`` read it."""

from tpfn.analysis.check import prove
from tpfn.interpret.parallelize import PROOFS

PROOFS["check"] = prove
