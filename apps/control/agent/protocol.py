"""The agent server's HTTP protocol: uvicorn's httptools protocol with the limits it lacks.

- **Header timeout** (``CATACLOUD_AGENT_HEADER_TIMEOUT``, default 5 s): a connection must
  deliver a request's whole header within this of connecting, and of the first byte of each
  next request on a kept-alive connection; otherwise it is closed. An idle connection that
  never sends, or one that sends its header a byte at a time, no longer stays open for ever
  (between requests, uvicorn's keep-alive timeout applies as before). An agent sends its
  header the moment it has connected: a few round trips are plenty.
- **Connection budgets** (:mod:`apps.control.agent.limits`): each connection is unauthenticated
  until one of its requests carries a live machine's agent token, then that machine's. A
  machine holds at most ``CATACLOUD_AGENT_MAX_CONNECTIONS_PER_MACHINE``; unauthenticated
  connections share their own budget, whose oldest connection is closed to make room for a new
  one. This protocol tells the ledger when a connection opens, carries a request and closes,
  and hands the connection to the application in the scope (``extensions``).
- **Shutdown**: a long poll still waiting (``GET work``, nothing sent yet) is cut at once
  instead of being waited for (agents poll again): a stop no longer ends with uvicorn's
  "Cancel N running task(s), timeout graceful shutdown exceeded".

``catacloud agent-server`` and ``make dev`` run uvicorn with ``--http
apps.control.agent.protocol:AgentHttpProtocol``.
"""

from __future__ import annotations

import asyncio

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Imported by uvicorn before the application, so before Django is set up: the ledger needs no
# model (settings are read at each connection).
from apps.control.agent.limits import CONNECTION, LEDGER, Connection

POLL_PATH = "/api/agent/v1/work"


class AgentHttpProtocol(HttpToolsProtocol):
    _conn: Connection | None = None
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._conn = Connection(self.client[0] if self.client else "", self._shed)
        LEDGER.opened(self._conn)
        self._arm()

    def _shed(self) -> None:
        """The ledger made room for a newer connection: close this one (no answer: an idle one
        asked nothing, and one with a request in flight never showed a machine's token)."""
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def _arm(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            timeout = float(settings.CATACLOUD_AGENT_HEADER_TIMEOUT)
            if timeout > 0:
                self._header_timer = self.loop.call_later(timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()  # no header in time: nothing was asked, nobody to answer

    def on_message_begin(self) -> None:
        self._arm()  # a kept-alive connection's next request: its header is due now
        super().on_message_begin()
        self.scope["extensions"] = {CONNECTION: self._conn}  # type: ignore[dict-item]  # ours, not a dict

    def on_headers_complete(self) -> None:
        self._disarm()
        if self._conn is not None:
            self._conn.busy = True
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        if self._conn is not None:
            self._conn.busy = False
        super().on_response_complete()

    def shutdown(self) -> None:
        cycle = self.cycle
        waiting_poll = (
            cycle is not None
            and not cycle.response_started
            and not cycle.response_complete
            and self.scope is not None
            and self.scope.get("method") == "GET"
            and self.scope.get("path") == POLL_PATH
        )
        if waiting_poll:
            self.transport.close()  # its agent sees the connection end and polls again
            return
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._conn is not None:
            LEDGER.closed(self._conn)
            self._conn = None
        super().connection_lost(exc)
