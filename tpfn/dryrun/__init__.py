"""Dry runs: ``explain`` a plan on fake ranks in one process, measure its collectives, report them."""

from tpfn.dryrun.explain import explain
from tpfn.analysis.fake import fake_mesh

__all__ = ["explain", "fake_mesh"]
