"""Checkpoints through ``torch.distributed.checkpoint``, loadable at any tensor-parallel degree."""

from tpfn.training.checkpoint import full_state_dict, load, save

__all__ = ["save", "load", "full_state_dict"]
