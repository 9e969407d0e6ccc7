"""Under the agent server, the hot statements are shared by the requests that arrive together
(apps.control.agent.db.Batched, group commit): a fleet's heartbeats cost a few statements a
moment instead of one each queueing for a pooled connection. Sharing must never mix answers up,
let an ended machine in, or make the others wait behind a row somebody holds. Real PostgreSQL,
the server's own pooled async connections, committed rows."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone

from apps.control.agent import db, views
from apps.jobs.models import Job
from apps.machines.models import MachineInstance
from testkit.builders import job_config, job_row
from tests.concurrency import holder_connection
from tests.conftest import World
from tests.control.agent.test_hot_route import agent

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def pooled() -> Iterator[None]:
    """The agent server's database set-up: pooled async connections and one ORM thread."""
    db.serve_pooled(threads=1, connections=4)
    try:
        yield
    finally:
        executor, db._executor = db._executor, None
        assert executor is not None
        executor.submit(connections.close_all).result()
        executor.shutdown()
        db._pool_opening = None


def serve(main: Callable[[], Awaitable[Any]]) -> Any:
    """``main()`` on an event loop, as the agent server runs its requests; the pool closed after."""

    async def run() -> Any:
        try:
            return await main()
        finally:
            await db.close()

    return asyncio.run(run())


def test_heartbeats_arriving_together_share_one_statement_and_each_get_their_own_answer(
    tworld: World, pooled: None
) -> None:
    agents = [agent(tworld, provider_id=f"p-{i}") for i in range(30)]
    config = job_config(tworld.org, tworld.machine_type, "c", "sleep 60")
    now = timezone.now()
    doomed = {
        i: job_row(config, status="running", instance=agents[i][0], started_at=now, cancel_requested=True)
        for i in (3, 17)
    }
    ended = agents[29][0]
    MachineInstance.objects.filter(pk=ended.pk).update(status="terminated")
    before = {m.pk: m.last_heartbeat_at for m, _ in agents}

    async def heartbeats() -> tuple[list[views.Answer], int]:
        ran = views._HEARTBEATS.statements
        answers = await asyncio.gather(*(views.heartbeat_answer(f"Agent {t}", b"{}") for _, t in agents))
        return answers, views._HEARTBEATS.statements - ran

    answers, statements = serve(heartbeats)

    # one statement for the 30; the ended machine's row was not in it, so it is asked alone
    assert statements == 2
    for i, answer in enumerate(answers[:29]):
        cancel = [str(doomed[i].pk)] if i in doomed else []
        assert (answer.status, answer.body) == (200, {"cancel": cancel, "terminate": False}), i
    assert answers[29].status == 401 and answers[29].body["code"] == "authentication_failed"
    after = {m.pk: m.last_heartbeat_at for m in MachineInstance.objects.filter(pk__in=before)}
    assert all(after[m.pk] > before[m.pk] for m, _ in agents[:29])
    assert after[ended.pk] == before[ended.pk]


def test_a_heartbeat_whose_row_another_transaction_holds_waits_without_holding_up_the_others(
    tworld: World, pooled: None
) -> None:
    agents = [agent(tworld, provider_id=f"p-{i}") for i in range(3)]
    held = agents[0][0]
    holder = holder_connection()
    # a service changing the machine (its transaction still open)
    holder.execute(f"UPDATE {MachineInstance._meta.db_table} SET status = status WHERE id = %s", [held.pk])

    async def heartbeats() -> tuple[bool, list[views.Answer]]:
        tasks = [asyncio.create_task(views.heartbeat_answer(f"Agent {t}", b"{}")) for _, t in agents]
        _, pending = await asyncio.wait(tasks[1:], timeout=15)
        assert not pending, "the other heartbeats waited behind the held row"
        await asyncio.sleep(0.3)
        waited = not tasks[0].done()
        holder.commit()
        await asyncio.wait_for(tasks[0], 15)
        return waited, [t.result() for t in tasks]

    try:
        waited, answers = serve(heartbeats)
    finally:
        holder.close()
    assert waited, "the held machine's heartbeat answered before the row was free"
    assert [a.status for a in answers] == [200, 200, 200]
    before = held.last_heartbeat_at
    held.refresh_from_db()
    assert held.last_heartbeat_at > before  # recorded once the row was free


def test_polls_arriving_together_share_their_token_look_up_and_each_get_their_own_job(
    tworld: World, pooled: None
) -> None:
    agents = [agent(tworld, provider_id=f"p-{i}") for i in range(12)]
    config = job_config(tworld.org, tworld.machine_type, "c", "echo hi")
    jobs = [job_row(config, status="assigned", instance=m, assigned_at=timezone.now()) for m, _ in agents]
    idle, idle_token = agent(tworld, provider_id="p-idle")  # nothing assigned to it

    async def polls() -> tuple[list[views.Answer], int]:
        ran = views.instance_by_token.statements
        answers = await asyncio.gather(
            *(views.work_answer(f"Agent {t}", "0") for _, t in [*agents, (idle, idle_token)])
        )
        return answers, views.instance_by_token.statements - ran

    answers, statements = serve(polls)

    assert statements == 1
    assert [a.body["job"]["id"] for a in answers[:12]] == [str(j.pk) for j in jobs]
    assert answers[12].status == 204
    assert Job.objects.filter(pk__in=[j.pk for j in jobs], delivered_at__isnull=False).count() == 12
