"""Part `ci`: CI on Catacloud, GitHub Actions and GitLab CI in the same run, each against its fake
(testkit/github_fake.py, testkit/gitlab_fake.py) and its stand-in runner.

The live stack (gunicorn, the agent server, a worker and beat, local machines) receives the
fakes' deliveries (GitHub's signed ``workflow_job``, GitLab's Job events); the stand-in runners
run on the machines. Each forge gets its own tenant and pool, one after the other. Per forge:

- **latency** on a warm pool, one job at a time (after one job not counted, which warms each
  process's path): the demand delivery received (the web's stored row: GitHub's ``queued``,
  GitLab's ``pending``) -> the runner credential handed to the agent (``job.handed_off``:
  GitHub's just-in-time configuration, GitLab's ``glrt-`` token) and -> the agent running it
  (``job.started``); delivery sent -> the stand-in runner online at the fake; every delivery's
  acknowledgement (the fake's round trip); forge calls per job (every call the fake answered
  while the samples ran, the reconciler's included, at the default interval).
- **burst**: ``burst`` jobs queued at once against a pool of ``pool_size`` machines (the grant
  allows no more): throughput, the longest wait for a runner (queued -> started at the forge),
  and what the machines cost with billing-aware reuse against one machine per job.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from apps.core.actors import Actor
from benchmarks.harness import Figure, PartResult, Progress, percentile, say, tenant
from benchmarks.stack import Stack, live_stack, wait_quiet
from testkit.processes import wait_for

LABELS = ["self-hosted", "catacloud-linux-2cpu"]
TAGS = ["catacloud", "linux-2cpu"]
PROJECT = (21, "bench/app")


@dataclass
class ForgeJob:
    """A forge job as the bench reads it off the fake (times are the fake's ``time.time()``)."""

    done: bool
    created: float
    started: float | None
    finished: float | None
    runner_id: int | None
    outcome: str


@dataclass
class ForgeBench:
    """What differs between the forges, for the bench."""

    name: str  # the part's prefix: "github", "gitlab"
    title: str
    fake: Any
    queue: Callable[[str], int]  # a job named so -> its forge id
    job: Callable[[int], ForgeJob]
    demand_event: str  # the delivery that makes demand (its received_at starts the clock)
    events: tuple[str, ...]  # every delivery a job's life sends (each one acknowledged)
    received_at: Callable[[Any], Any]  # the fake's delivery -> our stored row's received_at
    core: Any  # the CI core's Forge (apps.ci.forge): its runner records
    id_field: str  # the forge job's id on its record: github_id, gitlab_id
    registered: Callable[[], int]  # runners registered at the fake now

    def runner_job(self, job_id: int) -> tuple[Any, Any]:
        """The forge job's runner here: (runner pk, Catacloud job id)."""
        rows = self.core.runner.objects.values_list("pk", "job_id")
        return tuple(rows.get(**{f"created_for__{self.id_field}": job_id}))

    def runner_started(self, runner_pk: Any) -> Any:
        rows = self.core.runner.objects.filter(pk=runner_pk)
        return rows.values_list("job__started_at", flat=True).first()


def _github(stack: Stack, pool_size: int) -> tuple[ForgeBench, Any]:
    from apps.github.forge import GITHUB
    from apps.github.models import WebhookDelivery
    from testkit.github_fake import FakeGitHub, app_keypair
    from testkit.github_kit import WEBHOOK_PATH, connect, expose_runner

    private, public = app_keypair()
    fake = FakeGitHub(
        app_id=1,
        public_key=public,
        webhook_secret="bench-webhook-secret",
        webhook_url=stack.url + WEBHOOK_PATH,
    ).start()
    fake.add_installation(1, "bench", [PROJECT[1]])
    t, pool = _tenant(stack, "ci-github", pool_size, expose_runner)
    connect(
        t.org,
        fake,
        private,
        installation_id=1,
        account="bench",
        classes=[{"name": "small", "labels": LABELS, "machine_type": t.machine_type, "pool": pool}],
    )

    def job(i: int) -> ForgeJob:
        j = fake.job(i)
        done = j.status == "completed"
        return ForgeJob(done, j.created_at, j.started_at, j.completed_at, j.runner_id, j.conclusion or "")

    bench = ForgeBench(
        name="github",
        title="GitHub",
        fake=fake,
        queue=lambda name: fake.queue_job(PROJECT[1], LABELS, ["true"], name=name),
        job=job,
        demand_event="queued",
        events=("queued", "in_progress", "completed"),
        received_at=lambda d: WebhookDelivery.objects.get(guid=d.guid).received_at,
        core=GITHUB,
        id_field="github_id",
        registered=lambda: len(fake.summary()["runners"]),
    )
    return bench, (t, pool)


def _gitlab(stack: Stack, pool_size: int) -> tuple[ForgeBench, Any]:
    from apps.gitlab.forge import GITLAB
    from apps.gitlab.models import GitLabDelivery
    from testkit.gitlab_fake import DONE, FakeGitLab
    from testkit.gitlab_kit import WEBHOOK_PATH, connect, expose_runner

    fake = FakeGitLab(
        token="glpat-bench-token", webhook_token="bench-webhook-token", webhook_url=stack.url + WEBHOOK_PATH
    ).start()
    fake.add_project(*PROJECT)
    t, pool = _tenant(stack, "ci-gitlab", pool_size, expose_runner)
    connect(
        t.org,
        fake,
        projects=[PROJECT],
        classes=[{"name": "small", "tags": TAGS, "machine_type": t.machine_type, "pool": pool}],
    )

    def job(i: int) -> ForgeJob:
        j = fake.job(i)
        return ForgeJob(j.status in DONE, j.created_at, j.started_at, j.finished_at, j.runner_id, j.status)

    bench = ForgeBench(
        name="gitlab",
        title="GitLab",
        fake=fake,
        queue=lambda name: fake.queue_job(PROJECT[1], TAGS, ["true"], name=name),
        job=job,
        demand_event="pending",
        events=("created", "pending", "running", "success"),
        received_at=lambda d: GitLabDelivery.objects.get(key=d.key).received_at,
        core=GITLAB,
        id_field="gitlab_id",
        registered=lambda: len(fake.runners),
    )
    return bench, (t, pool)


def _tenant(stack: Stack, name: str, pool_size: int, expose_runner: Callable[[Any], None]) -> tuple[Any, Any]:
    from apps.pools.services import pool_create

    t = tenant(
        name,
        kind="local",
        state_dir=stack.state_dir,
        max_instances=pool_size,
        max_pool_size=pool_size,
        max_concurrent_jobs=pool_size,
    )
    expose_runner(t.machine_type.provider_account)  # before the pool's first machine starts
    pool = pool_create(org=t.org, name="ci", machine_type=t.machine_type, target_size=2, max_size=pool_size)
    return t, pool


def _ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 1)


def _latency(forge: ForgeBench, t: Any, samples: int, progress: Progress) -> dict[str, Any]:
    from apps.events.models import Event

    fake = forge.fake
    handoff, started, online, ack = [], [], [], []
    stages: dict[str, list[float]] = {}
    # One job first, not counted: each process's first pass through this path (a gunicorn
    # thread's database connection, a worker's first forge call and its installation token)
    # is a deployment's first minute, not its steady state.
    wait_for(lambda: _ready(t) >= 1, 90, "a ready machine", 0.05)
    warm = forge.queue("warm-up")
    wait_for(lambda: forge.job(warm).done, 60, f"the {forge.title} warm-up job to finish", 0.02)
    wait_for(lambda: not forge.registered(), 30, "the warm-up's runner to be deleted", 0.02)  # not counted
    calls_before = fake.api_calls()
    with fake.lock:
        first = len(fake.calls)
    for i in range(samples):
        wait_for(lambda: _ready(t) >= 1, 90, "a ready machine", 0.05)
        progress(f"ci: {forge.name} latency sample {i + 1}/{samples}")
        job_id = forge.queue(f"latency-{i}")
        wait_for(lambda j=job_id: forge.job(j).done, 60, f"the {forge.title} job to finish", 0.02)
        sent = fake.delivery_for(job_id, forge.demand_event)
        assert sent is not None
        received = forge.received_at(sent)
        runner_pk, runner_job = forge.runner_job(job_id)
        handed = Event.objects.filter(kind="job.handed_off", job_id=runner_job).values_list(
            "created_at", flat=True
        )
        handoff.append((handed[0] - received).total_seconds())
        at = dict(
            Event.objects.filter(job_id=runner_job, kind__in=[k for k, _ in STAGES])
            .order_by("-created_at")
            .values_list("kind", "created_at")
        )  # each stage's first event (the latest overwritten by earlier ones)
        before = received
        for kind, _ in STAGES:
            if kind in at:
                stages.setdefault(kind, []).append((at[kind] - before).total_seconds())
                before = at[kind]
        start = wait_for(lambda r=runner_pk: forge.runner_started(r), 30, "the runner job's start", 0.02)
        started.append((start - received).total_seconds())
        online.append(fake.runner_online_at[forge.job(job_id).runner_id or 0] - sent.delivered_at)
        sent_all = wait_for(
            lambda j=job_id: (
                (ds := [fake.delivery_for(j, a) for a in forge.events])
                and all(d is not None and d.status_code for d in ds)
                and ds
            ),
            30,
            "the job's deliveries to be acknowledged",
            0.02,
        )
        ack += [d.duration for d in sent_all]
    calls = fake.api_calls() - calls_before
    with fake.lock:
        routes = Counter(f"{m} {_route(r)}" for m, r, _ in fake.calls[first:])
    return {
        "calls_by_route": dict(routes.most_common()),
        "handoff_s": handoff,
        "stages_s": stages,
        "started_s": started,
        "online_s": online,
        "ack_s": ack,
        "calls": calls,
        "samples": samples,
    }


# The hand-off's stages, each timed from the one before (the first from the delivery's receipt):
# the runner job created by the class's convergence, admitted, given a machine, its runner
# registered at the forge and the credential handed to the agent.
STAGES = (
    ("job.queued", "runner job created"),
    ("job.admitted", "admitted"),
    ("job.assigned", "machine assigned"),
    ("job.handed_off", "registered and handed off"),
)


def _route(route: str) -> str:
    """A recorded route with its ids as placeholders, so the calls add up per endpoint."""
    from testkit.ci_sim import normalised

    return re.sub(r"/\d+(?=/|$)", "/{id}", normalised(route.split("?")[0]))


def _ready(t: Any) -> int:
    """Ready machines of the tenant, in its pool or kept for reuse (a runner's machine leaves the
    pool after its job and serves the next one while its hour is paid), nothing still booting."""
    from apps.machines.models import MachineInstance

    statuses = list(MachineInstance.objects.filter(org=t.org).values_list("status", flat=True))
    booting = sum(
        1 for s in statuses if s in ("pending", "provisioning", "warming", "terminating", "claimed")
    )
    return 0 if booting else statuses.count("ready")


def _burst(forge: ForgeBench, t: Any, n: int, progress: Progress) -> dict[str, Any]:
    from django.utils import timezone

    from apps.machines.costs import machine_costs
    from apps.machines.models import MachineInstance

    progress(f"ci: {forge.name} burst of {n} jobs")
    t0 = time.time()
    ids = [forge.queue(f"burst-{i}") for i in range(n)]

    def done() -> bool:
        finished = sum(1 for i in ids if forge.job(i).done)
        if int(time.time() - t0) % 20 == 0:
            progress(f"ci: {forge.name} burst {finished}/{n} finished")
        return finished == n

    wait_for(done, 60 + n * 2, "the burst to finish", 0.25)
    jobs = [forge.job(i) for i in ids]
    end = max(j.finished or 0 for j in jobs)
    waits = [(j.started or j.created) - j.created for j in jobs]
    instances = MachineInstance.objects.filter(org=t.org).select_related("machine_type")
    costs = machine_costs(instances, now=timezone.now())
    cost = sum((mc.attribution.cost for mc in costs), Decimal(0))
    price = t.machine_type.price_per_hour * Decimal(t.machine_type.billing_increment_seconds) / Decimal(3600)
    one_per_job = price * n  # every job on its own machine: one billed period each (hourly here)
    completions = sorted((j.finished or end) - t0 for j in jobs)
    return {
        "jobs": n,
        "seconds": end - t0,
        "per_minute": n / (end - t0) * 60,
        "wait_max_s": max(waits),
        "wait_p50_s": percentile(waits, 50),
        "machines": len(costs),
        "cost": str(cost),
        "cost_one_per_job": str(one_per_job),
        "completions_s": completions,
        "outcomes": {c: sum(1 for j in jobs if j.outcome == c) for c in {j.outcome for j in jobs}},
    }


def _one_forge(
    make: Callable[[Stack, int], tuple[ForgeBench, Any]],
    stack: Stack,
    *,
    samples: int,
    burst: int,
    pool_size: int,
    progress: Progress,
) -> dict[str, Any]:
    from apps.pools.services import pool_refill, pool_update

    forge, (t, pool) = make(stack, pool_size)
    try:
        pool_refill(pool_id=pool.pk)
        progress(f"ci: {forge.name}: warming a pool of 2 local machines")
        wait_quiet(pool.pk, 2)
        latency = _latency(forge, t, samples, progress)
        pool_update(pool=pool, target_size=pool_size, actor=Actor.TESTKIT)
        pool_refill(pool_id=pool.pk)
        progress(
            f"ci: {forge.name}: {pool_size} machines ready (pool members, or kept for reuse after a runner)"
        )
        wait_for(lambda: _ready(t) >= pool_size, 180, f"{pool_size} ready machines", 0.1)
        burst_data = _burst(forge, t, burst, progress)
        pool_update(pool=pool, target_size=0, actor=Actor.TESTKIT)  # the next forge's run has the host
    finally:
        forge.fake.stop()
    return {"forge": forge.name, "title": forge.title, "latency": latency, "burst": burst_data}


def _figures(data: dict[str, Any], pool_size: int) -> list[Figure]:
    title, latency, burst = data["title"], data["latency"], data["burst"]
    credential = "JIT config" if data["forge"] == "github" else "runner token"
    h50, h99 = _ms(latency["handoff_s"], 50), _ms(latency["handoff_s"], 99)
    o50, o99 = _ms(latency["online_s"], 50), _ms(latency["online_s"], 99)
    a99 = _ms(latency["ack_s"], 99)
    per_job = latency["calls"] / max(1, latency["samples"])
    cost, naive = Decimal(burst["cost"]), Decimal(burst["cost_one_per_job"])
    return [
        Figure(
            f"{title}: webhook -> {credential} handed to the agent p50",
            h50,
            "ms",
            "<= 100 ms",
            met=h50 <= 100,
            note="by stage, p50 of each: "
            + ", ".join(
                f"{what} {_ms(latency.get('stages_s', {}).get(kind, [0.0]), 50)} ms" for kind, what in STAGES
            ),
        ),
        Figure(
            f"{title}: webhook -> {credential} handed to the agent p99",
            h99,
            "ms",
            "<= 1000 ms",
            met=h99 <= 1000,
        ),
        Figure(
            f"{title}: webhook -> agent running the runner p50",
            _ms(latency["started_s"], 50),
            "ms",
            "",
            note="the agent woken from its long poll fetches the job and starts the runner",
        ),
        Figure(f"{title}: webhook -> stand-in runner online p50", o50, "ms", ""),
        Figure(f"{title}: webhook -> stand-in runner online p99", o99, "ms", ""),
        Figure(
            f"{title}: calls per job",
            round(per_job, 2),
            "calls",
            "<= 3",
            met=per_job <= 3,
            note="every call the fake answered during the samples, the reconciler's included: "
            + ", ".join(
                f"{route} {n / max(1, latency['samples']):.2f}"
                for route, n in latency.get("calls_by_route", {}).items()
            ),
        ),
        Figure(
            f"{title}: webhook acknowledgement p99",
            a99,
            "ms",
            "<= 100 ms",
            met=a99 <= 100,
            note="the fake's POST round trip: verify, store, act, answer",
        ),
        Figure(
            f"{title}: burst of {burst['jobs']} jobs on {pool_size} machines: throughput",
            round(burst["per_minute"], 1),
            "jobs/min",
            "",
        ),
        Figure(
            f"{title}: burst: longest wait for a runner",
            round(burst["wait_max_s"], 1),
            "s",
            "",
            note=f"median {burst['wait_p50_s']:.1f} s (queued -> started at the forge)",
        ),
        Figure(
            f"{title}: burst: machine cost with billing-aware reuse",
            float(cost),
            "USD",
            "",
            f"one machine per job {float(naive):.4f} USD",
            round(float(naive / cost), 1) if cost else None,
            note=f"{burst['machines']} machines, hourly billing",
        ),
    ]


def run(
    *,
    samples: int = 30,
    burst: int = 400,
    pool_size: int = 10,
    forges: tuple[str, ...] = ("github", "gitlab"),
    progress: Progress = say,
) -> PartResult:
    result = PartResult(part="ci", title="CI: webhook to runner, and a burst (fake GitHub and fake GitLab)")
    makers = {"github": _github, "gitlab": _gitlab}
    runs = []
    progress("ci: starting gunicorn, the agent server, worker and beat")
    with live_stack("ci") as stack:
        for name in forges:
            runs.append(
                _one_forge(
                    makers[name], stack, samples=samples, burst=burst, pool_size=pool_size, progress=progress
                )
            )
    result.data = {"forges": runs, "pool_size": pool_size}
    for data in runs:
        result.figures += _figures(data, pool_size)
    return result


def plot(result: PartResult, out: Any) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for data, style in zip(result.data["forges"], ("-", "--"), strict=False):
        lat = data["latency"]
        for key, label in (
            ("handoff_s", "credential handed off"),
            ("online_s", "runner online"),
            ("ack_s", "webhook acknowledged"),
        ):
            xs = sorted(v * 1000 for v in lat[key])
            a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], style, label=f"{data['title']}: {label}")
        xs = data["burst"]["completions_s"]
        b.plot(xs, range(1, len(xs) + 1), style, label=f"{data['title']} ({data['burst']['jobs']} jobs)")
    a.axvline(100, color="green", ls=":", label="handoff p50 target")
    a.set_xscale("log")
    a.set_xlabel("ms after the webhook")
    a.set_ylabel("share of jobs")
    a.set_title("warm pool, one job at a time")
    a.grid(alpha=0.3)
    a.legend(fontsize=7)
    b.set_xlabel("seconds after the burst was queued")
    b.set_ylabel("CI jobs finished")
    b.set_title(f"a burst on {result.data['pool_size']} machines")
    b.grid(alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    path = out / "docs" / "bench" / "ci.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "ci.png"
