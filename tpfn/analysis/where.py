"""Where in a model something happened: the module a failure is in.

>>> import torch
>>> linear = nn.Sequential(nn.Linear(2, 2))
>>> try:
...     linear(torch.ones(3))
... except RuntimeError as e:
...     failing_module(e, linear)
'0'
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["failing_module"]


def failing_module(exc: BaseException, module: nn.Module) -> str | None:
    """The FQN of the innermost module of ``module`` in ``exc``'s traceback (None: none)."""
    names, fqn = {id(m): fqn for fqn, m in module.named_modules()}, None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            fqn = names[id(owner)]
        tb = tb.tb_next
    return fqn
