"""The agent server's lean ASGI route, driven directly (no server, no database): what it does
when the agent goes away in the middle of a long poll."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from apps.control.agent import asgi
from apps.control.agent.views import Answer


def scope() -> dict[str, Any]:
    return {
        "type": "http",
        "method": "GET",
        "path": asgi.PREFIX + "work",
        "query_string": b"wait=20",
        "headers": [],
    }


def test_an_agent_that_leaves_mid_poll_ends_it_quietly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A drain, a termination or a release kills the agent while its poll waits: the poll's
    task was read right after ``cancel()``, before it had finished cancelling
    (``InvalidStateError: Exception is not set`` in ``_work``, a traceback per machine)."""
    ended: list[str] = []

    async def waits(authorization: str, wait: str | None) -> Answer:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # a waiter's clean-up takes a moment (unsubscribe)
            ended.append("cancelled")
            raise
        return Answer(204)

    monkeypatch.setattr(asgi, "work_answer", waits)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with caplog.at_level(logging.ERROR):
        asyncio.run(asyncio.wait_for(asgi._work(scope(), receive, send), 5))
    assert ended == ["cancelled"]  # the poll's waiter was released when the agent left
    assert sent == []  # nobody to answer
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_poll_that_fails_answers_500_and_one_that_ends_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    async def fails(authorization: str, wait: str | None) -> Answer:
        raise RuntimeError("database unreachable")

    async def answers(authorization: str, wait: str | None) -> Answer:
        return Answer(204)

    async def stays() -> dict[str, Any]:
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    for answer, status in ((fails, 500), (answers, 204)):
        monkeypatch.setattr(asgi, "work_answer", answer)
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any], sent: list = sent) -> None:
            sent.append(message)

        asyncio.run(asyncio.wait_for(asgi._work(scope(), stays, send), 5))
        assert sent[0]["status"] == status
