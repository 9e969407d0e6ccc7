"""Formatting for the operator console: durations, ages, short ids, money."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django import template
from django.utils import timezone
from django.utils.html import format_html

import catacloud
from catacloud.client import output

register = template.Library()


def human_seconds(seconds: float | None) -> str:
    """``3d 4h``, ``2h 05m``, ``4m 12s``, ``9.5s``, ``-`` for None: the command line's durations,
    spaced (:func:`catacloud.client.output.duration`)."""
    return output.duration(seconds, spaced=True)


def between(start: datetime | None, end: datetime | None) -> float | None:
    if start is None:
        return None
    return ((end or timezone.now()) - start).total_seconds()


@register.filter
def duration(seconds: float | timedelta | None) -> str:
    if isinstance(seconds, timedelta):
        seconds = seconds.total_seconds()
    return human_seconds(seconds)


@register.filter
def ago(when: datetime | None) -> str:
    return "-" if when is None else f"{human_seconds(between(when, None))} ago"


def short_id_html(value: Any) -> str:
    """The first 8 characters of a UUID, the whole id in the tooltip (and for copy)."""
    if value is None or value == "":
        return "-"
    full = str(value)
    return format_html('<code class="cc-id" title="{}">{}</code>', full, full[:8])


@register.filter
def short_id(value: Any) -> str:
    return short_id_html(value)


@register.filter
def money(value: Decimal | float | None, places: int = 2) -> str:
    if value is None:
        return "-"
    return f"{Decimal(value):.{int(places)}f}"


@register.filter
def percent(share: float | None) -> str:
    """A share (0..1) as a percentage to one decimal, ``-`` for None (nothing to share)."""
    return "-" if share is None else f"{100 * share:.1f}%"


def fine_money(value: Decimal | float | str | None) -> str:
    """An amount with at least 4 decimals and as many more (up to the recorded 6) as it takes to
    show its first two significant digits: a few seconds' share of a cheap machine reads
    0.000056, never 0.0000."""
    if value is None:
        return "-"
    amount = Decimal(str(value))
    places = 4
    if amount and abs(amount) < Decimal("0.01"):
        places = min(6, max(4, 1 - abs(amount).adjusted()))
    return f"{amount:.{places}f}"


register.filter("fine_money", fine_money)


@register.simple_tag
def catacloud_version() -> str:
    """The control plane's version (``catacloud.__version__``; /readyz names the same)."""
    return catacloud.__version__
