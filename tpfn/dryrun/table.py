"""Text tables and prose for a terminal: cells that wrap between words, columns fitted to a width.

A cell is ``(indent, tokens)`` (``cell(text)``); a token wraps onto the next line whole, and
one too long for its column is split after a space, a comma, a bracket or ``=``, never inside
a word: ``fit`` keeps each column at least as wide as its longest word, and where even that
exceeds the width, the table is wider than asked rather than cut mid-word.

>>> rows = [[cell("module"), cell("style")],
...         [cell("layers.0.attention.wq"), cell("colwise() >> prepare_out(Replicate())")]]
>>> for line in render(rows, 40):
...     print(line)
module                 style
layers.0.attention.wq  colwise()
                         >> prepare_out(
                         Replicate())
"""

from __future__ import annotations

import functools
import itertools
import re
import textwrap

__all__ = ["MIN_WIDTH", "EMPTY", "checked_width", "cell", "render", "flow", "prose"]

MIN_WIDTH = 40
_GAP = "  "
_MORE = "  "  # the indent of a cell's continuation lines
EMPTY = ("", ())  # an empty cell


def checked_width(width):
    """``width``, a report's terminal width: None (no limit) or at least ``MIN_WIDTH`` columns."""
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < MIN_WIDTH):
        raise ValueError(f"'width' must be None (no limit) or at least {MIN_WIDTH} columns (got {width!r}).")
    return width


def _tokens(text: str) -> list:
    """The pieces a cell may wrap between: words outside brackets, an operator (``>>``,
    ``->``) kept with the value after it."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == " " and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    glued: list = []
    for tok in out:
        if glued and glued[-1] in (">>", "->", "|"):
            glued[-1] += " " + tok
        elif tok:
            glued.append(tok)
    return glued


def cell(text: str) -> tuple:
    """``(indent, tokens)`` of a cell's text."""
    body = text.lstrip(" ")
    return text[:len(text) - len(body)], _tokens(body)


_PENALTY = {" ": 0, ",([": 3, "=": 4, "": 20}  # a token split at a space, a comma or bracket; none


def _cuts(token: str) -> list:
    """Where ``token`` may split: after a space, a comma, ``=``, or an opening bracket that
    does not close at once (``Replicate()`` is one word)."""
    return [i + 1 for i, ch in enumerate(token[:-1])
            if ch in " ,=" or (ch in "([" and token[i + 1] not in ")]")]


def _longest_word(c: tuple) -> int:
    """The widest word of cell ``c`` (its indent included): the narrowest its column may be."""
    indent, tokens = c
    words = (t[a:b].strip() for t in tokens for a, b in zip([0, *_cuts(t)], [*_cuts(t), len(t)]))
    return len(indent) + max(map(len, words), default=0)


def _split(token: str, room: int, rest: int, cuts: list) -> list:
    """A token longer than ``room`` in pieces (``rest`` wide after the first): after a space
    where one fits, else after a comma, bracket or ``=``; where none fits, after the first
    one (a piece wider than the room, never a word cut); the kind of each cut in ``cuts``."""
    pieces = []
    while len(token) > room:
        depth, after = 0, []
        for ch in token:
            depth += (ch in "([{") - (ch in ")]}")
            after.append(depth)
        allowed = _cuts(token)
        for marks in (" ", ",([", "=", ""):
            fits = [i for i in allowed if i <= room + (marks == " ") and token[i - 1] in marks
                    and i >= room // 3] if marks else allowed[:1]
            if fits:
                cut = min(fits, key=lambda i: (after[i - 1], -i)) if marks else fits[0]
                break
        else:  # one word: whole
            break
        cuts.append(marks)
        pieces.append(token[:cut].rstrip())
        token, room = token[cut:].lstrip(), rest
    return pieces + [token] if token else pieces


def _wrap(c: tuple, width: int | None, cuts: list | None = None) -> list:
    """The lines of a cell ``c`` in a column ``width`` wide (None: one line)."""
    indent, tokens = c
    if width is None or len(indent) + len(" ".join(tokens)) <= width:
        return [indent + " ".join(tokens)]
    fits = len(indent + _MORE) < width // 2 and _longest_word(c) + len(_MORE) <= width
    more = indent + _MORE if fits else ""  # continuation lines indented where every word still fits
    lines: list = []
    for tok in tokens:
        if lines and len(lines[-1]) + 1 + len(tok) <= width:
            lines[-1] += " " + tok
            continue
        prefix = more if lines else indent
        pieces = _split(tok, width - len(prefix), width - len(more), [] if cuts is None else cuts)
        lines += [(prefix if i == 0 else more) + piece for i, piece in enumerate(pieces)]
    return lines or [indent]


def _fit(rows: list, width: int | None) -> list:
    """The widths of the columns of ``rows`` (cells as ``(indent, tokens)``) within ``width``:
    each its natural width where all fit, else narrowed one column at a time where it costs
    the fewest lines and split tokens."""
    n = len(rows[0])
    widths = [max(len(_wrap(r[c], None)[0]) for r in rows) for c in range(n)]
    budget = None if width is None else width - len(_GAP) * (n - 1)
    if budget is None or sum(widths) <= budget:
        return widths
    floors = [max(6, budget // (2 * n), *(_longest_word(r[c]) for r in rows))
              for c in range(n)]  # never narrower than a word

    @functools.cache
    def cost(c, w):  # per row: (lines, penalty of the split tokens)
        found = []
        for r in rows:
            cuts: list = []
            found.append((len(_wrap(r[c], w, cuts)), sum(_PENALTY[k] for k in cuts)))
        return found

    def total(ws):
        columns = [cost(c, w) for c, w in enumerate(ws)]
        return sum(max(col[i][0] for col in columns) + sum(col[i][1] for col in columns)
                   for i in range(len(rows)))

    while sum(widths) > budget:
        narrower = [(total([*widths[:c], widths[c] - 1, *widths[c + 1:]]), -widths[c], c)
                    for c in range(n) if widths[c] > floors[c]]
        if not narrower:
            break
        widths[min(narrower)[2]] -= 1
    return widths


def render(rows: list, width: int | None) -> list:
    widths, out = _fit(rows, width), []
    for row in rows:
        cells = [_wrap(cell, w) for cell, w in zip(row, widths)]
        out += [_GAP.join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
                for line in itertools.zip_longest(*cells, fillvalue="")]
    return out


def flow(text: str, width: int | None, first: str = "", more: str = "  ") -> list:
    """A line of prose in lines of at most ``width``, broken after a ``;`` where one fits,
    else between words."""
    if width is None or len(first + text) <= width:
        return [first + text]
    chunks = [c + ";" for c in text.split("; ")]
    chunks[-1] = chunks[-1][:-1]
    lines = [first]
    for chunk in chunks:
        pad = "" if lines[-1] in (first, more) else " "
        if len(lines[-1]) + len(pad) + len(chunk) <= width:
            lines[-1] += pad + chunk
            continue
        if lines[-1] not in (first, more):
            lines.append(more)
        for word in chunk.split(" "):
            pad = "" if lines[-1] in (first, more) else " "
            if len(lines[-1]) + len(pad) + len(word) > width and lines[-1] not in (first, more):
                lines.append(more)
                pad = ""
            lines[-1] += pad + word
    return lines


def prose(text: str, width: int | None, first: str = "", more: str = "  ") -> list:
    """A sentence in lines of at most ``width``, broken between words."""
    if width is None:
        return [first + text]
    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=more,
                         break_on_hyphens=False, break_long_words=False)
