"""What the GitHub and GitLab tests share: a ready machine's agent for dispatch (tests/github,
tests/gitlab); the sixty-job proof's set-up, faults and checks (tests/e2e/test_github_actions.py,
tests/e2e/test_gitlab_ci.py).

A forge's runner jobs are found through the relation the forge's runner table gives the job
(``relation``: GitHub's ``runner``, GitLab's ``gitlab_runner``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.e2e.conftest import Stack

# The sixty-job proof's runner classes give up quickly on a runner that never comes online or
# stays idle: the faults leave such runners behind.
QUICK_TIMEOUTS = {"online_timeout_seconds": 20, "idle_timeout_seconds": 60}


def ready_agent(forge_world: Any) -> tuple[Any, Any]:
    """An idle machine of the class's type (``forge_world.world``'s) whose agent enrolled and
    beat once (ready): (its agent's client, the machine)."""
    from testkit.builders import enrolled_agent

    world = forge_world.world
    client, instance = enrolled_agent(world.org, world.machine_type)
    assert client.post("/api/agent/v1/heartbeat", {"running_job": None}, format="json").status_code == 200
    instance.refresh_from_db()
    assert instance.status == "ready"
    return client, instance


def tasks_sent(monkeypatch: Any, *modules: Any) -> list[tuple[str, tuple[Any, ...]]]:
    """What these modules send to the workers (their ``enqueue``): recorded, not sent, so a test
    can run a task itself and see what it leaves to other tasks."""
    sent: list[tuple[str, tuple[Any, ...]]] = []

    def enqueue(task: Any, *args: Any, **_: Any) -> bool:
        sent.append((str(task), args))
        return True

    for module in modules:
        monkeypatch.setattr(module, "enqueue", enqueue)
    return sent


def poll(agent: Any) -> Any:
    """The agent asks for work, without waiting."""
    return agent.get("/api/agent/v1/work?wait=0")


def three_classes(
    world: Any,
    fake_url: str,
    *,
    save: Callable[..., tuple[Any, bool]],
    first: Any,
    labels_field: str,
    more: dict[str, list[str]],
    **fields: Any,
) -> None:
    """The sixty-job proof's runner classes: the ``first`` one, on the world's machine type (8
    machines, 8 jobs at once), and one for each of ``more`` (name -> labels; GitLab: tags), each
    on a machine type and a pool (2, at most 8) of its own whose jobs reach the fake at
    ``fake_url``; all with :data:`QUICK_TIMEOUTS`."""
    from apps.machines.models import OrgMachineType
    from apps.pools.services import pool_create, pool_refill
    from testkit.builders import granted_type
    from testkit.forge_common import allow_loopback

    OrgMachineType.objects.filter(pk=world.grant.pk).update(max_instances=8, max_concurrent_jobs=8)
    for name, labels in more.items():
        mt, _ = granted_type(
            world.org,
            world.account,
            f"ci-{name}",
            grant={"max_instances": 8, "max_concurrent_jobs": 8, "max_pool_size": 8},
        )
        allow_loopback(mt, fake_url)  # its runners reach the fake, as connect() lets the first
        pool = pool_create(org=world.org, name=f"ci-{name}", machine_type=mt, target_size=2, max_size=8)
        pool_refill(pool_id=pool.pk)
        save(
            org=world.org,
            name=name,
            **{labels_field: labels},
            machine_type=mt,
            pool=pool,
            **fields,
            **QUICK_TIMEOUTS,
        )
    save(org=world.org, runner_class=first, **QUICK_TIMEOUTS)


def kill_an_agent_running_a_runner(stack: Stack, relation: str) -> str | None:
    """SIGKILL the agent (and its runner) of one machine running a runner job: a machine lost."""
    import psutil

    from apps.machines.models import MachineInstance
    from testkit.processes import agent_tree, local_machines

    busy = {
        str(pk)
        for pk in MachineInstance.objects.filter(
            status="claimed", **{f"jobs__{relation}__isnull": False}, jobs__status="running"
        )
        .values_list("pk", flat=True)
        .distinct()
    }
    for record in local_machines(stack.world.account.config["state_dir"]):
        if record.get("instance_id") in busy:
            for proc in agent_tree(record):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            return str(record["instance_id"])
    return None


def sixty_jobs_with_faults(
    stack: Stack, fake: Any, queue: Callable[[int, str], int], relation: str
) -> list[int]:
    """Queue sixty jobs over the classes ``a``, ``b``, ``c`` (``queue(i, class name)`` -> the
    forge's job id), with a second worker running: the forge rate-limits for 3 s after the
    11th, three jobs are cancelled after the 21st; then an agent running a runner is killed,
    and the second worker. Returns the jobs' ids."""
    from testkit.processes import TESTS

    ids: list[int] = []
    with TESTS.celery_worker(stack.tmp, concurrency=2, **{"CATACLOUD_PUBLIC_URL": stack.url}) as extra:
        for i in range(60):
            ids.append(queue(i, "abc"[i % 3]))
            if i == 10:
                fake.rate_limit_for(3)
            if i == 20:
                for victim in ids[-3:]:
                    fake.cancel_job(victim)
            time.sleep(0.15)
        stack.wait(
            lambda: kill_an_agent_running_a_runner(stack, relation) is not None,
            60,
            "an agent running a runner",
        )
        extra.kill()
    return ids


def wait_every_job(stack: Stack, fake: Any, finished: Callable[[], bool], what: str) -> None:
    """Wait (400 s at most) for ``finished``, printing the forge's job counts now and then."""

    def done() -> bool:
        if int(time.monotonic()) % 15 == 0:
            print(time.strftime("%H:%M:%S"), fake.summary()["jobs"], flush=True)
        return finished()

    stack.wait(done, 400, what)


def machines_over_quota(world: Any) -> list[str]:
    """The world's org's machine types with more machines counted than its grant allows."""
    from apps.machines.choices import INSTANCE_COUNTED
    from apps.machines.models import MachineInstance, OrgMachineType

    over = []
    for grant in OrgMachineType.objects.filter(org=world.org):
        live = MachineInstance.objects.filter(
            org=world.org, machine_type_id=grant.machine_type_id, status__in=INSTANCE_COUNTED
        ).count()
        if live > grant.max_instances:
            over.append(f"{live} machines of {grant.machine_type_id} over {grant.max_instances}")
    return over


def nothing_held(relation: str) -> bool:
    """No runner job is live, and no machine is held for one."""
    from apps.jobs.choices import JOB_LIVE
    from apps.jobs.models import Job
    from apps.machines.models import MachineInstance

    return (
        not Job.objects.filter(**{f"{relation}__isnull": False}, status__in=JOB_LIVE).exists()
        and not MachineInstance.objects.filter(
            status="claimed", **{f"jobs__{relation}__isnull": False}, jobs__status__in=JOB_LIVE
        ).exists()
    )


def leftovers(fake: Any, title: str, relation: str) -> str:
    """What is left when :func:`nothing_held` times out: the runners at the forge, the live
    runner jobs here."""
    from apps.jobs.choices import JOB_LIVE
    from apps.jobs.models import Job

    jobs = list(
        Job.objects.filter(**{f"{relation}__isnull": False}, status__in=JOB_LIVE).values_list(
            "status", "pending_reason", "hold_reason", "handed_off_to", "instance__status", "attempt"
        )
    )
    return f"runners at {title}: {fake.summary()['runners']}; live runner jobs: {jobs}"


def budget_held(budget: Any) -> bool:
    """The budget's spend so far is within its amount."""
    from django.utils import timezone

    from apps.machines.budgets import budget_spends

    return bool(budget_spends([budget], now=timezone.now())[budget.pk] <= budget.amount)
