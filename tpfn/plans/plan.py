"""Plans: immutable maps from module FQN patterns to styles, resolved purely against a module.

A pattern is a dotted module path; ``*`` matches one name component (any ``fnmatch``
pattern works within a component) and ``""`` is the module itself. A value may be a plan
(or a dict) to nest under the key's prefix. ``a | b`` merges plans; a pattern bound to two
different styles is an error. ``p.override(rules)`` replaces the rules of the same patterns
and adds the others; ``p.without(*patterns)`` removes rules.

>>> from tpfn import Replicate, colwise, prepare_out, rowwise
>>> p = plan({"layers.*": {"attention.wq": colwise(), "attention.wo": rowwise()}})
>>> p
plan({'layers.*.attention.wo': rowwise(), 'layers.*.attention.wq': colwise()})
>>> p | plan({"output": colwise() >> prepare_out(Replicate())}) == plan({
...     "layers.*.attention.wq": colwise(), "layers.*.attention.wo": rowwise(),
...     "output": colwise() >> prepare_out(Replicate())})
True

A plan prints on one line while it fits in ``WIDTH`` columns, else one rule per line:

>>> p.override({"layers.*.attention.wq": rowwise(), "output": colwise() >> prepare_out()})
plan({
    'layers.*.attention.wo': rowwise(),
    'layers.*.attention.wq': rowwise(),
    'output': colwise() >> prepare_out(),
})
>>> p.without("layers.*.attention.wo")
plan({'layers.*.attention.wq': colwise()})

``resolve(plan, module)`` returns what ``parallelize`` mounts, a ``Mount`` per bound module
in module order, or raises one ``PlanError`` that lists every pattern matching nothing (with
near misses), every module bound to two styles and every style its module cannot take.
"""

from __future__ import annotations

import difflib

import attrs
import torch.nn as nn

from tpfn._fqn import describe, generalize, join, matches, near
from tpfn.errors import PlanError
from tpfn.plans.mount import try_mount
from tpfn.style.style import Style

__all__ = ["Plan", "plan", "as_plan", "resolve"]

# The widest plan printed on one line (a plan of a few rules, as in from_torch's doctest).
WIDTH = 100


def _check_pattern(pattern) -> str:
    if not isinstance(pattern, str):
        raise TypeError(
            f"plan keys must be module FQN patterns (str), e.g. 'layers.*.attention.wq' "
            f"(got {pattern!r} that is a {type(pattern)!r})."
        )
    if pattern and any(part == "" for part in pattern.split(".")):
        raise ValueError(f"plan key {pattern!r} has an empty name component; write e.g. 'layers.*.w1'.")
    return pattern


def _flatten(mapping, prefix: str = "") -> list:
    if isinstance(mapping, Plan):
        mapping = dict(mapping.rules)
    if not isinstance(mapping, dict):
        raise TypeError(f"a plan is built from a dict of pattern -> style (got {mapping!r}).")
    out = []
    for pattern, value in mapping.items():
        key = join(prefix, _check_pattern(pattern))
        if isinstance(value, (dict, Plan)):
            out.extend(_flatten(value, key))
        elif isinstance(value, Style):
            out.append((key, value))
        elif type(value).__module__.startswith("torch.distributed.tensor.parallel"):
            raise TypeError(
                f"plan[{pattern!r}] is PyTorch's {type(value).__name__}(...), not a tpfn style; "
                "convert the whole plan with tpfn.from_torch(plan), which keeps its meaning.")
        else:
            raise TypeError(
                f"plan[{pattern!r}] must be a style (colwise(), rowwise(), prepare_in(...), ...) or "
                f"a nested plan (got {value!r} that is a {type(value)!r})."
            )
    return out


def _merge(rules, fix: str = "") -> tuple:
    """The rules sorted by pattern, each once; ``fix`` (formatted with the conflicting
    pattern and right-hand style) ends the problem of a pattern bound to two styles."""
    merged: dict = {}
    conflicts = []
    for pattern, style in rules:
        if pattern in merged and merged[pattern] != style:
            conflicts.append(f"{pattern!r} is bound to {merged[pattern]!r} and to {style!r}"
                             + fix.format(rule=f"{{{pattern!r}: {style!r}}}"))
        merged.setdefault(pattern, style)
    if conflicts:
        raise PlanError(conflicts)
    return tuple(sorted(merged.items()))


@attrs.frozen(repr=False)
class Plan:
    """FQN pattern -> style, sorted by pattern; equal by value, hashable."""

    rules: tuple = ()

    def __or__(self, other) -> "Plan":
        """Both plans' rules; a pattern bound to two different styles is an error (to
        replace a rule, ``override`` it)."""
        return Plan(_merge(self.rules + as_plan(other).rules, _OVERRIDE))

    def __ror__(self, other) -> "Plan":
        """``{pattern: style} | plan(...)``: the dict's rules, then the plan's."""
        return Plan(_merge(as_plan(other).rules + self.rules, _OVERRIDE))

    def override(self, rules) -> "Plan":
        """This plan with ``rules`` (a plan, a dict as ``plan`` takes, or a style for the
        module itself) replacing the rules of the same patterns, and adding the others.

        A pattern only replaces the rule of exactly that pattern: ``'layers.0.mlp'`` next to
        ``'layers.*.mlp'`` is a second rule, and a pattern that matches no module (a typo) is
        reported, with near misses, when the plan is resolved.

        >>> plan({"w1": colwise(), "w2": rowwise()}).override({"w2": colwise(), "w3": rowwise()})
        plan({'w1': colwise(), 'w2': colwise(), 'w3': rowwise()})
        """
        return Plan(tuple(sorted({**dict(self.rules), **dict(as_plan(rules).rules)}.items())))

    def without(self, *patterns: str) -> "Plan":
        """This plan less the rules of ``patterns`` (each exactly as the plan has it); a
        pattern the plan lacks is an error naming its near misses.

        >>> plan({"w1": colwise(), "w2": rowwise()}).without("w2")
        plan({'w1': colwise()})
        """
        rules = dict(self.rules)
        unknown = [p for p in map(_check_pattern, patterns) if p not in rules]
        if unknown:
            listed = ", ".join(map(repr, list(rules)[:8])) + (", ..." if len(rules) > 8 else "")
            said = "; ".join(
                f"no rule has the pattern {p!r}"
                + (near(p, rules) or (f" (its patterns: {listed})" if rules else " (it has none)"))
                for p in unknown)
            called = ", ".join(map(repr, patterns))
            raise ValueError(f"plan.without({called}): {said}; give each pattern exactly as the "
                             "plan has it (print(plan) lists them).")
        return Plan(tuple((p, s) for p, s in self.rules if p not in patterns))

    def under(self, prefix: str) -> "Plan":
        """This plan nested under ``prefix``: ``plan({"w1": s}).under("mlp") == plan({"mlp.w1": s})``."""
        return plan({_check_pattern(prefix): self})

    def __repr__(self):
        line = f"plan({dict(self.rules)!r})"
        if len(line) <= WIDTH:
            return line
        return "plan({\n" + "".join(f"    {p!r}: {s!r},\n" for p, s in self.rules) + "})"


_OVERRIDE = "; bind it once, or override it: plan.override({rule})"


def plan(mapping: dict | Plan | None = None) -> Plan:
    """The plan of ``mapping`` (pattern -> style or nested plan/dict).

    >>> plan({"mlp": {"w1": colwise(), "w2": rowwise()}})
    plan({'mlp.w1': colwise(), 'mlp.w2': rowwise()})
    """
    return Plan(_merge(_flatten(mapping or {})))


def as_plan(value) -> Plan:
    """A plan from a plan, a dict, or a single style (bound to the module itself)."""
    if isinstance(value, Plan):
        return value
    if isinstance(value, Style):
        return Plan((("", value),))
    return plan(value)


def _prefixed(rules, modules: dict, found: list) -> list:
    """The problems, with every pattern that matches nothing because the plan names the
    modules under a prefix this module lacks (a ``...ForCausalLM`` plan on its ``.model``)
    said once, as the prefix to drop."""
    unmatched = [p for p, _ in rules if "." in p and not any(matches(p, f) for f in modules)]
    heads = [p.split(".")[0] for p in unmatched]
    head = max(set(heads), key=heads.count, default=None)
    missing = [p for p in unmatched if p.split(".")[0] == head]
    rest = [p[len(head) + 1:] for p in missing]
    if len(missing) < 2 or not all(any(matches(r, f) for f in modules) for r in rest):
        return found
    kept = [f for f in found if not any(f.startswith(f"{p!r} -> ") for p in missing)]
    return kept + [f"{len(missing)} patterns start with {head + '.'!r}, which this module does "
                   f"not have, and match once it is dropped: the plan is for a model that holds "
                   f"this one as {head!r}; pass that model, or the plan's rules under "
                   f"{head + '.'!r} (e.g. {rest[0]!r})."]


def resolve(plan_like: Plan | dict | Style, module: nn.Module) -> tuple:
    """The ``Mount`` of every module a plan binds in ``module``, in module order (pure), or
    one ``PlanError`` listing every problem."""
    rules = as_plan(plan_like).rules
    modules = dict(module.named_modules())
    found, bound = [], {}
    for pattern, style in rules:
        hits = [fqn for fqn in modules if matches(pattern, fqn)]
        if not hits:
            names = [f for f in modules if f]
            shapes = sorted({generalize(f) for f in names})
            close = difflib.get_close_matches(pattern, shapes if "*" in pattern else names, n=3)
            listed = names if len(names) <= 8 else shapes
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else \
                f"; modules here: {', '.join(listed[:8])}{', ...' if len(listed) > 8 else ''}"
            found.append(f"{pattern!r} -> {style!r} matches no module{hint}")
        for fqn in hits:
            bound.setdefault(fqn, []).append((pattern, style))
    found = _prefixed(rules, modules, found)
    folded = []
    order = {fqn: i for i, fqn in enumerate(modules)}
    below: dict = {}  # fqn -> the relative names of the bound modules under it
    for fqn in bound:
        parts = fqn.split(".") if fqn else []
        for i in range(len(parts)):
            prefix = ".".join(parts[:i])
            if prefix in bound:
                below.setdefault(prefix, []).append(".".join(parts[i:]))
    for fqn, entries in sorted(bound.items(), key=lambda item: order[item[0]]):
        styles = sorted({s for _, s in entries}, key=repr)
        if len(styles) > 1:
            by = "; ".join(f"{p!r} -> {s!r}" for p, s in entries)
            found.append(f"{describe(modules[fqn], fqn)} is bound to {len(styles)} styles ({by}); "
                         "bind it once, e.g. by combining them with >> or narrowing a pattern.")
            continue
        mount = try_mount(styles[0], modules[fqn], fqn, below.get(fqn, ()))
        if isinstance(mount, list):
            found.extend(mount)
        else:
            folded.append(mount)
    if found:
        raise PlanError(found)
    return tuple(folded)

