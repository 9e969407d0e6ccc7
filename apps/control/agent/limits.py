"""The agent server's connection budgets: one per machine, and one for connections no machine
has claimed yet.

Many machines share one address (cloud machines behind a NAT, local machines on loopback, every
agent behind a proxy), and a job can open connections from its machine's address too; a budget
per address let one job's connections starve every machine behind that address. So:

- **Per machine** (``CATACLOUD_AGENT_MAX_CONNECTIONS_PER_MACHINE``, default 16): a connection
  belongs to the machine whose agent token its request carries (checked against the database
  once, then kept in :class:`Machines`, so the hot heartbeat pays a dictionary look-up). A
  machine holds at most this many; a request that would make one more is answered 429
  ``too_many_connections`` with ``Retry-After`` and its connection closed. An agent holds a
  few (heartbeat, poll, log posts, uploads, ``job-meta``). Each connection carries at most one
  request at a time, so this bounds the machine's concurrent requests too. Only that
  machine's requests are refused.
- **Unauthenticated** (``CATACLOUD_AGENT_MAX_UNAUTHENTICATED``, default 2048, and
  ``CATACLOUD_AGENT_MAX_UNAUTHENTICATED_PER_ADDRESS``, default 512): a connection that has not
  yet shown a live machine's token (no header yet, a header trickling in, no token, an unknown
  one; ``enroll`` too) counts here until one of its requests does. When a new connection
  would pass either cap, the **oldest** unauthenticated connection (of its address, or of all)
  is closed to make room: one idle between requests before one with a request in flight. A
  new connection is therefore never refused: an agent's connection needs to stay only for the
  round trip its header takes, while a flood from one place only ever replaces its own oldest
  connections (the per-address cap keeps it from pushing out other addresses' connections).
  Refusing new connections instead (a full budget closing newcomers) would let 1,000 idle
  sockets lock every agent out until the header timeout; a reserve kept for agents would
  still need telling agents from junk before their header arrives, which nothing can.
  Together with the header timeout (apps.control.agent.protocol) this bounds what junk holds:
  never more than these caps, never longer than the timeout.

This module is the ledger (imported by the protocol, before Django is set up); which machine
a request's token names, and the 429, are :mod:`apps.control.agent.admission`'s.

Both are per process (``--workers N`` multiplies them). The web (WSGI) serves the Agent API
without them; agents should use the agent server (``CATACLOUD_AGENT_URL``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from django.conf import settings

log = logging.getLogger(__name__)

# The scope's ``extensions`` key under which the agent server's protocol hands its connection
# to the application (apps.control.agent.admission).
CONNECTION = "catacloud.connection"
# Repeated warnings about one address or one machine: at most one per this many seconds.
WARN_EVERY = 60.0


class Connection:
    """One connection's place in the ledger (the protocol holds it; ``close`` closes it)."""

    __slots__ = ("address", "busy", "close", "machine", "open")

    def __init__(self, address: str, close: Callable[[], None]) -> None:
        self.address = address
        self.close = close
        self.machine: str | None = None  # None: unauthenticated
        self.busy = False  # a request is in flight
        self.open = True  # False once closed or shed: it counts nowhere again


class Ledger:
    """Who holds which connection, in this process (the event loop's thread only)."""

    def __init__(self) -> None:
        # unauthenticated connections, oldest first: all, and by address
        self._unauthenticated: OrderedDict[Connection, None] = OrderedDict()
        self._by_address: dict[str, OrderedDict[Connection, None]] = {}
        self._by_machine: Counter[str] = Counter()
        self._warned: dict[str, float] = {}

    def opened(self, conn: Connection) -> None:
        """A new connection, unauthenticated: make room for it first."""
        total = settings.CATACLOUD_AGENT_MAX_UNAUTHENTICATED
        per_address = settings.CATACLOUD_AGENT_MAX_UNAUTHENTICATED_PER_ADDRESS
        mine = self._by_address.get(conn.address)
        if per_address and mine is not None and len(mine) >= per_address:
            self._shed_oldest(mine, f"{conn.address} holds {per_address} unauthenticated connections")
        elif total and len(self._unauthenticated) >= total:
            self._shed_oldest(self._unauthenticated, f"{total} unauthenticated connections in all")
        self._unauthenticated[conn] = None
        self._by_address.setdefault(conn.address, OrderedDict())[conn] = None

    def _shed_oldest(self, among: OrderedDict[Connection, None], why: str) -> None:
        victim = next((c for c in among if not c.busy), None) or next(iter(among))
        self._forget(victim)
        victim.open = False
        self._warn(f"address:{victim.address}", "agent server: %s; closing the oldest", why)
        victim.close()

    def claim(self, conn: Connection, machine: str) -> bool:
        """The connection's request carries ``machine``'s token: the connection is the
        machine's from now on, unless the machine holds its whole budget already (False)."""
        if conn.machine == machine or not conn.open:
            return True  # (a connection gone meanwhile: its answer has nowhere to go anyway)
        cap = settings.CATACLOUD_AGENT_MAX_CONNECTIONS_PER_MACHINE
        if cap and self._by_machine[machine] >= cap:
            self._warn(f"machine:{machine}", "agent server: machine %s holds %d connections", machine, cap)
            return False
        self._forget(conn)
        conn.machine = machine
        self._by_machine[machine] += 1
        return True

    def closed(self, conn: Connection) -> None:
        self._forget(conn)
        conn.open = False

    def _forget(self, conn: Connection) -> None:
        """Take ``conn`` out of whatever budget it counts in (again: nothing happens)."""
        if conn.machine is not None:
            self._by_machine[conn.machine] -= 1
            if self._by_machine[conn.machine] <= 0:
                del self._by_machine[conn.machine]
            conn.machine = None
            return
        if conn in self._unauthenticated:
            del self._unauthenticated[conn]
            mine = self._by_address[conn.address]
            del mine[conn]
            if not mine:
                del self._by_address[conn.address]

    def _warn(self, key: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._warned.get(key, -WARN_EVERY) >= WARN_EVERY:
            self._warned[key] = now
            if len(self._warned) > 10_000:  # a flood from many addresses: forget the old marks
                self._warned = {k: t for k, t in self._warned.items() if now - t < WARN_EVERY}
            log.warning(message, *args)


LEDGER = Ledger()
