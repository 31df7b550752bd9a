"""Global sizes held in attributes: the ``per_rank`` an attention needs, found by trial.

Attention code often reads its head count or width from an attribute (``self.num_heads``,
GPT-2's ``self.split_size``, ``self.config.num_attention_heads``) and views its features by
it; on a rank's shard that attribute must hold the rank's share. Where the ranks' check
(``tpfn.analysis.replay``) finds a module computing other shapes than its share, the
candidates are that module's int attributes (and its config's) whose value is a size of its
group: a space's head count or width (held ``1/n`` per rank), the KV heads held by groups of
ranks (``heads=h``), the query heads per KV head (``per_head=h``); and the inputs the trace
found laid out per head (``inputs=``). The check runs again with all of them held per rank;
where it passes, each is left out in turn and kept only if the check then fails.

>>> class Attention(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.num_heads, self.head_dim, self.layer = 4, 8, 4
>>> sorted(candidates(Attention(), {"divide": {4, 32}}))  # a layer number is no size
[('num_heads', 'divide')]
>>> style({("num_heads", "divide"), ("num_key_value_groups", ("per_head", 2))})
per_rank('num_heads') >> per_rank('num_key_value_groups', per_head=2)
"""

from __future__ import annotations

import torch.nn as nn

from tpfn.dryrun.lints import GROUPS, KV_HEADS
from tpfn.style.constructors import per_rank
from tpfn.style.style import Style

__all__ = ["candidates", "sizes", "style"]


def sizes(group) -> dict:
    """``{"divide": {...}, ("heads", h): {...}, ("per_head", h): {...}}``: the values a module
    of ``group`` may hold and how each is held per rank."""
    found: dict = {"divide": set()}
    kv = {e.heads for e in group.entries.values() if e.heads is not None}
    queries = max((u for p, units in group.heads.items() if group.entries[p].heads is None
                   for u in units), default=None)
    for producer, entry in group.entries.items():
        units = set(group.heads.get(producer, ()))
        if entry.heads is not None:
            found.setdefault(("heads", entry.heads), set()).update(units | {entry.width})
        else:
            found["divide"].update(units | {entry.width, *entry.parts})
    for h in kv:
        if queries and queries % h == 0:
            found.setdefault(("per_head", h), set()).add(queries // h)
    return found


# Attributes that hold sizes of other things than features and heads.
_OTHERS = ("layer", "vocab", "position", "token", "seq", "length", "bucket", "distance", "window",
           "expert", "batch", "chunk", "state", "label", "class")


def _ints(holder, prefix: str) -> dict:
    return {f"{prefix}{name}": value for name, value in vars(holder).items()
            if isinstance(value, int) and not isinstance(value, bool) and value > 1
            and not name.startswith("_") and not any(word in name for word in _OTHERS)}


def candidates(module: nn.Module, values: dict) -> set:
    """``{(attribute path, how), ...}``: the int attributes of ``module`` and of its config whose
    values are among ``values`` (``sizes``), each with how it is held per rank (where a value
    is of two kinds, the attribute's name decides: a KV head count, a ratio per KV head)."""
    held = _ints(module, "")
    config = getattr(module, "config", None)
    if config is not None and not isinstance(config, nn.Module) and hasattr(config, "__dict__"):
        held.update(_ints(config, "config."))
    found = set()
    for path, value in held.items():
        kinds = [how for how, vs in values.items() if value in vs]
        if not kinds:
            continue
        leaf = path.rpartition(".")[2]
        by_name = [k for k in kinds if k != "divide" and (
            k[0] == "per_head" and leaf in GROUPS or k[0] == "heads" and leaf in KV_HEADS)]
        found.add((path, (by_name or [k for k in kinds if k != "divide"] or kinds)[0]))
    return found


def style(found: set, inputs: dict | None = None) -> Style:
    """The ``per_rank`` stages of ``found`` (``(path, how)``) and of ``inputs`` (name -> heads):
    the one place suggest spells them."""
    plain = sorted(p for p, how in found if how == "divide")
    stages = [per_rank(*plain, inputs=inputs or None)] if plain or inputs else []
    for how in sorted({h for _, h in found if h != "divide"}):
        names = sorted(p for p, h in found if h == how)
        stages.append(per_rank(*names, heads=how[1]) if how[0] == "heads" else per_rank(*names, per_head=how[1]))
    out = Style()
    for stage in stages:
        out = out >> stage
    return out
