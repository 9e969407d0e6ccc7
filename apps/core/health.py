"""Health of what Catacloud depends on: database, broker, workers, beat, the reaper.

Three answers (the Kubernetes convention): ``/livez`` (this process answers: restart it if
not; no dependency is asked), ``/readyz`` (every part is up: database, broker, a worker, beat
and a reaper tick within ``REAPER_STALE_INTERVALS`` intervals; 503 until then: wait on it before
sending work) and ``/healthz`` (200 while the API can serve, ``degraded`` when workers, beat or
the reaper's ticks are missing). Everyone gets an answer's ``status``; its ``checks`` only come
with the metrics token or a staff session (apps.core.views): the reaper's shows its last tick
(when, by which process, how long it took).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import connection
from django.utils import timezone

import catacloud
from apps.core.models import Heartbeat

BEAT_STALE_AFTER = timedelta(seconds=35)
# The reaper is late when its last tick is older than this many intervals (plus 5 s).
REAPER_STALE_INTERVALS = 3


def _timed(fn: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        extra = fn() or {}
        ok = extra.pop("ok", True)
    except Exception as exc:  # a health check reports failures, it does not raise them
        ok, extra = False, {"error": type(exc).__name__}
    return {"ok": ok, "ms": round((time.perf_counter() - start) * 1000, 1), **extra}


def _database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


def _broker() -> None:
    import redis

    client = redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_timeout=1, socket_connect_timeout=1)
    try:
        client.ping()
    finally:
        client.close()


def _workers() -> dict[str, Any]:
    names = cache.get("health:workers")
    if names is None:
        from config.celery import app

        replies = app.control.ping(timeout=0.5) or []
        names = sorted(name for reply in replies for name in reply)
        cache.set("health:workers", names, 5)
    return {"ok": bool(names), "count": len(names)}


def _beat() -> dict[str, Any]:
    mark = Heartbeat.objects.filter(name="beat").first()
    if mark is None:
        return {"ok": False, "last_seen": None}
    age = timezone.now() - mark.seen_at
    return {"ok": age < BEAT_STALE_AFTER, "last_seen": mark.seen_at.isoformat()}


def _reaper() -> dict[str, Any]:
    mark = Heartbeat.objects.filter(name="reaper").first()
    if mark is None:
        return {"ok": False, "last_tick": None}
    age = (timezone.now() - mark.seen_at).total_seconds()
    stale = REAPER_STALE_INTERVALS * settings.CATACLOUD_REAPER_INTERVAL + 5
    detail = mark.detail or {}
    return {
        "ok": age < stale,
        "last_tick": mark.seen_at.isoformat(),
        "age_seconds": round(age, 1),
        "by": detail.get("by", ""),
        "tick_seconds": detail.get("seconds"),
    }


def _checks() -> dict[str, dict[str, Any]]:
    checks = {"database": _timed(_database), "broker": _timed(_broker)}
    if checks["broker"]["ok"]:
        checks["workers"] = _timed(_workers)
    else:
        checks["workers"] = {"ok": False, "error": "broker down"}
    for name, check in (("beat", _beat), ("reaper", _reaper)):
        checks[name] = _timed(check) if checks["database"]["ok"] else {"ok": False, "error": "database down"}
    return checks


def health() -> tuple[int, dict[str, Any]]:
    """200 when the database and broker answer (workers, beat and the reaper are reported;
    their absence makes the answer ``degraded``, not unhealthy: the API still serves); else 503."""
    checks = _checks()
    essential = checks["database"]["ok"] and checks["broker"]["ok"]
    overall = "ok" if all(c["ok"] for c in checks.values()) else ("degraded" if essential else "unhealthy")
    return (200 if essential else 503), {"status": overall, "checks": checks}


def readiness() -> tuple[int, dict[str, Any]]:
    """200 only when every part is up (database, broker, a worker, beat, the reaper ticking); else 503."""
    checks = _checks()
    ready = all(c["ok"] for c in checks.values())
    body = {"status": "ready" if ready else "not_ready", "version": catacloud.__version__, "checks": checks}
    return (200 if ready else 503), body
