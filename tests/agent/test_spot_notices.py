"""Azure Spot evictions reach the agent through Scheduled Events (``--imds-kind azure``), read
from the fake Azure metadata service the way a VM reads 169.254.169.254."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from catacloud.agent.imds import ScheduledEventsWatcher, SpotWatcher, spot_watcher
from tests.agent.fake_server import FakeAgentAPI
from tests.agent.harness import AgentProcess
from tests.fakes.azure_arm import FakeAzure


@pytest.fixture(scope="module")
def azure_server() -> Iterator[FakeAzure]:
    with FakeAzure() as fake:
        yield fake


@pytest.fixture()
def azure(azure_server: FakeAzure) -> FakeAzure:
    azure_server.reset()
    azure_server.first_call_delay, azure_server.evict_seconds = 0.0, 0.2
    return azure_server


def watcher(azure: FakeAzure, vm: str, **kwargs: float) -> ScheduledEventsWatcher:
    return ScheduledEventsWatcher(
        f"{azure.imds_url}/{vm}", lambda notice: None, stop=threading.Event(), **kwargs
    )


def test_no_event_is_no_notice_and_a_preempt_of_this_vm_is(azure: FakeAzure) -> None:
    azure.add_vm("cc-spot", priority="Spot")
    look = watcher(azure, "cc-spot")
    assert look.check() is None  # the first look also enables Scheduled Events for the VM

    azure.evict("cc-spot", notice=30)
    notice = look.check()

    assert notice is not None
    event = json.loads(notice)
    assert (event["EventType"], event["EventStatus"], event["Resources"]) == (
        "Preempt",
        "Scheduled",
        ["cc-spot"],
    )
    calls = [(m, p) for m, vm, p, status in azure.imds_requests if status == 200]
    assert calls[0] == ("GET", "/metadata/instance/compute/name")  # who am I, asked once
    assert calls.count(("GET", "/metadata/instance/compute/name")) == 1


def test_events_that_are_not_this_vms_eviction_are_no_notice(azure: FakeAzure) -> None:
    azure.add_vm("cc-spot", priority="Spot")
    look = watcher(azure, "cc-spot")
    look.check()
    azure.add_event("cc-spot", "Freeze")  # a pause of a few seconds: nothing to hand on
    assert look.check() is None
    azure.add_event("cc-spot", "Preempt", resources=["cc-neighbour"])  # its availability set's
    assert look.check() is None


def test_the_watcher_never_approves_the_eviction(azure: FakeAzure) -> None:
    """Approving (a StartRequests POST) lets Azure start the eviction early: the job needs all of
    its 30 seconds for its checkpoint."""
    azure.add_vm("cc-spot", priority="Spot")
    stop = threading.Event()
    notices: list[str] = []
    found = threading.Event()

    def on_notice(notice: str) -> None:
        notices.append(notice)
        found.set()

    ScheduledEventsWatcher(f"{azure.imds_url}/cc-spot", on_notice, stop=stop, interval=0.05).start()
    try:
        deadline = time.monotonic() + 5
        while not any(p == "/metadata/scheduledevents" for _, _, p, _ in azure.imds_requests):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        azure.evict("cc-spot", notice=30)
        assert found.wait(5)
    finally:
        stop.set()
    assert len(notices) == 1 and json.loads(notices[0])["EventType"] == "Preempt"
    assert [r for r in azure.imds_requests if r[0] != "GET"] == []
    assert azure.vm("cc-spot") is not None  # still there: the eviction waits for its NotBefore


def test_the_first_answer_may_take_long_later_ones_may_not(azure: FakeAzure) -> None:
    """Scheduled Events' first answer can take up to two minutes: the first look waits for it."""
    azure.add_vm("cc-spot", priority="Spot")
    azure.first_call_delay = 0.5
    look = watcher(azure, "cc-spot", request_timeout=0.2)
    assert look.check() is None  # waited 0.5 s, longer than request_timeout
    assert look.check() is None  # enabled now: answered at once


def test_the_kind_chooses_the_watcher() -> None:
    stop = threading.Event()
    assert type(spot_watcher("azure", "http://x", print, stop=stop)) is ScheduledEventsWatcher
    assert type(spot_watcher("ec2", "http://x", print, stop=stop)) is SpotWatcher
    with pytest.raises(ValueError, match="gcp"):
        spot_watcher("gcp", "http://x", print, stop=stop)


def test_an_azure_spot_eviction_is_reported_once(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], azure: FakeAzure
) -> None:
    azure.add_vm("cc-spot", priority="Spot")
    agent = start_agent("--imds-url", f"{azure.imds_url}/cc-spot", "--imds-kind", "azure")
    deadline = time.monotonic() + 10
    while not any(p == "/metadata/scheduledevents" for _, _, p, _ in azure.imds_requests):
        assert time.monotonic() < deadline, agent.log()
        time.sleep(0.05)
    time.sleep(1.5)
    assert api.interruptions == [], "no event, no notice"

    event = azure.evict("cc-spot", notice=30)
    api.wait_for(lambda: api.interruptions, timeout=8, what="the interruption report")
    time.sleep(1.5)

    (reported,) = api.interruptions
    assert reported["kind"] == "spot" and json.loads(reported["detail"])["EventId"] == event["EventId"]
    looks = [r for r in azure.imds_requests if r[2] == "/metadata/scheduledevents"]
    assert all(status == 200 for *_, status in looks), "Metadata: true on every look, within the rate limit"
    assert agent.proc.poll() is None, "the agent keeps running until told to terminate"
