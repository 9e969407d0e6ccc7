"""Issue 49's GitHub burst, reduced: many repositories' jobs at once against the strict fake on
a simulated clock (testkit/ci_sim.py: nothing scaled, the clock jumps; the full size is the
``ci_limits`` benchmark part). Registrations are paced below GitHub's documented limits, the
runner jobs held meanwhile are released as the windows turn, every job succeeds, and when
GitHub answers a secondary limit anyway nothing calls that endpoint again before the wait."""

from __future__ import annotations

import pytest

from apps.events.models import Event
from apps.jobs.models import Job
from apps.machines.models import OrgMachineType
from testkit.ci_sim import github_burst
from tests.conftest import World

pytestmark = pytest.mark.timeout(600)


def machines(world: World, n: int) -> None:
    OrgMachineType.objects.filter(pk=world.grant.pk).update(
        max_instances=n, max_concurrent_jobs=n, max_pool_size=n
    )


def test_a_burst_is_paced_below_githubs_limits_and_every_job_succeeds(tworld: World) -> None:
    """100 jobs over 20 repositories on 100 machines: all want a runner at once, GitHub allows 80
    registrations a minute; ours pace at 72, hold the rest with the limit as their pending reason
    and release them as the minute turns."""
    machines(tworld, 100)
    sim, figures = github_burst(
        tworld.org, tworld.machine_type, jobs=100, repositories=20, machines=100, duration=60.0, limit=3600.0
    )
    assert figures["finished"] and figures["outcomes"] == {"success": 100}
    assert figures["limit_answers"] == 0 and figures["limit_violations"] == 0  # GitHub never refused
    paced = Event.objects.filter(kind="github.rate_limited", data__paced=True)
    assert any("content-creation limit (80 a minute" in e.reason for e in paced)
    assert figures["simulated_seconds"] >= 60  # two minutes' windows: 72, then 28
    assert figures["calls_per_job"] <= 1.2, figures["calls_by_endpoint"]
    assert figures["reconcile_gap_max"] <= 120.0  # the reconciler ticked throughout
    assert not Job.objects.filter(handoff_by="github", status="failed").exists()


def test_githubs_secondary_limits_are_waited_out_and_never_called_early(tworld: World) -> None:
    """The fake's content-creation limits tighter than our pacing (10 a minute, 30 an hour):
    GitHub answers secondary limits in turn with retry-after, as a bare 403 and a bare 429; each
    holds the registrations at least the documented minute (longer when repeated), nothing calls
    the endpoint sooner, and every job still succeeds."""
    machines(tworld, 20)

    def tighter(fake: object) -> None:
        fake.limits.update(creations_per_minute=10, creations_per_hour=30)  # type: ignore[attr-defined]

    sim, figures = github_burst(
        tworld.org,
        tworld.machine_type,
        jobs=40,
        repositories=8,
        machines=20,
        duration=60.0,
        limit=4 * 3600.0,
        prepare=tighter,
    )
    assert figures["finished"] and figures["outcomes"] == {"success": 40}
    assert figures["limit_answers"] >= 3 and figures["limit_violations"] == 0
    styles = {style for _, _, _, style in sim.fake.limit_answers}
    assert styles == {"retry_after", "bare_403", "bare_429"}
    assert not Job.objects.filter(handoff_by="github", status="failed").exists()
    assert figures["reconcile_gap_max"] <= 120.0
