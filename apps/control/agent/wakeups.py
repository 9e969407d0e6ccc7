"""Wake-ups for long-polling agents over Redis pub/sub (``redis.asyncio``), without a thread,
a database connection or a Redis connection per waiting agent.

The publisher is :func:`apps.jobs.dispatch.wake_agent` (after the assignment commits): ``PUBLISH
catacloud:wake:<instance>``. A :class:`Wakeups` listener holds one Redis connection subscribed
to ``catacloud:wake:*`` and sets the in-process events of the polls waiting for that instance.

Served by the agent server (ASGI, one event loop for the process), one listener serves every
poll of the process (:func:`shared`). Anywhere else (an async view run by a WSGI thread or the
test client, each request on an event loop of its own) a poll opens a private listener for its
own instance and closes it when it answers: the thread-held behaviour, kept for agents that
still talk to the WSGI web.

A wake-up is a hint, never state: a lost one (Redis down, a listener reconnecting) is recovered
by the poll's own re-check of PostgreSQL (every few seconds while the listener is down, and at
its timeout otherwise); a listener that reconnects wakes every poll it serves once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from django.conf import settings

from apps.jobs.dispatch import WAKE_KEY

log = logging.getLogger(__name__)
PATTERN = WAKE_KEY.format("*")
PREFIX = WAKE_KEY.format("")
# While the listener is not subscribed, waiting polls look at PostgreSQL this often.
RECHECK_WHILE_DOWN = 2.0
# Connections for commands (a poll's take-over, a woken poll's generation check) per listener.
REDIS_CONNECTIONS = 32


class Waiter:
    """One poll's wake-up: ``await wait(timeout)`` is True when woken, False on timeout."""

    def __init__(self, listener: Wakeups, key: str) -> None:
        self.listener = listener
        self.key = key
        self.event = asyncio.Event()
        self.messages: list[str] = []

    def deliver(self, message: str) -> None:
        self.messages.append(message)
        self.event.set()

    async def wait(self, timeout: float) -> list[str]:
        """The messages that woke this poll (``[]`` on timeout; ``""`` means "look again")."""
        if not self.listener.subscribed.is_set():
            timeout = min(timeout, RECHECK_WHILE_DOWN)
        if not self.event.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):  # no task of its own, unlike wait_for
                    await self.event.wait()
        messages, self.messages = self.messages, []
        self.event.clear()
        return messages


class Wakeups:
    """One Redis pub/sub connection dispatching wake-ups to the polls of this event loop."""

    def __init__(self, url: str, pattern: str = PATTERN) -> None:
        self.url = url
        self.pattern = pattern
        self.subscribed = asyncio.Event()
        self._waiters: dict[str, set[Waiter]] = {}
        self._task: asyncio.Task | None = None
        self._client: aioredis.Redis | None = None

    def redis(self) -> aioredis.Redis:
        """A client for commands (the pub/sub connection cannot send them)."""
        if self._client is None:
            # A burst of polls queues for a connection (at most REDIS_CONNECTIONS) instead of
            # failing with "Too many connections".
            pool = aioredis.BlockingConnectionPool.from_url(
                self.url,
                max_connections=REDIS_CONNECTIONS,
                timeout=5,
                socket_connect_timeout=2,
                socket_timeout=5,
                health_check_interval=30,
            )
            self._client = aioredis.Redis(connection_pool=pool)
        return self._client

    # -- life ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="agent-wakeups")

    async def ready(self, timeout: float) -> bool:
        """Wait until subscribed (a poll then checks PostgreSQL knowing no wake-up is missed)."""
        self.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.subscribed.wait(), timeout)
        return self.subscribed.is_set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        self.subscribed.clear()
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose(close_connection_pool=True)
            self._client = None

    async def _run(self) -> None:
        backoff = 0.2
        while True:
            client = aioredis.Redis.from_url(self.url, socket_connect_timeout=2, health_check_interval=30)
            pubsub = client.pubsub(ignore_subscribe_messages=False)
            try:
                await pubsub.psubscribe(self.pattern)
                async for message in pubsub.listen():
                    kind = message.get("type")
                    if kind == "psubscribe":
                        self.subscribed.set()
                        backoff = 0.2
                        self._wake_all()  # wake-ups sent while we were away are lost: look again
                    elif kind == "pmessage":
                        channel, data = message["channel"], message["data"]
                        if isinstance(channel, bytes):
                            channel = channel.decode()
                        if isinstance(data, bytes):
                            data = data.decode(errors="replace")
                        self._wake(channel[len(PREFIX) :], str(data))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down or restarted: polls fall back to re-checking
                self.subscribed.clear()
                log.warning("agent wake-up listener lost Redis (%s); reconnecting in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                self.subscribed.clear()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                with contextlib.suppress(Exception):
                    await client.aclose()

    # -- waiting -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def waiter(self, key: str) -> AsyncIterator[Waiter]:
        waiter = Waiter(self, key)
        self._waiters.setdefault(key, set()).add(waiter)
        try:
            yield waiter
        finally:
            waiters = self._waiters.get(key)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[key]

    def _wake(self, key: str, message: str) -> None:
        for waiter in self._waiters.get(key, ()):
            waiter.deliver(message)

    def _wake_all(self) -> None:
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.deliver("")

    @property
    def waiting(self) -> int:
        return sum(len(w) for w in self._waiters.values())


_shared: Wakeups | None = None


def serve_shared() -> None:
    """Called by the agent server at start-up: one listener for every poll of the process."""
    global _shared
    _shared = Wakeups(settings.CELERY_BROKER_URL)


def shared() -> Wakeups | None:
    return _shared


@contextlib.asynccontextmanager
async def waiter_for(instance_id: object) -> AsyncIterator[Waiter]:
    """A subscribed waiter for ``instance_id``'s wake-ups: the shared listener under the agent
    server, else a private one for this poll (closed when it answers)."""
    key = str(instance_id)
    if _shared is not None:
        _shared.start()
        async with _shared.waiter(key) as waiter:
            yield waiter
        return
    private = Wakeups(settings.CELERY_BROKER_URL, pattern=WAKE_KEY.format(key))
    try:
        async with private.waiter(key) as waiter:
            await private.ready(timeout=2.0)
            yield waiter
    finally:
        await private.close()
