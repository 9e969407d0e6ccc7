"""Part `ci`: GitHub Actions on Catacloud against the fake GitHub (testkit/github_fake.py).

The live stack (gunicorn, the agent server, a worker and beat, local machines) receives the
fake's signed ``workflow_job`` deliveries; the stand-in runner (testkit/github_runner) runs on
the machines. Two measurements:

- **latency** on a warm pool, one job at a time: delivery received (the web's stored row) ->
  the runner's just-in-time configuration handed to the agent (``job.handed_off``) and -> the
  agent running it (``job.started``); delivery sent -> the stand-in runner online at the fake;
  the webhook's acknowledgement (the fake's round trip); GitHub calls per job (every call the
  fake answered, the reconciler's included, at the default reconcile interval).
- **burst**: ``burst`` jobs queued at once against a pool of ``pool_size`` machines (the grant
  allows no more): throughput, the longest wait for a runner (queued -> started at GitHub), and
  what the machines cost with billing-aware reuse against one machine per job.
"""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

from benchmarks.harness import Figure, PartResult, Progress, percentile, say, tenant
from benchmarks.stack import live_stack, wait_quiet
from testkit.github_fake import FakeGitHub, app_keypair
from testkit.github_kit import WEBHOOK_PATH, connect, expose_runner
from testkit.processes import wait_for

LABELS = ["self-hosted", "catacloud-linux-2cpu"]
ACTIONS = ("queued", "in_progress", "completed")  # each job's deliveries: every one is acknowledged


def _ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 1)


def _latency(fake: FakeGitHub, t: Any, samples: int, progress: Progress) -> dict[str, Any]:
    from apps.events.models import Event
    from apps.github.models import Runner, WebhookDelivery

    handoff, started, online, ack = [], [], [], []
    calls_before = fake.api_calls()
    for i in range(samples):
        wait_for(lambda: _ready(t) >= 1, 90, "a ready machine", 0.05)
        progress(f"ci: latency sample {i + 1}/{samples}")
        job_id = fake.queue_job("bench/app", LABELS, ["true"], name=f"latency-{i}")
        wait_for(lambda j=job_id: fake.job(j).status == "completed", 60, "the workflow job to complete", 0.02)
        sent = fake.delivery_for(job_id, "queued")
        assert sent is not None
        received = WebhookDelivery.objects.get(guid=sent.guid).received_at
        runner = Runner.objects.select_related("job").get(created_for__github_id=job_id)
        handed = Event.objects.filter(kind="job.handed_off", job_id=runner.job_id).values_list(
            "created_at", flat=True
        )
        handoff.append((handed[0] - received).total_seconds())
        start = wait_for(
            lambda r=runner.pk: Runner.objects.filter(pk=r).values_list("job__started_at", flat=True).first(),
            30,
            "the runner job's start",
            0.02,
        )
        started.append((start - received).total_seconds())
        online.append(fake.runner_online_at[fake.job(job_id).runner_id or 0] - sent.delivered_at)
        sent_all = wait_for(
            lambda j=job_id: (
                (ds := [fake.delivery_for(j, a) for a in ACTIONS])
                and all(d is not None and d.status_code for d in ds)
                and ds
            ),
            30,
            "the job's three deliveries to be acknowledged",
            0.02,
        )
        ack += [d.duration for d in sent_all]
    calls = fake.api_calls() - calls_before
    return {
        "handoff_s": handoff,
        "started_s": started,
        "online_s": online,
        "ack_s": ack,
        "calls": calls,
        "samples": samples,
    }


def _ready(t: Any) -> int:
    """Ready machines of the tenant, in its pool or kept for reuse (a runner's machine leaves the
    pool after its job and serves the next one while its hour is paid), nothing still booting."""
    from apps.machines.models import MachineInstance

    statuses = list(MachineInstance.objects.filter(org=t.org).values_list("status", flat=True))
    booting = sum(
        1 for s in statuses if s in ("pending", "provisioning", "warming", "terminating", "claimed")
    )
    return 0 if booting else statuses.count("ready")


def _burst(fake: FakeGitHub, t: Any, n: int, progress: Progress) -> dict[str, Any]:
    from django.utils import timezone

    from apps.machines.costs import machine_costs
    from apps.machines.models import MachineInstance

    progress(f"ci: burst of {n} jobs")
    t0 = time.time()
    ids = [fake.queue_job("bench/app", LABELS, ["true"], name=f"burst-{i}") for i in range(n)]

    def done() -> bool:
        finished = sum(1 for i in ids if fake.job(i).status == "completed")
        if int(time.time() - t0) % 20 == 0:
            progress(f"ci: burst {finished}/{n} completed")
        return finished == n

    wait_for(done, 60 + n * 2, "the burst to complete", 0.25)
    jobs = [fake.job(i) for i in ids]
    end = max(j.completed_at or 0 for j in jobs)
    waits = [(j.started_at or j.created_at) - j.created_at for j in jobs]
    instances = MachineInstance.objects.filter(org=t.org).select_related("machine_type")
    costs = machine_costs(instances, now=timezone.now())
    cost = sum((mc.attribution.cost for mc in costs), Decimal(0))
    price = t.machine_type.price_per_hour * Decimal(t.machine_type.billing_increment_seconds) / Decimal(3600)
    one_per_job = price * n  # every job on its own machine: one billed period each (hourly here)
    completions = sorted((j.completed_at or end) - t0 for j in jobs)
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
        "conclusions": {c: sum(1 for j in jobs if j.conclusion == c) for c in {j.conclusion for j in jobs}},
    }


def run(*, samples: int = 30, burst: int = 1000, pool_size: int = 10, progress: Progress = say) -> PartResult:
    from apps.pools.services import pool_create, pool_refill

    result = PartResult(part="ci", title="GitHub Actions: webhook to runner, and a burst (fake GitHub)")
    private, public = app_keypair()
    progress("ci: starting gunicorn, the agent server, worker, beat and the fake GitHub")
    with live_stack("ci") as stack:
        fake = FakeGitHub(
            app_id=1,
            public_key=public,
            webhook_secret="bench-webhook-secret",
            webhook_url=stack.url + WEBHOOK_PATH,
        ).start()
        try:
            fake.add_installation(1, "bench", ["bench/app"])
            t = tenant(
                "ci",
                kind="local",
                state_dir=stack.state_dir,
                max_instances=pool_size,
                max_pool_size=pool_size,
                max_concurrent_jobs=pool_size,
            )
            expose_runner(t.machine_type.provider_account)  # before the pool's first machine starts
            pool = pool_create(
                org=t.org, name="ci", machine_type=t.machine_type, target_size=2, max_size=pool_size
            )
            connect(
                t.org,
                fake,
                private,
                installation_id=1,
                account="bench",
                classes=[{"name": "small", "labels": LABELS, "machine_type": t.machine_type, "pool": pool}],
            )
            pool_refill(pool_id=pool.pk)
            progress("ci: warming a pool of 2 local machines")
            wait_quiet(pool.pk, 2)
            latency = _latency(fake, t, samples, progress)
            from apps.pools.services import pool_update

            pool_update(pool=pool, target_size=pool_size, actor="bench")
            pool_refill(pool_id=pool.pk)
            progress(f"ci: {pool_size} machines ready (pool members, or kept for reuse after a runner)")
            wait_for(lambda: _ready(t) >= pool_size, 180, f"{pool_size} ready machines", 0.1)
            burst_data = _burst(fake, t, burst, progress)
        finally:
            fake.stop()
    h50, h99 = _ms(latency["handoff_s"], 50), _ms(latency["handoff_s"], 99)
    o50, o99 = _ms(latency["online_s"], 50), _ms(latency["online_s"], 99)
    a99 = _ms(latency["ack_s"], 99)
    per_job = latency["calls"] / max(1, latency["samples"])
    cost, naive = Decimal(burst_data["cost"]), Decimal(burst_data["cost_one_per_job"])
    result.data = {"latency": latency, "burst": burst_data, "pool_size": pool_size}
    result.figures += [
        Figure("webhook -> JIT config handed to the agent p50", h50, "ms", "<= 250 ms", met=h50 <= 250),
        Figure("webhook -> JIT config handed to the agent p99", h99, "ms", "<= 1000 ms", met=h99 <= 1000),
        Figure(
            "webhook -> agent running the runner p50",
            _ms(latency["started_s"], 50),
            "ms",
            "",
            note="the agent woken from its long poll fetches the job and starts run.sh",
        ),
        Figure("webhook -> stand-in runner online p50", o50, "ms", ""),
        Figure("webhook -> stand-in runner online p99", o99, "ms", ""),
        Figure(
            "GitHub calls per job",
            round(per_job, 2),
            "calls",
            "<= 3",
            met=per_job <= 3,
            note="every call the fake answered during the samples, token and reconciler included",
        ),
        Figure(
            "webhook acknowledgement p99",
            a99,
            "ms",
            "<= 100 ms",
            met=a99 <= 100,
            note="the fake's POST round trip: verify, store, act, answer",
        ),
        Figure(
            f"burst of {burst_data['jobs']} jobs on {pool_size} machines: throughput",
            round(burst_data["per_minute"], 1),
            "jobs/min",
            "",
        ),
        Figure(
            "burst: longest wait for a runner",
            round(burst_data["wait_max_s"], 1),
            "s",
            "",
            note=f"median {burst_data['wait_p50_s']:.1f} s (queued -> started at GitHub)",
        ),
        Figure(
            "burst: machine cost with billing-aware reuse",
            float(cost),
            "USD",
            "",
            f"one machine per job {float(naive):.4f} USD",
            round(float(naive / cost), 1) if cost else None,
            note=f"{burst_data['machines']} machines, hourly billing",
        ),
    ]
    return result


def plot(result: PartResult, out: Any) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    lat = result.data["latency"]
    for key, label in (
        ("handoff_s", "webhook -> JIT config handed off"),
        ("online_s", "webhook -> runner online"),
        ("ack_s", "webhook acknowledged"),
    ):
        xs = sorted(v * 1000 for v in lat[key])
        a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    a.axvline(250, color="green", ls=":", label="handoff p50 target")
    a.set_xscale("log")
    a.set_xlabel("ms")
    a.set_ylabel("share of jobs")
    a.set_title("warm pool, one job at a time")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    burst = result.data["burst"]
    xs = burst["completions_s"]
    b.plot(xs, range(1, len(xs) + 1))
    b.set_xlabel("seconds after the burst was queued")
    b.set_ylabel("workflow jobs completed")
    b.set_title(f"{burst['jobs']} jobs, {result.data['pool_size']} machines")
    b.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "docs" / "bench" / "ci.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "ci.png"
