"""Plain-text tables: what ``Platform.explain()``, ``flowseam backends`` and ``flowseam models``
print (text in, lines out; it imports nothing of flowseam)."""

from __future__ import annotations

import textwrap
from typing import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], width: int,
                 wrap: Sequence[int] = ()) -> list[str]:
    """Lines of a left-aligned table (a header, a rule, the rows) no wider than ``width`` when
    it can be: the columns whose indices are in ``wrap`` share the width the others leave and
    wrap between words (a list after its commas, never inside an item); the other columns are as
    wide as their longest cell."""
    gap = 2
    natural = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    widths = list(natural)
    if wrap:
        fixed = sum(w + gap for i, w in enumerate(natural) if i not in wrap)
        room = width - fixed - gap * (len(wrap) - 1)
        # each wrapping column gets a share in proportion to its content, at least its longest
        # word (lines break at spaces only, so a list breaks between its items)
        longest = {i: max([len(header[i])] + [len(word) for r in rows for word in r[i].split()])
                   for i in wrap}
        if sum(natural[i] for i in wrap) > room:
            # every wrapping column gets its longest word; the room left over goes first to the
            # columns that then fit unwrapped (least need first), the rest is shared in
            # proportion to need
            extra = max(0, room - sum(longest.values()))
            need = {i: natural[i] - longest[i] for i in wrap}
            for i in wrap:
                widths[i] = longest[i]
            pending = sorted(wrap, key=lambda i: need[i])
            while pending and need[pending[0]] <= extra // len(pending):
                i = pending.pop(0)
                widths[i] += need[i]
                extra -= need[i]
            total = sum(need[i] for i in pending) or 1
            for i in pending:
                widths[i] += extra * need[i] // total
    lines = []
    for cells in [list(header)] + [list(r) for r in rows]:
        parts = []
        for i, cell in enumerate(cells):
            if i in wrap and len(cell) > widths[i]:
                parts.append(textwrap.wrap(cell, widths[i], break_long_words=False,
                                           break_on_hyphens=False))
            else:
                parts.append([cell])
        for k in range(max(len(p) for p in parts)):
            line = "".join(f"{(p[k] if k < len(p) else ''):<{w + gap}}"
                           for p, w in zip(parts, widths))
            lines.append(line.rstrip())
        if cells == list(header):
            lines.append("-" * min(width, max(len(x) for x in lines)))
    return lines


def terminal_width(default: int = 100) -> int:
    """The width to format tables for: the terminal's when stdout is one, else ``default``."""
    import shutil
    import sys

    if sys.stdout.isatty():
        return max(60, shutil.get_terminal_size((default, 24)).columns)
    return default
