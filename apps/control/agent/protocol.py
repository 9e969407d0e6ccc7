"""The agent server's HTTP protocol: uvicorn's httptools protocol with two limits it lacks.

- **Header timeout** (``CATACLOUD_AGENT_HEADER_TIMEOUT``, default 10 s): a connection must
  deliver a request's whole header within this of connecting, and of the first byte of each
  next request on a kept-alive connection; otherwise it is closed. An idle connection that
  never sends, or one that sends its header a byte at a time, no longer stays open for ever
  (between requests, uvicorn's keep-alive timeout applies as before).
- **Shutdown**: a long poll still waiting (``GET work``, nothing sent yet) is cut at once
  instead of being waited for (agents poll again): a stop no longer ends with uvicorn's
  "Cancel N running task(s), timeout graceful shutdown exceeded".
- **Connections per client** (``CATACLOUD_AGENT_MAX_CONNECTIONS_PER_CLIENT``, default 100, 0 =
  no limit): a peer address that already holds this many connections to this process has its
  next one closed at once. An agent holds a few (heartbeat, poll, log and upload posts); behind
  a proxy every agent comes from the proxy's address: raise it or set 0 there.

``catacloud agent-server`` and ``make dev`` run uvicorn with ``--http
apps.control.agent.protocol:AgentHttpProtocol``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)
POLL_PATH = "/api/agent/v1/work"
_per_client: Counter[str] = Counter()  # open connections by peer address, in this process
_refusals_logged: set[str] = set()


def _limits() -> tuple[float, int]:
    from django.conf import settings

    return settings.CATACLOUD_AGENT_HEADER_TIMEOUT, settings.CATACLOUD_AGENT_MAX_CONNECTIONS_PER_CLIENT


class AgentHttpProtocol(HttpToolsProtocol):
    _peer: str | None = None
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        header_timeout, per_client = _limits()
        peer = self.client[0] if self.client else None
        if peer is not None and per_client and _per_client[peer] >= per_client:
            if peer not in _refusals_logged:  # once per address, not once per connection
                _refusals_logged.add(peer)
                log.warning("agent server: %s holds %d connections; closing new ones", peer, per_client)
            transport.close()
            return
        if peer is not None:
            self._peer = peer
            _per_client[peer] += 1
        self._arm(header_timeout)

    def _arm(self, seconds: float | None = None) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            timeout = _limits()[0] if seconds is None else seconds
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

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

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
        if self._peer is not None:
            _per_client[self._peer] -= 1
            if _per_client[self._peer] <= 0:
                del _per_client[self._peer]
                _refusals_logged.discard(self._peer)
            self._peer = None
        super().connection_lost(exc)
