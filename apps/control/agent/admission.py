"""Which budget a request of the agent server counts in (apps.control.agent.limits): the
machine its agent token names, looked up once and then remembered, and the 429 a machine gets
when it holds its whole budget."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from apps.control.agent.limits import CONNECTION, LEDGER, Connection
from apps.control.agent.views import instance_by_token
from apps.core.crypto import hash_token
from apps.core.errors import ErrorCode, error_payload
from apps.machines.agents import AGENT_TOKEN_PREFIX

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# What a refused machine is told to wait (its agent retries with its own backoff at least this).
RETRY_AFTER = 1


class Machines:
    """Agent token digest -> the live machine holding it, as the database said a while ago.

    It only decides which budget a connection counts in; every endpoint still checks the token
    against the database itself, so a machine that ended keeps its entry harmlessly until it
    expires. Unknown tokens are remembered for a shorter while, in a map of their own, so a
    stream of made-up tokens costs one statement each and never pushes real machines out."""

    KNOWN_FOR = 600.0
    UNKNOWN_FOR = 10.0
    MAX_KNOWN = 50_000
    MAX_UNKNOWN = 4096

    def __init__(self) -> None:
        self._known: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._unknown: OrderedDict[str, float] = OrderedDict()

    async def of(self, authorization: str) -> str | None:
        """The machine whose agent token ``authorization`` carries, or None."""
        parts = authorization.split()
        if len(parts) != 2 or parts[0] != "Agent" or not parts[1].startswith(f"{AGENT_TOKEN_PREFIX}_"):
            return None
        digest = hash_token(parts[1])
        now = time.monotonic()
        known = self._known.get(digest)
        if known is not None and known[1] > now:
            return known[0]
        unknown_until = self._unknown.get(digest)
        if unknown_until is not None and unknown_until > now:
            return None
        try:
            row = await instance_by_token.row(digest)
        except Exception:  # PostgreSQL away: the request counts as unauthenticated (it fails anyway)
            return None
        if row is None:
            self._remember(self._unknown, digest, now + self.UNKNOWN_FOR, self.MAX_UNKNOWN)
            return None
        machine = str(row[0])
        self._remember(self._known, digest, (machine, now + self.KNOWN_FOR), self.MAX_KNOWN)
        return machine

    @staticmethod
    def _remember(into: OrderedDict[str, Any], key: str, value: Any, most: int) -> None:
        into[key] = value
        into.move_to_end(key)
        while len(into) > most:
            into.popitem(last=False)


MACHINES = Machines()


def _authorization(scope: Scope) -> str:
    for key, value in scope["headers"]:
        if key == b"authorization":
            return str(value.decode("latin-1"))
    return ""


async def _too_many(send: Send) -> None:
    body = orjson.dumps(
        error_payload(
            ErrorCode.TOO_MANY_CONNECTIONS,
            "this machine holds too many connections to the agent server; retry when one has ended",
        )
    )
    await send(
        {
            "type": "http.response.start",
            "status": 429,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(RETRY_AFTER).encode()),
                (b"connection", b"close"),  # the connection it came on goes: it was one too many
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def limited(app: App) -> App:
    """``app`` behind the budgets: a request whose machine holds its whole budget is answered
    429 here. Without the agent server's protocol (the web, tests) it is ``app`` as it was."""

    async def limited_app(scope: Scope, receive: Receive, send: Send) -> None:
        conn = (scope.get("extensions") or {}).get(CONNECTION)
        if isinstance(conn, Connection) and scope["type"] == "http":
            machine = await MACHINES.of(_authorization(scope))
            if machine is not None and not LEDGER.claim(conn, machine):
                await _too_many(send)
                return
        await app(scope, receive, send)

    return limited_app
