"""The host agent's own bookkeeping of the slots it starts and stops (catacloud/agent/host.py).

A slot it was told to stop was reported as running until its stop returned, so the answer to
that report told it to stop the slot again, and that stop reported it again: a cordoned host's
ended slots stayed in its report (its room never freed) for as long as the race kept winning.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from catacloud.agent.host import HostAgent
from catacloud.protocol import HostAnswer, SlotStart
from testkit.processes import wait_for


class Slots:
    """Stands for the local provider: what exists, and a delete and a create that wait."""

    def __init__(self, *existing: str) -> None:
        self.existing = set(existing)
        self.release = threading.Event()
        self.calls: list[tuple[str, str]] = []

    def list(self, owner_labels: Any) -> list[Any]:
        return [type("M", (), {"provider_id": i})() for i in sorted(self.existing)]

    def delete(self, slot_id: str) -> None:
        self.calls.append(("delete", slot_id))
        self.release.wait(10)
        self.existing.discard(slot_id)

    def create(self, spec: Any) -> None:
        self.calls.append(("create", spec.instance_id))
        self.release.wait(10)
        self.existing.add(spec.instance_id)


@pytest.fixture
def host(tmp_path: Path) -> Iterator[HostAgent]:
    agent = HostAgent(
        client=None,  # type: ignore[arg-type]  # never called here
        url="http://127.0.0.1:1",
        enrolment_token="",
        state_file=str(tmp_path / "host.json"),
        slots_dir=str(tmp_path / "slots"),
    )
    yield agent
    agent._pool.shutdown(wait=True)


def settle(host: HostAgent) -> None:
    """Every start and stop handed to the agent's threads has returned. (A no-op submitted to its
    pool is no such proof: another of its threads runs it while a stop is still returning.)"""
    wait_for(lambda: not host._starting and not host._stopping, 10, "the slots' starts and stops")


def test_a_slot_being_stopped_is_reported_while_it_exists_and_never_after(host: HostAgent) -> None:
    slots = Slots("s1")
    host.provider = slots  # type: ignore[assignment]
    stop = HostAnswer(start=(), stop=("s1",), cordoned=True)

    assert host._follow(stop) is True
    assert host._running() == ["s1"]  # still there while its agent ends
    assert host._follow(stop) is False  # the same order again: left alone (and no tight loop)
    slots.release.set()
    settle(host)
    assert host._running() == []
    assert slots.calls == [("delete", "s1")]


def test_a_stop_of_a_slot_already_gone_does_not_bring_it_back_into_the_report(host: HostAgent) -> None:
    slots = Slots()
    host.provider = slots  # type: ignore[assignment]
    host._follow(HostAnswer(start=(), stop=("gone",), cordoned=True))
    assert host._running() == []  # its delete has not returned yet: it is not reported all the same
    slots.release.set()
    settle(host)
    assert host._running() == []


def test_a_slot_being_started_is_reported_and_started_once(host: HostAgent) -> None:
    slots = Slots()
    host.provider = slots  # type: ignore[assignment]
    order = SlotStart(instance_id="s2", bootstrap_token="cb_" + "x" * 30, cpus=1, memory_mb=512, gpus=0)
    start = HostAnswer(start=(order,), stop=(), cordoned=False)
    assert host._follow(start) is True
    assert host._running() == ["s2"]  # reported meanwhile: the answer does not ask for it again
    assert host._follow(start) is False
    assert host._follow(HostAnswer(start=(), stop=("s2",), cordoned=False)) is False  # after its start
    slots.release.set()
    settle(host)
    assert host._running() == ["s2"] and slots.calls == [("create", "s2")]
    assert host._follow(HostAnswer(start=(), stop=(), cordoned=False)) is True  # nothing to do: no wait
