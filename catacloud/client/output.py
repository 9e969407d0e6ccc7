"""Output for people (aligned tables, ages, durations) and for scripts (JSON)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, TextIO


def print_json(data: Any, out: TextIO | None = None) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str), file=out or sys.stdout)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO | None = None) -> list[int]:
    """Aligned columns under their headers; answers the columns' widths (for :func:`table_row`)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    for row in [list(headers), *cells]:
        table_row(widths, row, out)
    return widths


def table_row(widths: Sequence[int], row: Sequence[Any], out: TextIO | None = None) -> None:
    """One more row of a table already printed (a watch's), in its columns."""
    cells = [_cell(v) for v in row]
    line = "  ".join(v.ljust(w) for v, w in zip(cells, widths, strict=True)).rstrip()
    print(line, file=out or sys.stdout, flush=True)


def fields(rows: Sequence[tuple[str, Any]], out: TextIO | None = None, width: int = 9) -> None:
    """One object as ``key     value`` lines, leaving out what is empty (``jobs show``)."""
    for key, value in rows:
        if value not in (None, ""):
            print(f"{key:<{width}}{value}", file=out or sys.stdout)


def short(uid: Any) -> str:
    """The 8 hex digits the console shows for an id (the CLI takes them back as a prefix)."""
    return str(uid)[:8]


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    return str(value).replace("\n", " ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def duration(seconds: float | None, *, spaced: bool = False) -> str:
    """How long, as people read it at a glance: ``42s``, ``3m05s``, ``2h10m``, ``4d3h`` (a table's
    column); ``spaced``, as the operator console writes it: ``9.5s`` (tenths under ten seconds),
    ``4m 12s``, ``2h 05m``, ``3d 4h``. ``-`` for None."""
    if seconds is None:
        return "-"
    if spaced and float(seconds) < 10:
        return f"{max(0.0, float(seconds)):.1f}s"
    s = max(0, int(seconds))
    gap = " " if spaced else ""
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{gap}{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{gap}{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{gap}{s % 86400 // 3600}h"


def age(value: str | None, now: datetime | None = None) -> str:
    when = parse_time(value)
    if when is None:
        return "-"
    return duration(((now or datetime.now(UTC)) - when).total_seconds())


def between(start: str | None, end: str | None, now: datetime | None = None) -> float | None:
    """Seconds from ``start`` to ``end`` (to now while ``end`` is unknown)."""
    a = parse_time(start)
    if a is None:
        return None
    b = parse_time(end) or (now or datetime.now(UTC))
    return (b - a).total_seconds()


def size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
