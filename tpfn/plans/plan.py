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

A plan also carries what the built-ins mean on module kinds of the user's own, without
subclassing and without a registry: ``p.kind(MyLinear, colwise=row)`` (or ``plan(...,
kinds={MyLinear: {"colwise": row}})``), where ``row(core, module, where, owned)`` returns a
style of primitives (``tpfn.plans.kinds``). Its rows come before the class's own
``tpfn_rows`` and the built-in table, for this plan only.

>>> def gated(core, module, where, owned):
...     return params(w=Shard(0, parts=2)) >> on_shards(Replicate(), grads=Partial(),
...                                                     output=Shard(-1, parts=2))
>>> plan({"mlp.up": colwise()}).kind(nn.Linear, colwise=gated)
plan({'mlp.up': colwise()}, kinds={Linear: {'colwise': gated}})

A plan may carry notes, printed as comments: one above the rule of its pattern, one for a
pattern without a rule (a module left as it is) after the rules, and one for the whole plan
(``None``) first. Notes say why; they are no part of the value (``eval`` of the printed plan
equals it) and follow its rules through ``|``, ``override``, ``without`` and ``under``.

>>> plan({"mlp.up": colwise(), "mlp.down": rowwise()}).noted({
...     None: "a Megatron pair", "mlp.up": "64 features", "norm": "left replicated"})
plan({
    # a Megatron pair
    'mlp.down': rowwise(),
    # 64 features
    'mlp.up': colwise(),
    # 'norm': left replicated
})

``resolve(plan, module)`` returns what ``parallelize`` mounts, a ``Mount`` per bound module
in module order, or raises one ``PlanError`` that lists every pattern matching nothing (with
near misses), every module bound to two styles and every style its module cannot take.
"""

from __future__ import annotations

import difflib
import textwrap

import attrs
import torch.nn as nn

from tpfn._fqn import describe, generalize, join, matches, near
from tpfn.errors import PlanError
from tpfn.layout import Partial, Replicate, Shard  # noqa: F401  (the doctest's names)
from tpfn.plans.mount import try_mount
from tpfn.style.constructors import on_shards, params  # noqa: F401  (the doctest's names)
from tpfn.style.stages import CORES
from tpfn.style.style import Style

__all__ = ["Plan", "plan", "as_plan", "resolve"]

# The widest plan printed on one line (a plan of a few rules, as in from_torch's doctest).
WIDTH = 100
# The widest comment line of a plan's notes.
NOTE_WIDTH = 96


def _check_pattern(pattern) -> str:
    if not isinstance(pattern, str):
        raise TypeError(f"plan keys must be module FQN patterns (str), e.g. 'layers.*.attention.wq' "
                        f"(got {pattern!r} that is a {type(pattern)!r}).")
    if pattern and any(part == "" for part in pattern.split(".")):
        raise ValueError(f"plan key {pattern!r} has an empty name component; write e.g. 'layers.*.w1'.")
    return pattern


def _flatten(mapping, prefix: str = "", found: list | None = None) -> list:
    """``(pattern, style)`` of every rule, nested plans joined; every value that is no style is
    one problem of one ``TypeError`` (a plan of transformers' strings, a constructor uncalled)."""
    top, found = found is None, [] if found is None else found
    if isinstance(mapping, Plan):
        mapping = dict(mapping.rules)
    if not isinstance(mapping, dict):
        raise TypeError(f"a plan is built from a dict of pattern -> style (got {mapping!r}).")
    out = []
    for pattern, value in mapping.items():
        key = join(prefix, _check_pattern(pattern))
        if isinstance(value, (dict, Plan)):
            out.extend(_flatten(value, key, found))
        elif isinstance(value, Style):
            out.append((key, value))
        else:
            found.append(_not_a_style(pattern, value))
    if top and found:
        raise TypeError(found[0] if len(found) == 1 else
                        f"{len(found)} plan values are not styles:\n" + "\n".join(f"  - {f}" for f in found))
    return out


def _not_a_style(pattern: str, value) -> str:
    if type(value).__module__.startswith("torch.distributed.tensor.parallel"):
        return (f"plan[{pattern!r}] is PyTorch's {type(value).__name__}(...), not a tpfn style; "
                "convert the whole plan with tpfn.from_torch(plan), which keeps its meaning.")
    if isinstance(value, str):
        return (f"plan[{pattern!r}] is the string {value!r}, not a tpfn style; a Hugging Face tp_plan "
                "(strings such as 'colwise') converts whole with tpfn.from_hf(tp_plan, model).")
    if callable(value) and getattr(value, "__module__", "").startswith("tpfn.style"):
        return f"plan[{pattern!r}] is the function {value.__name__}, not a style: call it, {value.__name__}()."
    return (f"plan[{pattern!r}] must be a style (colwise(), rowwise(), prepare_in(...), ...) "
            f"or a nested plan (got {value!r} that is a {type(value)!r}).")


def _merge(rules, fix: str = "") -> tuple:
    """The rules sorted by pattern, each once; ``fix`` (formatted with the conflicting
    pattern and right-hand style) ends the problem of a pattern bound to two styles."""
    merged, conflicts = {}, []
    for pattern, style in rules:
        if pattern in merged and merged[pattern] != style:
            conflicts.append(f"{pattern!r} is bound to {merged[pattern]!r} and to {style!r}"
                             + fix.format(rule=f"{{{pattern!r}: {style!r}}}"))
        merged.setdefault(pattern, style)
    if conflicts:
        raise PlanError(conflicts)
    return tuple(sorted(merged.items()))


def _name(value) -> str:
    return getattr(value, "__qualname__", None) or repr(value)


def _kinds(mapping, where: str = "plan kinds") -> tuple:
    """``((module class, ((built-in, row), ...)), ...)`` from ``{class: {built-in: row}}``,
    each checked: a module class, built-in names, callable rows."""
    if isinstance(mapping, tuple):
        return mapping
    if not isinstance(mapping, dict):
        raise TypeError(f"{where} must be a dict of module class -> {{built-in: row}}, e.g. "
                        f"{{MyLinear: {{'colwise': row}}}} (got {mapping!r} that is a {type(mapping)!r}).")
    out = []
    for kind, rows in mapping.items():
        if not (isinstance(kind, type) and issubclass(kind, nn.Module)):
            instance = f": pass its class, {type(kind).__name__}" if isinstance(kind, nn.Module) else ""
            raise TypeError(f"{where}: a rule is for a module class (a subclass of nn.Module), e.g. "
                            f"{{nn.MultiheadAttention: {{'colwise': row}}}}; got {kind!r} that is a "
                            f"{type(kind)!r}{instance}.")
        if not isinstance(rows, dict) or not rows:
            raise TypeError(f"{where}[{kind.__name__}] must be a dict of built-in -> row, e.g. "
                            f"{{'colwise': row}} (got {rows!r}).")
        for core, row in rows.items():
            if core not in CORES:
                raise ValueError(f"{where}[{kind.__name__}]: {core!r} is no built-in; rows are for "
                                 f"{', '.join(map(repr, CORES))}.")
            if not callable(row):
                raise TypeError(f"{where}[{kind.__name__}][{core!r}] must be a function (core, "
                                f"module, where, owned) -> style (got {row!r} that is a {type(row)!r}).")
        out.append((kind, tuple(sorted(rows.items()))))
    return tuple(out)


def _merge_kinds(a: tuple, b: tuple, conflicts: list | None) -> tuple:
    """The kinds of ``a``, then ``b``'s; a (class, built-in) with two rows is a conflict (or,
    with ``conflicts`` None, ``b``'s row replaces ``a``'s)."""
    merged = {kind: dict(rows) for kind, rows in a}
    for kind, rows in b:
        mine = merged.setdefault(kind, {})
        for core, row in rows:
            if conflicts is not None and mine.get(core, row) is not row:
                conflicts.append(f"{kind.__name__} has two rows for {core}(): {_name(mine[core])} "
                                 f"and {_name(row)}; keep one, or replace it: plan.kind("
                                 f"{kind.__name__}, {core}={_name(row)})")
            mine[core] = row
    return tuple((kind, tuple(sorted(rows.items()))) for kind, rows in merged.items())


def _notes(mapping) -> tuple:
    """``((pattern or None, text), ...)`` from ``{pattern or None: text}``, each checked."""
    if isinstance(mapping, tuple):
        return mapping
    if not isinstance(mapping, dict):
        raise TypeError(f"plan notes must be a dict of pattern (or None: the whole plan) -> text "
                        f"(got {mapping!r} that is a {type(mapping)!r}).")
    for key, text in mapping.items():
        if key is not None:
            _check_pattern(key)
        if not isinstance(text, str) or not text.strip():
            raise TypeError(f"plan notes[{key!r}] must be a non-empty str (got {text!r}).")
    return tuple(sorted(mapping.items(), key=lambda kv: (kv[0] is not None, kv[0] or "")))


def _merge_notes(a: tuple, b: tuple) -> tuple:
    """``a``'s notes, then ``b``'s: a pattern noted in both keeps ``b``'s note."""
    return _notes({**dict(a), **dict(b)})


def _comment(text: str, indent: str = "    ") -> str:
    """``text`` as comment lines, each at most ``NOTE_WIDTH`` wide."""
    return "".join(f"{indent}# {line}\n" for para in text.splitlines()
                   for line in textwrap.wrap(para, NOTE_WIDTH - len(indent) - 2, break_on_hyphens=False) or [""])


@attrs.frozen(repr=False)
class Plan:
    """FQN pattern -> style, sorted by pattern; equal by value, hashable. ``kinds``: what the
    built-ins mean on module kinds of the user's own, for this plan (``kind``); ``notes``:
    comments printed with it, no part of its value (``noted``)."""

    rules: tuple = ()
    kinds: tuple = attrs.field(default=(), converter=_kinds)
    notes: tuple = attrs.field(default=(), converter=_notes, eq=False)

    def noted(self, notes: dict) -> "Plan":
        """This plan with ``notes`` (pattern, or None for the whole plan -> text) printed as
        comments; they replace its notes of the same keys.

        >>> plan({"w1": colwise()}).noted({"w1": "sharded"}) == plan({"w1": colwise()})
        True
        """
        return attrs.evolve(self, notes=_merge_notes(self.notes, _notes(notes)))

    def __or__(self, other) -> "Plan":
        """Both plans' rules; a pattern bound to two different styles is an error (to
        replace a rule, ``override`` it), and so is a module kind given two rows."""
        return _joined(self, as_plan(other))

    def __ror__(self, other) -> "Plan":
        """``{pattern: style} | plan(...)``: the dict's rules, then the plan's."""
        return _joined(as_plan(other), self)

    def override(self, rules) -> "Plan":
        """This plan with ``rules`` (a plan, a dict as ``plan`` takes, or a style for the
        module itself) replacing the rules of the same patterns, and adding the others.

        A pattern only replaces the rule of exactly that pattern: ``'layers.0.mlp'`` next to
        ``'layers.*.mlp'`` is a second rule, and a pattern that matches no module (a typo) is
        reported, with near misses, when the plan is resolved.

        >>> plan({"w1": colwise(), "w2": rowwise()}).override({"w2": colwise(), "w3": rowwise()})
        plan({'w1': colwise(), 'w2': colwise(), 'w3': rowwise()})
        """
        other = as_plan(rules)
        return Plan(tuple(sorted({**dict(self.rules), **dict(other.rules)}.items())),
                    _merge_kinds(self.kinds, other.kinds, None), _merge_notes(self.notes, other.notes))

    def kind(self, kind: type, **rows) -> "Plan":
        """This plan with ``rows`` (built-in name -> ``row(core, module, where, owned)``)
        saying what the built-ins mean on ``kind``, a module class, and its subclasses;
        they replace the plan's earlier rows for the same built-ins.

        >>> class QuantLinear(nn.Module): ...
        >>> plan({"proj": colwise()}).kind(QuantLinear, colwise=print).kinds[0][0] is QuantLinear
        True
        """
        return Plan(self.rules, _merge_kinds(self.kinds, _kinds({kind: rows}, "plan.kind"), None),
                    self.notes)

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
            hint = f" (its patterns: {listed})" if rules else " (it has none)"
            said = "; ".join(f"no rule has the pattern {p!r}{near(p, rules) or hint}" for p in unknown)
            raise ValueError(f"plan.without({', '.join(map(repr, patterns))}): {said}; give each pattern "
                             "exactly as the plan has it (print(plan) lists them).")
        return Plan(tuple((p, s) for p, s in self.rules if p not in patterns), self.kinds,
                    tuple((p, t) for p, t in self.notes if p not in patterns))

    def under(self, prefix: str) -> "Plan":
        """This plan nested under ``prefix``: ``plan({"w1": s}).under("mlp") == plan({"mlp.w1": s})``."""
        nested = plan({_check_pattern(prefix): self})
        return attrs.evolve(nested, notes=_notes({
            key if key is None else join(prefix, key): text for key, text in self.notes}))

    def __repr__(self):
        kinds = ""
        if self.kinds:
            kinds = ", kinds={" + ", ".join(
                f"{_name(kind)}: {{" + ", ".join(f"{core!r}: {_name(row)}" for core, row in rows) + "}"
                for kind, rows in self.kinds) + "}"
        line = f"plan({dict(self.rules)!r}{kinds})"
        if len(line) <= WIDTH and not self.notes:
            return line
        notes = dict(self.notes)
        head = _comment(notes[None]) if None in notes else ""
        body = "".join((_comment(notes[p]) if p in notes else "") + f"    {p!r}: {s!r},\n" for p, s in self.rules)
        rules = dict(self.rules)
        tail = "".join(_comment(f"{p!r}: {t}") for p, t in self.notes if p is not None and p not in rules)
        return "plan({\n" + head + body + tail + "}" + kinds + ")"


def _joined(a: Plan, b: Plan) -> Plan:
    """``a``'s rules and kinds, then ``b``'s; every conflict is one problem of one ``PlanError``."""
    conflicts: list = []
    kinds = _merge_kinds(a.kinds, b.kinds, conflicts)
    try:
        merged = _merge(a.rules + b.rules, "; bind it once, or override it: plan.override({rule})")
    except PlanError as e:
        conflicts = e.problems + conflicts
    if conflicts:
        raise PlanError(conflicts)
    return Plan(merged, kinds, _merge_notes(a.notes, b.notes))


def _nested_kinds(mapping) -> tuple:
    """The kinds of every plan nested in ``mapping``, merged (a conflict is an error)."""
    if isinstance(mapping, Plan):
        return mapping.kinds
    kinds, conflicts = (), []
    for value in (mapping.values() if isinstance(mapping, dict) else ()):
        kinds = _merge_kinds(kinds, _nested_kinds(value), conflicts)
    if conflicts:
        raise PlanError(conflicts)
    return kinds


def plan(mapping: dict | Plan | None = None, *, kinds: dict | None = None,
         notes: dict | None = None) -> Plan:
    """The plan of ``mapping`` (pattern -> style or nested plan/dict), with ``kinds``: module
    class -> ``{built-in: row}``, what the built-ins mean on module kinds of one's own; and
    ``notes``: pattern (None: the whole plan) -> text, printed as comments (``Plan.noted``).

    >>> plan({"mlp": {"w1": colwise(), "w2": rowwise()}})
    plan({'mlp.w1': colwise(), 'mlp.w2': rowwise()})
    >>> plan({"w1": colwise()}, kinds={"Linear": {"colwise": print}})
    Traceback (most recent call last):
    ...
    TypeError: plan kinds: a rule is for a module class (a subclass of nn.Module), e.g. {nn.MultiheadAttention: {'colwise': row}}; got 'Linear' that is a <class 'str'>.
    """
    mapping = mapping or {}
    conflicts: list = []
    merged = _merge_kinds(_nested_kinds(mapping), _kinds(kinds or {}), conflicts)
    if conflicts:
        raise PlanError(conflicts)
    found = mapping.notes if isinstance(mapping, Plan) else ()
    return Plan(_merge(_flatten(mapping)), merged, _merge_notes(found, _notes(notes or {})))


def as_plan(value, found: list | None = None) -> Plan:
    """A plan from a plan, a dict, or a single style (bound to the module itself). A value that
    is no style raises a ``TypeError``; with ``found``, it is one problem there and left out."""
    if isinstance(value, Plan):
        return value
    if isinstance(value, Style):
        return Plan((("", value),))
    if found is not None and isinstance(value, dict):
        bad: list = []
        _flatten(value, found=bad)
        found.extend(bad)
        value = _styles(value) if bad else value
    return plan(value)


def _styles(mapping: dict) -> dict:
    """``mapping`` without the values that are no styles (nested dicts likewise)."""
    return {key: _styles(value) if isinstance(value, dict) else value for key, value in mapping.items()
            if isinstance(value, (dict, Plan, Style))}


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
    return kept + [f"{len(missing)} patterns start with {head + '.'!r}, which this module does not have, "
                   f"and match once it is dropped: the plan is for a model that holds this one as "
                   f"{head!r}; pass that model, or the plan's rules under {head + '.'!r} (e.g. {rest[0]!r})."]


def resolve(plan_like: Plan | dict | Style, module: nn.Module) -> tuple:
    """The ``Mount`` of every module a plan binds in ``module``, in module order (pure), or
    one ``PlanError`` listing every problem (values that are no styles among them)."""
    found, bound = [], {}
    resolved = as_plan(plan_like, found)
    modules = dict(module.named_modules())
    for pattern, style in resolved.rules:
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
    found = _prefixed(resolved.rules, modules, found)
    folded, below = [], {}  # below: fqn -> the relative names of the bound modules under it
    for fqn in bound:
        parts = fqn.split(".") if fqn else []
        for i in range(len(parts)):
            prefix = ".".join(parts[:i])
            if prefix in bound:
                below.setdefault(prefix, []).append(".".join(parts[i:]))
    for fqn, entries in ((fqn, bound[fqn]) for fqn in modules if fqn in bound):  # in module order
        styles = sorted({s for _, s in entries}, key=repr)
        if len(styles) > 1:
            by = "; ".join(f"{p!r} -> {s!r}" for p, s in entries)
            found.append(f"{describe(modules[fqn], fqn)} is bound to {len(styles)} styles ({by}); "
                         "bind it once, e.g. by combining them with >> or narrowing a pattern.")
            continue
        mount = try_mount(styles[0], modules[fqn], fqn, below.get(fqn, ()), resolved.kinds)
        if isinstance(mount, list):
            found.extend(mount)
        else:
            folded.append(mount)
    if found:
        raise PlanError(found)
    return tuple(folded)
