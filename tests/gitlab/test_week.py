"""Issue 49's week of a GitLab.com Free project, reduced: jobs arriving at the week's rate (5,000
a week: one every two minutes on average) against the strict fake on a simulated clock
(testkit/ci_sim.py: nothing scaled, the clock jumps; the full week is the ``ci_limits``
benchmark part). In class-runner mode every job gets a runner and GitLab's cap (50 runners in
seven days) never refuses one; in runner-per-job mode the cap holds the 51st job with a pending
reason naming it, and no runner job fails."""

from __future__ import annotations

import pytest

from apps.jobs.models import Job
from apps.machines.models import OrgMachineType
from testkit.ci_sim import gitlab_week
from tests.conftest import World

pytestmark = pytest.mark.timeout(600)


def machines(world: World, n: int) -> None:
    OrgMachineType.objects.filter(pk=world.grant.pk).update(
        max_instances=n, max_concurrent_jobs=n, max_pool_size=n
    )


def test_a_free_projects_week_in_class_runner_mode_gets_every_job_a_runner(tworld: World) -> None:
    """Three hours of the week (90 jobs; the cap is 50): one runner created for the class, each
    machine a runner manager of it, every job succeeds, no cap refusal."""
    machines(tworld, 6)
    sim, figures = gitlab_week(
        tworld.org,
        tworld.machine_type,
        jobs=90,
        days=0.125,
        mode="class",
        cap=50,
        machines=6,
        limit=5 * 3600.0,
    )
    assert figures["finished"] and figures["outcomes"] == {"success": 90}
    assert figures["runners_created"] == 1 and figures["cap_refusals"] == 0
    assert figures["runner_jobs_failed"] == 0
    assert figures["reconcile_gap_max"] <= 120.0
    # each CI job ran on the machine whose runner manager took it
    assert Job.objects.filter(handoff_by="gitlab", gitlab_runner__gitlab_job__isnull=False).count() == 90


def test_in_runner_per_job_mode_the_cap_is_a_pending_reason_never_a_failure(tworld: World) -> None:
    """60 jobs in an hour and a half, a runner each: GitLab refuses the 51st once, the cap is
    learnt and never asked beyond; the other 9 wait in the queue with the cap as their pending
    reason, and none fails."""
    machines(tworld, 6)
    sim, figures = gitlab_week(
        tworld.org,
        tworld.machine_type,
        jobs=60,
        days=1.5 / 24,
        mode="per_job",
        cap=50,
        machines=6,
        limit=2.5 * 3600.0,
    )
    assert figures["outcomes"] == {"success": 50, "pending": 10}
    assert figures["runners_created"] == 50 and figures["cap_refusals"] == 1
    assert figures["runner_jobs_failed"] == 0
    held = Job.objects.filter(handoff_by="gitlab", status="queued").exclude(hold_reason="")
    assert held.count() == 10
    assert all("GitLab's runner cap: 50 runners" in j.pending_reason for j in held)
