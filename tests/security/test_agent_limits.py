"""Boundary: one agent cannot tie up the API for everyone.

Shown on main: one agent token holding 200 long polls stalled the whole API (``/healthz``
timed out, ``GET /jobs/`` took 37.6 s): there was no per-agent limit.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings

from apps.machines.models import MachineInstance
from testkit.builders import enrolled_agent
from tests.conftest import World


@pytest.mark.django_db(transaction=True)
@override_settings(CATACLOUD_AGENT_POLL_TIMEOUT=60)
def test_a_second_long_poll_of_the_same_agent_replaces_the_first(tworld: World) -> None:
    agent, _ = enrolled_agent(tworld.org, tworld.machine_type)
    answers: dict[str, Any] = {}

    def poll(name: str) -> None:
        answers[name] = agent.get("/api/agent/v1/work?wait=60")
        connection.close()

    first = threading.Thread(target=poll, args=("first",))
    first.start()
    first.join(1.0)  # let it settle into its long poll
    second = threading.Thread(target=poll, args=("second",))
    second.start()

    first.join(20)  # far below its 60 s wait: only being replaced ends it
    assert not first.is_alive(), "two long polls of one agent held two API workers"
    assert answers["first"].status_code == 204
    assert second.is_alive(), "the newer poll is the one still waiting"
    # A third replaces the second the same way, so one agent holds at most one worker.
    third = threading.Thread(target=poll, args=("third",))
    third.start()
    second.join(20)
    assert not second.is_alive()
    third.join(0.1)
    assert third.is_alive()
    MachineInstance.objects.all().update(status="terminated")
    from apps.jobs.agent import POLL_KEY, _redis

    _redis().incr(POLL_KEY.format(MachineInstance.objects.get().pk))  # end the last poll
    from apps.jobs.agent import wake

    wake(MachineInstance.objects.get().pk)
    third.join(20)


@pytest.mark.django_db
@override_settings(CATACLOUD_AGENT_RATE="5/min")
def test_each_agent_has_its_own_rate_limit(world: World) -> None:
    from django.core.cache import caches

    caches["local"].clear()  # the throttle counts in the web process's memory
    agent, _ = enrolled_agent(world.org, world.machine_type)
    other, _ = enrolled_agent(world.org, world.machine_type)
    answers = [agent.post("/api/agent/v1/heartbeat", {"running_job": None}, format="json") for _ in range(6)]
    assert [a.status_code for a in answers[:5]] == [200] * 5
    assert answers[5].status_code == 429 and answers[5].json()["code"] == "throttled"
    assert other.post("/api/agent/v1/heartbeat", {"running_job": None}, format="json").status_code == 200
