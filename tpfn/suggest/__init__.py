"""``tpfn.suggest``: a tensor-parallel plan for any module, derived from its structure."""

from tpfn.suggest.suggest import suggest

__all__ = ["suggest"]
