"""PostgreSQL advisory lock keys, in one place so no two jobs ever share one by accident."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from django.db import connection

REAPER = 0x0CA7_0001
# Held for as long as a process leads the reaper (apps.control.election): one leader among
# every worker and beat; its death (its connection's) frees it for the next.
REAPER_LEADER = 0x0CA7_0004
SCHEDULER_TICK = 0x0CA7_0002
# One refill listener in the cluster (apps.pools.refill).
REFILL_LISTENER = 0x0CA7_0003
# pg_advisory_xact_lock(POOL_REFILL, hashtext(pool id)): one refill (or drain) of a pool at a time,
# without holding the pool row (claims update it to signal the next refill).
POOL_REFILL = 0x0CA7
# pg_advisory_xact_lock[_shared](MACHINE_RELEASES, hashtext("<org id>:<machine type id>")): a
# job's end that keeps its machine for the next job takes it shared; what buys machines of the
# grant takes it alone before counting (a pool's refill; placement, once jobs are left without a
# machine). Each then waits for the releases being committed (and counts their machines as
# idle), and a release that begins meanwhile commits after it: nothing is bought while a machine
# it cannot see yet becomes idle (releases take nothing from each other, and a placement that
# found a machine for every job never takes it).
MACHINE_RELEASES = 0x0CA8


def machine_releases_lock(*, org_id: object, machine_type_id: object, shared: bool) -> None:
    """One grant's MACHINE_RELEASES lock until the transaction ends: ``shared`` for a release."""
    function = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {function}(%s, hashtext(%s))", [MACHINE_RELEASES, f"{org_id}:{machine_type_id}"]
        )


@contextlib.contextmanager
def try_advisory_lock(key: int) -> Iterator[bool]:
    """Session-level ``pg_try_advisory_lock``: yields whether we got it; released on exit.

    Session-level (not transaction-level) so that it may be held across work that commits
    several small transactions and calls providers; a dead worker's connection drops it.
    """
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
        got = bool(cursor.fetchone()[0])
    try:
        yield got
    finally:
        if got:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
