"""Plain-text tables: what ``h3serve plan`` and the benchmarks print (torch-free, so the GPU scripts import it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "nan" if value != value else f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return "-" if value is None else str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> str:
    """A plain-text table (first column left-aligned, the rest right-aligned), printed and returned; benchmarks
    print theirs with it too."""
    cells = [list(map(str, headers))] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    text = "\n".join([*([title] if title else []), line(cells[0]), "  ".join("-" * w for w in widths)])
    text = "\n".join([text, *map(line, cells[1:])])
    print(text, flush=True)
    return text
