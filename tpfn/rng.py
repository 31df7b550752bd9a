"""Random numbers in tensor-parallel regions (``sharded``: a stream of the rank's own)."""

from tpfn.interpret.rng import sharded

__all__ = ["sharded"]
