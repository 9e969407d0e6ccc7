"""Small server-side SVG charts for the console (no scripts, no chart library, no build step)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from html import escape

WIDTH, HEIGHT, LEFT, BOTTOM = 560, 120, 36, 16


def _nice_top(value: float) -> float:
    if value <= 0:
        return 1.0
    for step in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000):
        if value <= step:
            return float(step)
    return float(value)


def minute_chart(
    minutes: Sequence[datetime],
    bars: Sequence[tuple[str, str, Sequence[float]]],
    *,
    line: tuple[str, str, Sequence[float]] | None = None,
    unit: str = "",
    label: str,
) -> str:
    """Stacked bars per minute (``(name, colour, values)`` bottom to top) with an optional
    line on the same scale; the x axis marks every 15 minutes, the y axis its top value."""
    n = max(1, len(minutes))
    stacked = [sum(b[2][i] for b in bars) for i in range(n)]
    top = _nice_top(max([*stacked, *(line[2] if line else [])], default=0))
    step = (WIDTH - LEFT) / n
    parts = [
        f'<svg class="cc-chart" viewBox="0 0 {WIDTH} {HEIGHT + BOTTOM}" width="{WIDTH}" '
        f'height="{HEIGHT + BOTTOM}" role="img" aria-label="{escape(label)}" xmlns="http://www.w3.org/2000/svg">',
        f'<line x1="{LEFT}" y1="{HEIGHT}" x2="{WIDTH}" y2="{HEIGHT}" stroke="#999"/>',
        f'<text x="{LEFT - 4}" y="10" font-size="10" text-anchor="end">{top:g}{escape(unit)}</text>',
        f'<text x="{LEFT - 4}" y="{HEIGHT}" font-size="10" text-anchor="end">0</text>',
    ]
    for i, minute in enumerate(minutes):
        x = LEFT + i * step
        y = float(HEIGHT)
        for name, colour, values in bars:
            h = max(0.0, values[i]) / top * (HEIGHT - 4)
            if h <= 0:
                continue
            y -= h
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(1.0, step - 1):.1f}" height="{h:.1f}" '
                f'fill="{colour}"><title>{minute:%H:%M} {escape(name)}: '
                f"{values[i]:g}{escape(unit)}</title></rect>"
            )
        if minute.minute % 15 == 0:
            parts.append(
                f'<text x="{x:.1f}" y="{HEIGHT + 12}" font-size="10" text-anchor="middle">'
                f"{minute:%H:%M}</text>"
            )
    if line:
        name, colour, values = line
        points = " ".join(
            f"{LEFT + (i + 0.5) * step:.1f},{HEIGHT - v / top * (HEIGHT - 4):.1f}"
            for i, v in enumerate(values)
        )
        parts.append(
            f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="1.5">'
            f"<title>{escape(name)}</title></polyline>"
        )
    parts.append("</svg>")
    return "".join(parts)
