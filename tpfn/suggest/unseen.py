"""Why the modules suggest does not shard stay whole: a note on each that holds a share of the
parameter bytes worth naming.

Suggest shards linears, embeddings, convolutions (and the norms on their channels),
``nn.MultiheadAttention`` and transformers' fused experts.
Any other module whose own parameters hold at least ``SHARE`` of the model's parameter bytes,
and that no rule binds, gets a note that says why it is whole: a recurrent layer needs the
whole hidden state of the step before at every step; a grouped convolution shards its channels
only between the two halves of a pair; other parameters are read by ops directly (a
position table added to the input), which no rule shards. Norms (a few bytes each) go unnamed.

>>> import torch.nn as nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 64))
>>> [c.note[:60] for c in unseen(model, {"0"}, set())]
['left whole (100% of the parameter bytes): a recurrent layer ']
"""

from __future__ import annotations

import torch.nn as nn

from tpfn._fqn import generalize
from tpfn.suggest.choose import Choice

__all__ = ["unseen", "SHARE"]

SHARE = 0.01  # the least share of the parameter bytes a module left whole is named for
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
          nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm, nn.RMSNorm)
_RECURRENT = (nn.RNNBase, nn.RNNCellBase)
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _norm(module: nn.Module) -> bool:
    """A norm: torch's, or one of a model's own (``LlamaRMSNorm``)."""
    return isinstance(module, _NORMS) or type(module).__name__.endswith("Norm")


def _why(module: nn.Module) -> str:
    if isinstance(module, _RECURRENT):
        return (f"a recurrent layer ({type(module).__name__}): each step needs the whole hidden state of "
                "the step before, which no shard of its weights computes")
    if isinstance(module, _CONVOLUTIONS) and module.groups > 1:
        return (f"a grouped convolution ({type(module).__name__}, groups={module.groups}) computes on its "
                "channels as they come: it shards them only between a column-wise convolution that makes "
                "them and one that contracts them, and here it is handed them whole")
    if isinstance(module, _CONVOLUTIONS):
        return (f"a convolution ({type(module).__name__}) whose channels form no pair with another "
                "convolution (or a linear) that contracts them")
    names = ", ".join(n for n, _ in module.named_parameters(recurse=False))
    return (f"its parameters ({names}) are read by ops directly, not through a linear, an embedding or "
            "nn.MultiheadAttention, and no rule shards them")


def unseen(model: nn.Module, bound: set, noted: set) -> list:
    """A ``Choice`` (whole, with its reason) for each module of ``model`` with parameters of
    its own worth ``SHARE`` of the bytes that no rule in ``bound`` (module names) binds and no
    note in ``noted`` names, its parameters not all tied to other modules' (T5's ``shared``,
    whose embeddings say their own); one per pattern of repeated blocks."""
    sizes = {fqn: sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
             for fqn, m in model.named_modules()}
    holders: dict = {}  # a parameter -> the modules holding it (a tied weight: several)
    for _, m in model.named_modules():
        for p in m.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    out, seen = [], set(map(generalize, noted))
    for fqn, module in model.named_modules():
        pattern = generalize(fqn)
        tied = all(holders[id(p)] > 1 for p in module.parameters(recurse=False))  # (its fate is theirs)
        if not total or sizes[fqn] < SHARE * total or fqn in bound or pattern in seen or _norm(module) or tied:
            continue
        seen.add(pattern)
        out.append(Choice(fqn, None, f"left whole ({round(100 * sizes[fqn] / total)}% of the parameter "
                                     f"bytes): {_why(module)}"))
    return out
