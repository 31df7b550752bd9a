"""``check``: a plan proven on fake ranks to compute one device's numbers, op by op.

Two runs, both with the parameters on meta and the inputs and buffers real
(``tpfn.analysis.hybrid``): one device's forward, each value typed by the layout the plan
gives it on the ranks and each op checked by its rule (``tpfn.analysis.typed``), its
backward typed by each op's dual; then the plan on ``world_size`` fake ranks, forward and
backward, each op of the model's own code against one device's (``tpfn.analysis.ranks``).
What computes other numbers, or what no rule proves, is a ``Finding`` with the module, the op
and the line of the model's source; ``Check.ok`` only where there is none.
"""

from __future__ import annotations

import json
import textwrap

import attrs
import torch.distributed as dist
import torch.nn as nn

from tpfn.analysis.findings import Finding, once
from tpfn.analysis.hybrid import hybrid_copy
from tpfn.analysis.inputs import example
from tpfn.analysis.ranks import on_ranks
from tpfn.analysis.typed import typed
from tpfn.analysis.values import layout_of, sharded
from tpfn.errors import PlanError
from tpfn.plans.plan import Plan, resolve
from tpfn.style.style import Style

__all__ = ["check", "Check", "analysed", "prove"]


@attrs.frozen
class Check:
    """What ``check`` proved: ``ok`` where every op of the step is proven to compute one
    device's numbers on the ranks; else ``findings``, each a ``Finding`` (its ``kind``:
    ``"wrong"``, the numbers differ, or ``"unproven"``, no rule says). ``ops``: the ops of the
    model's own code checked; ``inputs``: ``(name, shape, dtype)`` of the example inputs;
    ``layouts``: ``((fqn, (layout per output, ...)), ...)`` as the ranks hold each module's
    outputs, its first call (None where no one layout says it); ``notes``: what holds but is
    worth knowing (an output each rank holds a shard of)."""

    world_size: int
    inputs: tuple
    findings: tuple = ()
    ops: int = 0
    layouts: tuple = ()
    notes: tuple = ()

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def wrong(self) -> tuple:
        return tuple(f for f in self.findings if f.kind == "wrong")

    @property
    def unproven(self) -> tuple:
        return tuple(f for f in self.findings if f.kind == "unproven")

    def text(self, width: int | None = 80) -> str:
        """The report for a terminal ``width`` columns wide (None: no limit): what ran, the
        outcome, then each finding (repeated blocks once, with their count) and the notes.
        ``str(check)`` is ``check.text()``."""
        if width is not None and (not isinstance(width, int) or width < 40):
            raise ValueError(f"'width' must be None or an int of at least 40 columns (got {width!r}).")
        shown = ", ".join(f"{name} {tuple(shape)} {dtype}" for name, shape, dtype in self.inputs)
        lines = _wrap(f"tpfn.check on {self.world_size} ranks: one forward and backward of "
                      f"{shown or 'no inputs'}; {self.ops} op{'s' * (self.ops != 1)} of the model's code", width)
        wrong, unproven = once(self.wrong), once(self.unproven)
        if self.ok:
            lines += _wrap("ok: every op computes one device's numbers on the ranks", width)
        if wrong:
            lines += _wrap(f"WRONG: {len(wrong)} finding{'s' * (len(wrong) != 1)} (the numbers would differ "
                           "from one device's)", width)
            lines += [line for f, k in wrong for line in _wrap(_item(f, k), width, "  - ", "    ")]
        if unproven:
            lines += _wrap(f"UNPROVEN: {len(unproven)} op{'s' * (len(unproven) != 1)} no rule proves", width)
            lines += [line for f, k in unproven for line in _wrap(_item(f, k), width, "  - ", "    ")]
        lines += [line for note in self.notes for line in _wrap(f"note: {note}", width)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def to_dict(self) -> dict:
        """JSON-ready: the outcome, every finding, the notes."""
        return {"world_size": self.world_size, "ok": self.ok, "ops": self.ops,
                "inputs": [{"name": n, "shape": list(s), "dtype": d} for n, s, d in self.inputs],
                "findings": [f.to_dict() for f in self.findings], "notes": list(self.notes)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _item(f: Finding, count: int) -> str:
    return f"{f}" + (f" (x{count})" if count > 1 else "")


def _wrap(text: str, width, first: str = "", rest: str = "  ") -> list:
    if width is None:
        return [first + text]
    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False) or [first]


def _world_size(world_size) -> int:
    if world_size is None:
        return dist.get_world_size() if dist.is_initialized() else 2
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise TypeError(f"'world_size' must be an int of at least 2 (got {world_size!r} that is a "
                        f"{type(world_size)!r}).")
    return world_size


def analysed(model: nn.Module, plan, n: int, args: tuple, kwargs: dict) -> tuple:
    """``(trace, findings)`` of ``plan`` on ``n`` fake ranks with the dry runs' inputs ``args`` and
    ``kwargs`` (``tpfn.analysis.inputs.example``): one device's typed forward, then the ranks'."""
    one = hybrid_copy(model, who="check")  # (each run its own copy: a forward may set attributes)
    trace = typed(one, {m.fqn: m for m in resolve(plan, one)}, args, kwargs, n)
    return trace, [*trace.findings, *on_ranks(model, plan, n, args, kwargs, trace)]


def check(model: nn.Module, plan: Plan | dict | Style, world_size: int | None = None,
          example_inputs: object = None) -> Check:
    """Prove on ``world_size`` fake ranks that ``plan`` makes ``model`` compute one device's
    numbers, op by op, forward and backward; what it cannot prove, it names.

    - ``model``: any module, never changed (its parameters may be on meta).
    - ``plan``: what ``parallelize`` takes; a plan it cannot apply raises its ``PlanError``.
    - ``world_size``: the ranks (default: the default group's size, else 2).
    - ``example_inputs``: as ``tpfn.explain`` takes them (tensors, shapes of token ids, a tuple
      or a dict); a transformers model defaults to one sequence of token ids.

    >>> import torch.nn.functional as F
    >>> class Attention(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.n_head, self.qkv, self.o = 4, nn.Linear(16, 48), nn.Linear(16, 16)
    ...     def forward(self, x):
    ...         q, k, v = (t.view(2, 5, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
    ...         return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
    >>> plan = {"qkv": colwise(parts=3), "o": rowwise()}
    >>> found = tpfn.check(Attention(), plan, 2, torch.randn(2, 5, 16))
    >>> found.ok, found.findings[0].fqn, found.findings[0].op
    (False, '', 'aten.view.default')
    >>> tpfn.check(Attention(), {"": per_rank("n_head"), **plan}, 2, torch.randn(2, 5, 16)).ok
    True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"'model' must be an nn.Module (got {model!r} that is a {type(model)!r}).")
    n = _world_size(world_size)
    args, kwargs = example(model, example_inputs, who="check")
    trace, findings = analysed(model, plan, n, args, kwargs)
    shown = tuple((f"input {k}" if isinstance(k, int) else repr(k), tuple(x.shape),
                   str(x.dtype).removeprefix("torch."))
                  for k, x in [*enumerate(args), *kwargs.items()] if hasattr(x, "shape"))
    notes = tuple(f"output {i} of the model is each rank's shard ({layout_of(v)!r}), as the plan lays it out: "
                  "a loss taken on it as it is sees a part of it"
                  for i, (_, v) in enumerate(trace.outputs) if sharded(v))
    layouts = tuple((fqn, tuple(calls[0])) for fqn, calls in trace.layouts.items())
    return Check(n, shown, tuple(findings), len(trace.ops), layouts, notes)


def prove(model: nn.Module, plan, world_size: int, example_inputs: object = None) -> Check:
    """``check``, its findings raised as one ``PlanError`` (each finding a problem, repeated
    blocks once): what ``parallelize(..., check=True)`` runs before it changes anything.

    >>> mlp = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4), nn.ReLU())
    >>> prove(mlp, {"0": colwise(), "2": rowwise()}, 2, torch.ones(2, 4)).ok
    True
    >>> prove(mlp, {"0": colwise(), "2": rowwise() >> prepare_out(Partial())}, 2, torch.ones(2, 4))
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tpfn.errors.PlanError: the plan cannot be applied (1 problem):
      - '3' aten.relu.default (torch/nn/modules/activation.py:...): relu of a partial sum (output 0 of '2'): ...
    """
    found = check(model, plan, world_size, example_inputs)
    if not found.ok:
        raise PlanError([_item(f, k) for f, k in once(found.findings)])
    return found
