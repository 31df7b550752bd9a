"""Module names: joining, generalizing and matching FQNs, and how errors name a module.

>>> join("layers.0", "w1"), generalize("layers.11.attention.w1"), matches("layers.*.w1", "layers.3.w1")
('layers.0.w1', 'layers.*.attention.w1', True)
"""

from __future__ import annotations

import difflib
import re
from fnmatch import fnmatchcase

__all__ = ["join", "generalize", "within", "matches", "spell", "describe", "near"]


def join(*names: str) -> str:
    """The dotted name of the non-empty ``names``."""
    return ".".join(n for n in names if n)


def generalize(fqn: str) -> str:
    """The FQN with every list index as ``*`` (a plan's pattern for all the layers)."""
    return re.sub(r"(?<![^.])\d+(?![^.])", "*", fqn)


def within(fqn: str, parent: str) -> bool:
    """Whether module ``fqn`` is ``parent`` or lies inside it (the root, ``''``, holds every module).

    >>> within("layers.0.w1", "layers.0"), within("layers.0", "layers.0"), within("layers.01", "layers.0")
    (True, True, False)
    """
    return not parent or fqn == parent or fqn.startswith(parent + ".")


def matches(pattern: str, fqn: str) -> bool:
    """Whether ``pattern`` (``*`` or any fnmatch pattern per name component) names ``fqn``."""
    if not pattern:
        return not fqn
    parts, names = pattern.split("."), fqn.split(".") if fqn else []
    return len(parts) == len(names) and all(map(fnmatchcase, names, parts))


def spell(values: dict, fqns) -> dict:
    """``{pattern: value}`` for ``{fqn: value}``: one generic pattern where it names exactly
    the modules (of ``fqns``, every module's name) that share a value, the names elsewhere
    (and for top-level children themselves: ``'*'`` would read as every child).

    >>> spell({"layers.0.w": 1, "layers.1.w": 1, "out": 2}, ["layers.0.w", "layers.1.w", "out"])
    {'layers.*.w': 1, 'out': 2}
    >>> spell({"0.w": 1, "1.w": 1, "2": 2}, ["0", "0.w", "1", "1.w", "2"])   # an nn.Sequential of blocks
    {'*.w': 1, '2': 2}
    """
    groups: dict = {}
    for fqn, value in values.items():
        groups.setdefault((generalize(fqn), value), []).append(fqn)
    entries = {}
    for (pattern, value), named in groups.items():
        if pattern != "*" and sorted(f for f in fqns if matches(pattern, f)) == sorted(named):
            entries[pattern] = value
        else:
            entries.update(dict.fromkeys(named, value))
    return entries


def describe(module, fqn: str) -> str:
    """``'layers.0.w1' (Linear)``: how errors name a module."""
    return f"{fqn or '<root>'!r} ({type(module).__name__})"


def near(name: str, options) -> str:
    """`` (did you mean 'a' or 'b'?)`` for the options close to ``name``, else ``''``."""
    close = difflib.get_close_matches(name, list(options), n=3)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
