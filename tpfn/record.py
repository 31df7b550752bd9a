"""``record(module)``: measure the collectives a run issues, per module and phase."""

from tpfn.dryrun.collectives import record

__all__ = ["record"]
