"""Hours or a week of CI traffic against the strict forge fakes on a simulated clock, in one
process: issue 49's proofs (benchmarks/ci_limits.py runs them at full size, tests/github and
tests/gitlab reduced).

**The clock.** :class:`SimClock` is the only clock while a run lasts. ``time.time`` (the fakes'
clock, their limits' windows and waits, the clients' rate-limit arithmetic, the App's JWT) and
``django.utils.timezone.now`` (every deadline, window, budget, record and event, and the model
fields that default to it) read it, and it moves only when the run advances it: a step of
``step`` simulated seconds (5), or straight to the next thing due when nothing is. Nothing is
scaled: ``CATACLOUD_CI_LIMIT_TIME_SCALE`` stays 1 and the fakes' ``time_scale`` 1, so GitHub's
windows are its documented minute and hour, our pacing its 72 a minute and 450 an hour, a
secondary limit's wait a minute, the reconcile interval 30 s, the reaper's tick 60 s, the request
budget an hour, GitLab's runner cap seven days. What the clock does not move: PostgreSQL's own
``now()``/``clock_timestamp()`` (machine claims stamp real time: the run drives no machine
deadline), waits on sockets and conditions, and the work itself (a step's calls take real
milliseconds and no simulated time: the run says nothing about latency; the bench's ``ci`` part
does).

**The workers.** Celery messages (``send_task``, ``apply_async``) are kept in the run's queue
and run in this process, in order, when due (a countdown counts on the simulated clock): one
ideal worker. A message already waiting for the same time is not queued again (the tasks are
idempotent). Messages to tasks off the CI path (machines, pools) are counted and dropped: the
machines are the run's own, ``machines`` enrolled agents kept ready (a machine a runner job
ends is kept for the next, as billing-aware reuse does; one that ends is replaced at once).

**The reaper.** Every ``tick`` (60 s, ``CATACLOUD_REAPER_INTERVAL``'s default) the reaper's CI
rules (``apps.ci.convergence.ci_converge``: deliveries, demand, held runner jobs, re-drives,
reconciles due) and a scheduling pass run, as its tick does.

**The forge's side.** The fakes serve their REST API on a thread (every call Catacloud makes is
a real HTTP call, counted and limited by the fake); their deliveries are sent by the run through
the webhook's view (Django's test client, in process); their runners are played by the run: a
handed-off runner job's runner opens its session and takes a job as the service hands one (the
fake's own choice: the oldest it may run), runs ``duration`` simulated seconds, reports its end
and exits (its Catacloud job succeeds, its machine is kept).
"""

from __future__ import annotations

import contextlib
import heapq
import importlib
import itertools
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

# Celery tasks the run's worker runs (the CI path); every other message is counted and dropped.
RUNS = ("apps.github.", "apps.gitlab.", "apps.ci.", "apps.jobs.tasks.schedule")


class SimClock:
    """A clock that moves only when told (:meth:`advance`); :meth:`installed` makes it the
    process's ``time.time`` and ``timezone.now`` (see the module's docstring)."""

    def __init__(self, start: float) -> None:
        self.t = float(start)

    def time(self) -> float:
        return self.t

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.t, UTC)

    def advance(self, seconds: float) -> None:
        self.t += max(0.0, seconds)

    @contextlib.contextmanager
    def installed(self) -> Iterator[SimClock]:
        import time

        from django.apps import apps
        from django.utils import timezone

        real_time, real_now = time.time, timezone.now
        swapped = [
            f for model in apps.get_models() for f in model._meta.concrete_fields if f.default is real_now
        ]

        def default(to: Any) -> None:
            for f in swapped:
                f.default = to
                f.__dict__.pop("_get_default", None)  # Field caches its default's callable

        time.time, timezone.now = self.time, self.now  # type: ignore[method-assign,assignment]
        default(self.now)
        try:
            yield self
        finally:
            time.time, timezone.now = real_time, real_now  # type: ignore[method-assign]
            default(real_now)


class Worker:
    """Celery's messages kept and run in process (:data:`RUNS`), each when due."""

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self.queue: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.waiting: set[tuple[str, tuple[Any, ...]]] = set()
        self.seq = itertools.count()
        self.ran: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()

    def put(self, name: str, args: Any, countdown: Any) -> None:
        due = self.clock.t + float(countdown or 0)
        key = (name, tuple(args or ()), due)
        if key in self.waiting:
            return
        self.waiting.add(key)
        heapq.heappush(self.queue, (due, next(self.seq), name, key[1]))

    @contextlib.contextmanager
    def installed(self) -> Iterator[Worker]:
        from celery import Celery
        from celery.app.task import Task

        worker = self
        real_send, real_apply = Celery.send_task, Task.apply_async

        def send_task(app: Any, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> None:
            worker.put(name, args, options.get("countdown"))

        def apply_async(task: Any, args: Any = None, kwargs: Any = None, **options: Any) -> None:
            worker.put(task.name, args, options.get("countdown"))

        Celery.send_task = send_task  # type: ignore[method-assign,assignment]
        Task.apply_async = apply_async  # type: ignore[method-assign,assignment]
        try:
            yield self
        finally:
            Celery.send_task = real_send  # type: ignore[method-assign]
            Task.apply_async = real_apply  # type: ignore[method-assign]

    def next_due(self) -> float | None:
        return self.queue[0][0] if self.queue else None

    def run_due(self, limit: int = 5000) -> int:
        """Run the messages due now (and those they send that are due now), at most ``limit``."""
        ran = 0
        while self.queue and self.queue[0][0] <= self.clock.t and ran < limit:
            due, _, name, args = heapq.heappop(self.queue)
            self.waiting.discard((name, args, due))
            if not name.startswith(RUNS):
                self.dropped[name] += 1
                continue
            module, _, task = name.rpartition(".")
            getattr(importlib.import_module(module), task).run(*args)
            self.ran[name] += 1
            ran += 1
        return ran


@dataclass
class Playing:
    """A runner the run plays: its Catacloud runner job, the machine, its credential's key at the
    fake (GitHub: the runner id; GitLab: the token and the system id), the forge job it took and
    when that job ends."""

    job_id: Any
    instance_id: Any
    key: Any
    system_id: str = ""
    forge_job: int | None = None
    ends_at: float = 0.0


class ForgeSide:
    """A forge's runners as the run plays them (subclasses: how a runner takes a job at its fake)."""

    def __init__(self, forge: Any, fake: Any, duration: float) -> None:
        self.forge, self.fake, self.duration = forge, fake, duration
        self.playing: dict[Any, Playing] = {}

    def key_of(self, runner: Any, job: Any) -> tuple[Any, str]:
        raise NotImplementedError

    def take(self, p: Playing, now: float) -> int | None:
        """The runner asks for a job (the fake's lock is held): the forge job's id, or None."""
        raise NotImplementedError

    def alive(self, p: Playing, now: float) -> None:
        """A busy runner's liveness (its session, its trace) at ``now`` (the lock is held)."""

    def finish(self, p: Playing) -> None:
        """The job's end reported (the lock is held)."""
        raise NotImplementedError

    def next_due(self) -> float | None:
        ends = [p.ends_at for p in self.playing.values() if p.forge_job is not None]
        return min(ends) if ends else None

    def step(self, now: float) -> int:
        """Start the runners handed off since the last step, let idle ones ask for a job, keep busy
        ones alive, end the jobs due. Returns how many things happened."""
        from apps.jobs.models import Job
        from apps.jobs.reports import job_finished, job_started
        from apps.machines.models import MachineInstance

        moved = 0
        fresh = (
            self.forge.runner.objects.filter(
                job__status="assigned",
                job__handed_off_to__isnull=False,
                **{f"{self.forge.runner_id_field}__isnull": False},
            )
            .exclude(job_id__in=list(self.playing))
            .select_related("job", "job__instance")
        )
        for runner in fresh:
            key, system_id = self.key_of(runner, runner.job)
            self.playing[runner.job_id] = Playing(runner.job_id, runner.job.instance_id, key, system_id)
            job_started(instance=runner.job.instance, job_id=runner.job_id)
            moved += 1
        live = set(
            Job.objects.filter(pk__in=list(self.playing), status="running").values_list("pk", flat=True)
        )
        ended: list[Playing] = []
        with self.fake.lock:
            for job_id, p in list(self.playing.items()):
                if job_id not in live:  # cancelled (retired, its token rotated): the runner stops
                    del self.playing[job_id]
                    continue
                if p.forge_job is None:
                    p.forge_job = self.take(p, now)
                    if p.forge_job is not None:
                        p.ends_at, moved = now + self.duration, moved + 1
                elif p.ends_at <= now:
                    self.finish(p)
                    ended.append(self.playing.pop(job_id))
                else:
                    self.alive(p, now)
        for p in ended:
            instance = MachineInstance.objects.get(pk=p.instance_id)
            job_finished(instance=instance, job_id=p.job_id, outcome="succeeded", exit_code=0)
            moved += 1
        return moved


class GitHubSide(ForgeSide):
    """actions/runner with a just-in-time configuration: one job, then removed."""

    def key_of(self, runner: Any, job: Any) -> tuple[Any, str]:
        return int(runner.github_runner_id), ""

    def take(self, p: Playing, now: float) -> int | None:
        runner = self.fake.runners.get(p.key)
        if runner is None:
            return None
        runner.session, runner.last_seen = True, now
        if runner.online_at is None:
            runner.online_at = now
            self.fake.runner_online_at[runner.id] = now
        job = self.fake._take(runner)
        return None if job is None else int(job.id)

    def alive(self, p: Playing, now: float) -> None:
        runner = self.fake.runners.get(p.key)
        if runner is not None:
            runner.last_seen = now

    def finish(self, p: Playing) -> None:
        job = self.fake.jobs[p.forge_job]
        runner = self.fake.runners.pop(p.key, None)
        if runner is not None:
            runner.job_id = None
        if job.status != "completed":
            self.fake._complete(job, "success")


class GitLabSide(ForgeSide):
    """gitlab-runner's ``run-single`` for one job: the runner's token (per job, or the class
    runner's) and, for a class runner, its own system id."""

    def key_of(self, runner: Any, job: Any) -> tuple[Any, str]:
        from apps.gitlab.services import SYSTEM_ID_ENV, TOKEN_ENV

        secret = job.secret_env or {}
        return secret.get(TOKEN_ENV, ""), secret.get(SYSTEM_ID_ENV, "")

    def take(self, p: Playing, now: float) -> int | None:
        runner = next((r for r in self.fake.runners.values() if r.token == p.key), None)
        if runner is None:
            return None  # 403: deleted, or its token rotated (its runner job is retired)
        self.fake._contact(runner, p.system_id)
        job = self.fake._take(runner)
        if job is None:
            return None
        job.system_id = p.system_id or None
        return int(job.id)

    def alive(self, p: Playing, now: float) -> None:
        job = self.fake.jobs[p.forge_job]
        job.updated_at = now  # its trace

    def finish(self, p: Playing) -> None:
        job = self.fake.jobs[p.forge_job]
        if job.status == "running":
            self.fake._finish(job, "success")


def normalised(route: str) -> str:
    """A fake's recorded route with owners and repositories as placeholders."""
    route = re.sub(r"^/repos/[^/]+/[^/]+", "/repos/{repo}", route)
    return re.sub(r"^/orgs/[^/]+", "/orgs/{org}", route)


@dataclass
class Sample:
    t: float  # simulated seconds since the start
    calls: int
    window_calls: int  # our budget's calls this hour
    remaining: int | None  # the forge's own remaining calls (GitHub's x-ratelimit-remaining)
    reconciled_at: float | None
    done: int
    held: int


@dataclass
class Simulation:
    """One run: a forge, its fake, the tenant's machines, the clock and the worker."""

    forge: Any
    fake: Any
    side: ForgeSide
    org: Any
    machine_type: Any
    webhook: str
    machines: int
    endpoint_pk: Any
    step_s: float = 5.0
    tick_s: float = 60.0
    clock: SimClock = field(default_factory=lambda: SimClock(0.0))
    samples: list[Sample] = field(default_factory=list)
    arrivals: list[tuple[float, Callable[[], Any]]] = field(default_factory=list)
    started: float = 0.0
    next_tick: float = 0.0
    reconciles: list[float] = field(default_factory=list)
    agents: dict[Any, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.worker = Worker(self.clock)
        self.started = self.next_tick = self.clock.t

    # ---- the forge's deliveries, the machines -----------------------------------------------------

    def post(self, body: bytes, headers: dict[str, str]) -> int:
        from django.test import Client

        extra = {"HTTP_" + k.upper().replace("-", "_"): v for k, v in headers.items() if k != "Content-Type"}
        return int(Client().post(self.webhook, body, content_type="application/json", **extra).status_code)

    def top_up(self) -> int:
        """Keep ``machines`` machines ready or busy, the run's own enrolled agents: a machine that
        placement bought (its provisioning message is dropped) enrolls at once, and one that
        ended is replaced. Returns how many joined."""
        from apps.machines.models import MachineInstance
        from testkit.builders import enroll, warming_instance

        mine = MachineInstance.objects.filter(org=self.org, machine_type=self.machine_type)
        bought = list(mine.filter(status__in=("pending", "provisioning")))
        live = mine.filter(status__in=("ready", "claimed")).count()
        joined = 0
        for instance in [*bought, *(None for _ in range(self.machines - live - len(bought)))]:
            if instance is not None:
                mine.filter(pk=instance.pk).update(status="warming", provider_id=f"sim-{instance.pk}")
            else:
                instance = warming_instance(self.org, self.machine_type)
            client = enroll(instance)[0]
            answer = client.post("/api/agent/v1/heartbeat", {"running_job": None}, format="json")
            assert answer.status_code == 200, answer.content
            joined += 1
        return joined

    # ---- the run ---------------------------------------------------------------------------------

    def tick(self) -> None:
        from apps.ci.convergence import forge_converge
        from apps.jobs.scheduler import schedule

        forge_converge(forge=self.forge, now=self.clock.now())
        schedule()
        self.next_tick += self.tick_s

    def sample(self, done: int) -> None:
        from apps.jobs.models import Job

        row = (
            self.forge.endpoint.objects.filter(pk=self.endpoint_pk)
            .values("window_calls", "rate_remaining", "reconciled_at", "window_started_at")
            .get()
        )
        if row["reconciled_at"] is not None and (
            not self.reconciles or row["reconciled_at"].timestamp() != self.reconciles[-1]
        ):
            self.reconciles.append(row["reconciled_at"].timestamp())
        held = Job.objects.filter(handoff_by=self.forge.name, status="queued").exclude(hold_reason="").count()
        self.samples.append(
            Sample(
                self.clock.t - self.started,
                self.fake.api_calls(),
                row["window_calls"] or 0,
                row["rate_remaining"],
                row["reconciled_at"].timestamp() - self.started if row["reconciled_at"] else None,
                done,
                held,
            )
        )

    def step(self, done: Callable[[], int]) -> None:
        """One step: the clock moves, then everything due happens until nothing moves."""
        for _ in range(50):
            while self.arrivals and self.arrivals[0][0] <= self.clock.t:
                self.arrivals.pop(0)[1]()
            moved = self.fake.send_outbox(self.post)
            self.fake.sweep()
            if self.clock.t >= self.next_tick:
                self.tick()
                moved += 1
            moved += self.worker.run_due()
            moved += self.side.step(self.clock.t)
            moved += self.top_up()
            if not moved:
                break
        self.sample(done())
        self.clock.advance(self.until_next())

    def until_next(self) -> float:
        """A step, or longer when nothing is due before then (the next arrival, message, job's end
        or tick; a runner waiting for a job asks again each step)."""
        due = [self.next_tick]
        due += [x for x in (self.worker.next_due(), self.side.next_due()) if x is not None]
        if self.arrivals:
            due.append(self.arrivals[0][0])
        if any(p.forge_job is None for p in self.side.playing.values()):
            due.append(self.clock.t + self.step_s)
        return max(self.step_s, min(due) - self.clock.t)

    def run(self, done: Callable[[], int], total: int, limit: float) -> bool:
        """Step until ``done()`` reaches ``total`` or ``limit`` simulated seconds passed."""
        with self.clock.installed(), self.worker.installed():
            while self.clock.t - self.started < limit:
                self.step(done)
                if self.samples[-1].done >= total and not self.arrivals:
                    return True
        return False

    # ---- what the run shows -------------------------------------------------------------------------

    def calls_by_endpoint(self) -> dict[str, int]:
        with self.fake.lock:
            return dict(
                Counter(f"{m} {normalised(r)}" for m, r, _ in self.fake.calls if not r.startswith("/_"))
            )

    def longest_reconcile_gap(self) -> float:
        """The longest stretch of simulated time with no reconcile ending (the tick metric,
        ``catacloud_ci_last_reconcile_timestamp_seconds``, standing still), up to the run's end."""
        points = [self.started, *self.reconciles, self.clock.t]
        return max(b - a for a, b in itertools.pairwise(points))


# ---- the proofs' scenarios -----------------------------------------------------------------------

GITHUB_LABELS = ["self-hosted", "catacloud-linux-2cpu"]
GITLAB_TAGS = ["catacloud", "linux-2cpu"]


def _window_peak(times: list[float], seconds: float) -> int:
    """The most of ``times`` within any ``seconds`` (a sliding window)."""
    times, most, first = sorted(times), 0, 0
    for last, t in enumerate(times):
        while t - times[first] >= seconds:
            first += 1
        most = max(most, last - first + 1)
    return most


def github_burst(
    org: Any,
    machine_type: Any,
    *,
    jobs: int = 1000,
    repositories: int = 200,
    machines: int = 50,
    duration: float = 120.0,
    limit: float = 8 * 3600.0,
    start: float | None = None,
    prepare: Callable[[Any], None] | None = None,
) -> tuple[Simulation, dict[str, Any]]:
    """``jobs`` workflow jobs queued at once over ``repositories`` repositories of one
    installation, against the strict fake GitHub (its documented limits; ``prepare`` may change
    the fake first), run to their end on ``machines`` machines, each job ``duration`` simulated
    seconds, or until ``limit`` simulated seconds passed. Returns the run and its figures."""
    import time

    from apps.github.forge import GITHUB
    from apps.github.services import connection_set, runner_class_save
    from testkit.github_fake import FakeGitHub, app_keypair

    private, public = app_keypair()
    fake = FakeGitHub(app_id=1, public_key=public, webhook_secret="sim-webhook-secret").start(
        background=False
    )
    repos = [f"burst/r{i:03d}" for i in range(repositories)]
    fake.add_installation(1, "burst", repos)
    if prepare is not None:
        prepare(fake)
    conn, _ = connection_set(
        org=org,
        app_id=1,
        api_url=fake.url,
        private_key=private,
        webhook_secret="sim-webhook-secret",
        installations=[{"id": 1, "account": "burst"}],
        actor="sim",
    )
    runner_class_save(org=org, name="burst", labels=GITHUB_LABELS, machine_type=machine_type)
    clock = SimClock(start if start is not None else time.time())
    sim = Simulation(
        GITHUB,
        fake,
        GitHubSide(GITHUB, fake, duration),
        org,
        machine_type,
        "/api/integrations/github/webhook",
        machines,
        conn.installations.get().pk,
        clock=clock,
    )

    def queue_all() -> None:
        for i in range(jobs):
            fake.queue_job(repos[i % repositories], GITHUB_LABELS, ["true"], name=f"burst-{i}")

    sim.arrivals = [(clock.t, queue_all)]

    def done() -> int:
        with fake.lock:
            return sum(1 for j in fake.jobs.values() if j.status == "completed")

    try:
        finished = sim.run(done, jobs, limit)
    finally:
        fake.stop()
    return sim, github_figures(sim, jobs, finished)


def github_figures(sim: Simulation, jobs: int, finished: bool) -> dict[str, Any]:
    fake = sim.fake
    by_endpoint = sim.calls_by_endpoint()
    issued = list(fake.jit_issued)
    with fake.lock:
        outcomes = Counter(j.conclusion or j.status for j in fake.jobs.values())
        answers = list(fake.limit_answers)
        violations = list(fake.limit_violations)
    remaining = [s.remaining for s in sim.samples if s.remaining is not None]
    last_done = next((s.t for s in sim.samples if s.done >= jobs), sim.samples[-1].t)
    return {
        "jobs": jobs,
        "finished": finished,
        "simulated_seconds": last_done,
        "outcomes": dict(outcomes),
        "calls": sum(by_endpoint.values()),
        "calls_per_job": sum(by_endpoint.values()) / jobs,
        "calls_by_endpoint": by_endpoint,
        "limit_answers": len(answers),
        "limit_violations": len(violations),
        "registrations": len(issued),
        "registrations_peak_minute": _window_peak(issued, 60.0),
        "registrations_peak_hour": _window_peak(issued, 3600.0),
        "budget_peak": max((s.window_calls for s in sim.samples), default=0),
        "remaining_min": min(remaining) if remaining else None,
        "reconciles": len(sim.reconciles),
        "reconcile_gap_max": sim.longest_reconcile_gap(),
        "messages_ran": dict(sim.worker.ran),
        "messages_dropped": dict(sim.worker.dropped),
    }


def gitlab_week(
    org: Any,
    machine_type: Any,
    *,
    jobs: int = 5000,
    days: float = 7.0,
    mode: str = "class",
    cap: int = 50,
    machines: int = 20,
    duration: float = 300.0,
    limit: float | None = None,
    seed: int = 49,
    start: float | None = None,
) -> tuple[Simulation, dict[str, Any]]:
    """``jobs`` CI jobs of one GitLab.com Free project (runner cap ``cap`` over seven days)
    arriving at random over ``days`` simulated days, the class in runner ``mode`` (``class`` or
    ``per_job``), on ``machines`` machines, each job ``duration`` simulated seconds; run until
    every job ended or ``limit`` simulated seconds (by default the days and a day more)."""
    import random
    import time

    from apps.gitlab.forge import GITLAB
    from apps.gitlab.services import connection_set, runner_class_save
    from testkit.gitlab_fake import FakeGitLab

    fake = FakeGitLab(token="glpat-sim-token", webhook_token="sim-webhook-token").start(background=False)
    fake.add_project(21, "free/app")
    fake.runner_cap = cap
    conn, _ = connection_set(
        org=org,
        url=fake.url,
        token="glpat-sim-token",
        webhook_token="sim-webhook-token",
        projects=[{"id": 21, "path": "free/app"}],
        actor="sim",
    )
    mode_field = {"runner_mode": mode} if mode != "per_job" else {}  # per job: the default
    runner_class_save(org=org, name="week", tags=GITLAB_TAGS, machine_type=machine_type, **mode_field)
    clock = SimClock(start if start is not None else time.time())
    sim = Simulation(
        GITLAB,
        fake,
        GitLabSide(GITLAB, fake, duration),
        org,
        machine_type,
        "/api/integrations/gitlab/webhook",
        machines,
        conn.pk,
        clock=clock,
    )
    rng = random.Random(seed)
    span = days * 86400.0
    times = sorted(clock.t + rng.random() * span for _ in range(jobs))
    sim.arrivals = [
        (t, lambda i=i: fake.queue_job("free/app", GITLAB_TAGS, ["true"], name=f"week-{i}"))
        for i, t in enumerate(times)
    ]

    def done() -> int:
        with fake.lock:
            return sum(1 for j in fake.jobs.values() if j.status in ("success", "failed", "canceled"))

    try:
        finished = sim.run(done, jobs, limit if limit is not None else span + 86400.0)
    finally:
        fake.stop()
    return sim, gitlab_figures(sim, jobs, finished)


def gitlab_figures(sim: Simulation, jobs: int, finished: bool) -> dict[str, Any]:
    from apps.jobs.models import Job

    fake = sim.fake
    by_endpoint = sim.calls_by_endpoint()
    runner_jobs = Job.objects.filter(handoff_by="gitlab")
    with fake.lock:
        outcomes = Counter(j.status for j in fake.jobs.values())
        created = len(fake.all_runners)
    held = runner_jobs.filter(status="queued").exclude(hold_reason="")
    reasons = Counter(r.split(":")[0][:80] for r in held.values_list("hold_reason", flat=True))
    queued_at = len(fake.jobs)
    return {
        "jobs": jobs,
        "queued": queued_at,
        "finished": finished,
        "simulated_seconds": sim.samples[-1].t if sim.samples else 0.0,
        "outcomes": dict(outcomes),
        "runners_created": created,
        "cap_refusals": fake.cap_refusals,
        "runner_jobs_failed": runner_jobs.filter(status="failed").count(),
        "runner_jobs_held": held.count(),
        "hold_reasons": dict(reasons),
        "calls": sum(by_endpoint.values()),
        "calls_per_job": sum(by_endpoint.values()) / max(1, queued_at),
        "calls_by_endpoint": by_endpoint,
        "reconciles": len(sim.reconciles),
        "reconcile_gap_max": sim.longest_reconcile_gap(),
        "messages_ran": dict(sim.worker.ran),
        "messages_dropped": dict(sim.worker.dropped),
    }
