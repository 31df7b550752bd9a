"""Name the collectives torch issues with the algebra's words (``kind``, ``counts``)."""

from tpfn.dryrun.collectives import counts, kind

__all__ = ["kind", "counts"]
