"""``catacloud events ls``: what happened in the organization (``GET /events/``), newest first,
filtered by kind, job, pool or machine; ``--watch`` prints new events as they come."""

from __future__ import annotations

import argparse
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from catacloud.client.api import Api
from catacloud.client.base import (
    Commands,
    UsageError,
    resolve_id,
    retrying,
    show_list,
    watch_flags,
    watch_rows,
)
from catacloud.client.output import age, parse_time, short

COLUMNS = ("AGE", "KIND", "BY", "OBJECT", "REASON")
_AGO = re.compile(r"(?P<n>\d+)(?P<unit>[smhd])")
_UNIT = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
COMMIT_SLACK = timedelta(seconds=60)  # --watch: how far back each poll looks again


def register(at: Commands) -> None:
    events = at.group("events", "what happened: every change of state, newest first")
    p = at.command(events, "ls", cmd_events_ls, "list events, newest first (--watch: new ones as they come)")
    p.add_argument("--kind", metavar="PREFIX", help="kinds starting with this, e.g. pool or job.finished")
    p.add_argument("--job", metavar="JOB", help="only this job's (id or its first digits)")
    p.add_argument("--pool", metavar="POOL", help="only this pool's (name or id)")
    p.add_argument("--instance", metavar="INSTANCE", help="only this machine's (id or its first digits)")
    p.add_argument("--since", metavar="WHEN", help="only newer ones: 10m, 2h, 1d ago, or an ISO time")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    watch_flags(p, "new event")


def since(value: str, now: datetime | None = None) -> str:
    """``--since``: ``90s``, ``10m``, ``2h``, ``1d`` ago, or an ISO 8601 time, as the API's ISO time."""
    found = _AGO.fullmatch(value.strip())
    if found:
        ago = timedelta(**{_UNIT[found["unit"]]: int(found["n"])})
        return ((now or datetime.now(UTC)) - ago).isoformat()
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"--since takes 10m, 2h, 1d or an ISO time, got {value!r}") from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).isoformat()


def _object(e: dict) -> str | None:
    for key, kind in (("job_id", "job"), ("instance_id", "instance"), ("pool_id", "pool")):
        if e.get(key):
            return f"{kind} {short(e[key])}"
    return None


def _cells(e: dict) -> list[Any]:
    return [age(e["created_at"]), e["kind"], e["actor"], _object(e), e["reason"]]


def cmd_events_ls(api: Api, args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"kind_prefix": args.kind}
    if args.job:
        params["job_id"] = resolve_id(api, "job", "jobs/", args.job)
    if args.pool:
        params["pool_id"] = resolve_id(api, "pool", "pools/", args.pool, by_name=True)
    if args.instance:
        params["instance_id"] = resolve_id(api, "instance", "instances/", args.instance)
    if args.since:
        params["since"] = since(args.since)
    if not args.watch:
        rows = api.pages("events/", limit=max(1, args.limit), **params)
        return show_list(args, rows, COLUMNS, _cells, empty="no events")

    def fetch() -> list[dict]:
        """Oldest first, so new events follow on below; then those since a while before the
        newest seen (an event is stamped when written, seen when its transaction commits: one
        written a moment before the newest may show after it; the watch prints each id once)."""
        rows = list(retrying(lambda: api.pages("events/", limit=max(1, args.limit), **params)))[::-1]
        newest = parse_time(rows[-1]["created_at"]) if rows else None
        if newest is not None:
            params["since"] = (newest - COMMIT_SLACK).isoformat()
        return rows

    return watch_rows(fetch, COLUMNS, _cells, args, empty="no events yet; watching")
