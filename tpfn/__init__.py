"""tpfn: tensor parallelism for PyTorch as a small functional language."""

from tpfn import algebra
from tpfn.layout import Partial, Replicate, Shard, from_torch, to_torch

__all__ = ["Shard", "Replicate", "Partial", "to_torch", "from_torch", "algebra"]
