"""Exponential backoff with jitter: the one rule for every retry, the agent's requests and the
server's Celery tasks alike (the server depends on this distribution, so both import it here)."""

from __future__ import annotations

import random


def backoff(
    attempt: int,
    *,
    base: float = 1.0,
    cap: float = 300.0,
    hint: float | None = None,
    jitter: tuple[float, float] = (0.5, 1.5),
) -> float:
    """Seconds before retry number ``attempt`` (0-based): ``base * 2**attempt`` capped at ``cap``,
    times a random factor in ``jitter`` so that many retrying clients spread out; never sooner
    than a hint from the other side (Retry-After), capped likewise."""
    delay = min(cap, base * (2 ** min(attempt, 30)))
    if hint:
        return min(cap, max(hint, delay))
    return min(cap, delay * random.uniform(*jitter))


# A heartbeat comes every interval, give or take this share of it: fleets that started (or
# reconnected) together spread out instead of beating in step, and never later than 1.1 x the
# interval, far inside the server's lost rule (3 intervals).
HEARTBEAT_JITTER = 0.1


def heartbeat_delay(interval: float) -> float:
    """Seconds to the next heartbeat: ``interval`` give or take ``HEARTBEAT_JITTER``."""
    return interval * random.uniform(1 - HEARTBEAT_JITTER, 1 + HEARTBEAT_JITTER)
