"""The agent server's hot route: ``POST heartbeat``, ``GET work`` and a job's ``POST
jobs/<id>/started`` answered straight from the ASGI scope (:mod:`apps.control.agent.views`'
coroutines), every other request by Django.

Django's handler costs more than the heartbeat's statement (a request object, the URL
resolver, the middleware chain, a response object, a task watching for a disconnect); for the
two requests every agent makes all day, and the start a job's first instruction waits for, this
route reads the one header and the small body it needs and writes the JSON answer itself. The
answers are the same as the Django views' (same codes, same error bodies); anything else
(another method, another path) goes to Django.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import orjson

from apps.control.agent.views import Answer, error_answer, heartbeat_answer, started_answer, work_answer
from apps.core import tracing
from apps.core.errors import ErrorCode
from apps.core.middleware import body_limit_detail

log = logging.getLogger(__name__)
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

PREFIX = "/api/agent/v1/"
# A heartbeat's body is a few dozen bytes; anything near this is not an agent's.
MAX_BODY = 64 * 1024


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return ""


async def _body(receive: Receive) -> bytes | None:
    """The request body, or None when it is larger than MAX_BODY (or the client left)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send(send: Send, answer: Answer) -> None:
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items()]
    body = b""
    if answer.body is not None:
        body = orjson.dumps(answer.body)
        headers.append((b"content-type", b"application/json"))
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _failed(exc: BaseException) -> Answer:
    """PostgreSQL unreachable or a bug: a JSON 500 like Django's (the agent retries)."""
    log.error("agent API request failed", exc_info=exc)
    return error_answer(500, ErrorCode.SERVER_ERROR, "internal error")


async def _posted(
    scope: Scope, receive: Receive, send: Send, answer_for: Callable[[str, bytes], Awaitable[Answer]]
) -> int:
    """A POST answered by ``answer_for(authorization, body)``: 413 for a body over MAX_BODY, 500
    when it fails. Returns the status sent."""
    body = await _body(receive)
    if body is None:
        answer = error_answer(413, ErrorCode.PAYLOAD_TOO_LARGE, body_limit_detail(MAX_BODY))
    else:
        try:
            answer = await answer_for(_header(scope, b"authorization"), body)
        except Exception as exc:
            answer = _failed(exc)
    await _send(send, answer)
    return answer.status


async def _heartbeat(scope: Scope, receive: Receive, send: Send) -> None:
    await _posted(scope, receive, send, heartbeat_answer)


async def _work(scope: Scope, receive: Receive, send: Send) -> None:
    """The long poll, ended early when the agent goes away (its waiter is released then, not at
    the poll's timeout). It runs in the request's own task; a watcher beside it cancels that task
    when the agent disconnects (two tasks per waiting poll, not three)."""
    wait = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("wait", [None])[-1]
    request = asyncio.current_task()
    assert request is not None
    answering, left = True, False

    async def gone() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        left = True
        if answering:
            request.cancel()

    watching = asyncio.ensure_future(gone())
    # a receive() that failed ends the watcher only: its error is read here, not logged at exit
    watching.add_done_callback(lambda task: task.cancelled() or task.exception())
    try:
        answer = await work_answer(_header(scope, b"authorization"), wait)
    except asyncio.CancelledError:
        if not left:
            raise  # the server is stopping
        request.uncancel()
        return  # the agent went away (a drain, a termination): nobody to answer
    except Exception as exc:
        answer = _failed(exc)
    finally:
        answering = False
        watching.cancel()
    await _send(send, answer)


async def _started(scope: Scope, receive: Receive, send: Send, job_id: uuid.UUID) -> None:
    # In the job's trace as the agent sent it (its header), named as Django's route was: the
    # report is a span of the job's trace like the agent's other reports.
    with tracing.span(STARTED_ROUTE, traceparent=_header(scope, b"traceparent")) as span:
        status = await _posted(
            scope, receive, send, lambda authorization, body: started_answer(authorization, job_id, body)
        )
        if span is not None:
            span.set_attribute("http.response.status_code", status)


# A job's own hot path: the same UUID shape as the Django route's (apps.control.agent.urls).
STARTED_ROUTE = "POST api/agent/v1/jobs/<uuid:job_id>/started"
STARTED = re.compile(PREFIX + r"jobs/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/started")

HOT: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {
    ("POST", PREFIX + "heartbeat"): _heartbeat,
    ("GET", PREFIX + "work"): _work,
}


def hot_route(django: App) -> App:
    """The agent server's application: the hot endpoints here, the rest to ``django``."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler = HOT.get((scope["method"], scope["path"]))
            if handler is not None:
                await handler(scope, receive, send)
                return
            started = STARTED.fullmatch(scope["path"]) if scope["method"] == "POST" else None
            if started is not None:
                await _started(scope, receive, send, uuid.UUID(started.group(1)))
                return
        await django(scope, receive, send)

    return app
