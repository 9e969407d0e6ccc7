"""One job trace replayed through the live stack and through the simulator, side by side.

The live stack is the one `make dev` runs (gunicorn, the agent server, a Celery worker and
beat, the local provider starting real agent processes), on a clock ``compression`` times
faster than the trace's: every duration in the trace, the billing period, the reaper and
scheduler intervals, the retention margin and the grant's ``max_wait_seconds`` are divided by
it, and the price per hour multiplied by it, so a compressed billing period costs what an
hour costs. Jobs are submitted over REST at their (compressed) times and run ``sleep`` for
their (compressed) duration. The simulator replays the same trace at its own scale with the
live machines' measured boot time. Both are billed to the moment the last job ended, as
``GET /costs/`` bills a live period: a machine still alive then counts what it committed (its
current paid period), and the unused rest of that period is ``tail``, not ``idle``.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

from benchmarks.harness import Progress, median, say, tenant
from benchmarks.stack import live_stack, wait_quiet
from catacloud.policy.attribution import KINDS
from catacloud.simulate import Params, Result, TraceJob, percentile, simulate
from testkit.builders import job_config
from testkit.processes import wait_for

# Trace scale: the grant default max_wait_seconds and the reaper / scheduler intervals.
MAX_WAIT, REAPER, SCHEDULER = 90.0, 60.0, 15.0
PRICE = Decimal("0.0095")


@dataclass
class Side:
    """What one replay (live or simulated) cost and how long its jobs waited."""

    machines: int
    cost: float
    shares: dict[str, float]
    wait_p50: float
    wait_p95: float
    jobs: int
    # (start, end) of every machine, in trace seconds from the first submission's origin
    timeline: list[tuple[float, float]] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {
            "machines": self.machines,
            "cost": round(self.cost, 6),
            "shares": self.shares,
            "idle_share": self.shares.get("idle", 0.0),
            "wait_p50": round(self.wait_p50, 1),
            "wait_p95": round(self.wait_p95, 1),
            "jobs": self.jobs,
            "timeline": [[round(a, 1), round(b, 1)] for a, b in self.timeline],
        }


def _shares(by_kind: dict[str, Decimal]) -> dict[str, float]:
    total = sum(by_kind.values(), Decimal(0))
    return {k: round(float(by_kind.get(k, Decimal(0)) / total), 4) if total else 0.0 for k in KINDS}


def _submitter(url: str, token: str, plan: list[tuple[float, str, float]], errors: list[str]) -> None:
    """POST /jobs/ for each (live second, config, live duration) at its time (a connection per
    request: the pauses between submissions outlast gunicorn's keep-alive)."""
    parts = urlsplit(url)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    start = time.monotonic()
    for at, config, seconds in plan:
        delay = start + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        body = json.dumps({"config": config, "env": {"RUN_SECONDS": f"{seconds:.2f}"}})
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        try:
            conn.request("POST", "/api/v1/jobs/", body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
            if response.status != 201:
                errors.append(f"{response.status} {data[:200]!r}")
        except OSError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            conn.close()


def replay_live(
    jobs: list[TraceJob], *, compression: float, pool_size: int, progress: Progress = say
) -> tuple[Side, dict[str, Any]]:
    """Replay ``jobs`` through the live stack under the grant policy ``cost`` with a warm pool
    of ``pool_size`` in front. Returns the live side and what was measured about the run."""
    from apps.events.models import Event
    from apps.jobs.models import Job
    from apps.machines.costs import machine_costs
    from apps.machines.models import MachineInstance
    from apps.orgs.services import api_token_create
    from apps.pools.services import pool_create
    from testkit.purchases import needless_purchases

    k = compression
    env = {
        "CATACLOUD_REAPER_INTERVAL": f"{max(1.0, REAPER / k):g}",
        "CATACLOUD_SCHEDULER_INTERVAL": f"{SCHEDULER / k:g}",
        "CATACLOUD_RETENTION_MARGIN": f"{2 * max(1.0, REAPER / k):g}",
    }
    progress(
        f"cost: live replay of {len(jobs)} jobs, clock x{k:g} ({jobs[-1].submit / k:.0f} s of submissions)"
    )
    with live_stack("replay", **env) as stack:
        t = tenant(
            "replay",
            kind="local",
            state_dir=stack.state_dir,
            machine_type={"billing_increment_seconds": round(3600 / k), "price_per_hour": PRICE * Decimal(k)},
            max_instances=500,
            max_pool_size=max(1, pool_size),
            policy="cost",
            max_wait_seconds=max(1, round(MAX_WAIT / k)),
        )
        for name in sorted({j.config for j in jobs}):
            job_config(t.org, t.machine_type, name, 'sleep "$RUN_SECONDS"', reuse="reuse")
        if pool_size:
            pool = pool_create(org=t.org, name="front", machine_type=t.machine_type, target_size=pool_size)
            wait_quiet(pool.pk, pool_size)
        _, token = api_token_create(org=t.org, user=t.user)
        plan = [(j.submit / k, j.config, j.duration / k) for j in jobs]
        errors: list[str] = []
        origin = time.time()  # trace second 0
        submitter = threading.Thread(target=_submitter, args=(stack.url, token, plan, errors))
        submitter.start()
        last = jobs[-1].submit / k
        while submitter.is_alive():
            submitter.join(10)
            done = Job.objects.filter(org=t.org, finished_at__isnull=False).count()
            progress(f"cost: live {time.time() - origin:.0f}/{last:.0f} s, {done} jobs done")
        assert not errors, errors[:3]
        wait_for(
            lambda: Job.objects.filter(org=t.org, finished_at__isnull=False).count() == len(jobs),
            max(j.duration for j in jobs) / k + 120,
            "every replayed job to end",
            0.2,
        )
        rows = list(
            Job.objects.filter(org=t.org).values("status", "queued_at", "assigned_at", "finished_at", "env")
        )
        horizon = max(r["finished_at"] for r in rows)
        instances = list(
            MachineInstance.objects.filter(org=t.org).select_related("machine_type").order_by("created_at")
        )
        costs = machine_costs(instances, now=horizon)
        events = list(Event.objects.filter(org=t.org).order_by("id"))
    by_kind = {kind: Decimal(0) for kind in KINDS}
    for mc in costs:
        for kind, amount in mc.attribution.by_kind().items():
            by_kind[kind] += amount
    waits = [(r["assigned_at"] - r["queued_at"]).total_seconds() * k for r in rows if r["assigned_at"]]
    # Request to ready, in the order bought; and what a machine is held beyond a job's run
    # (the agent fetching, starting and ending it), both at the trace's scale.
    boots = [(i.warmed_at - i.created_at).total_seconds() * k for i in instances if i.warmed_at is not None]
    overheads = [
        ((r["finished_at"] - r["assigned_at"]).total_seconds() - float(r["env"]["RUN_SECONDS"])) * k
        for r in rows
        if r["assigned_at"] and r["finished_at"]
    ]

    def trace_s(at: Any) -> float:
        return (at.timestamp() - origin) * k

    side = Side(
        machines=len(instances),
        cost=float(sum((mc.attribution.cost for mc in costs), Decimal(0))),
        shares=_shares(by_kind),
        wait_p50=percentile(waits, 50),
        wait_p95=percentile(waits, 95),
        jobs=len(rows),
        timeline=[
            (trace_s(i.provisioning_started_at), trace_s(i.ended_at or horizon))
            for i in instances
            if i.provisioning_started_at is not None
        ],
    )
    measured = {
        "statuses": sorted({r["status"] for r in rows}),
        "failed": sum(1 for r in rows if r["status"] != "succeeded"),
        "boot_live_s": median(boots) / k,
        "boot_trace_s": median(boots),
        "boots_trace_s": [round(b, 2) for b in boots],
        "job_overhead_trace_s": median(overheads),
        "needless_purchases": len(needless_purchases(events)),
        "horizon_trace_s": trace_s(horizon),
    }
    return side, measured


def replay_params(measured: dict[str, Any]) -> Params:
    """The simulator's parameters for a trace replayed live: the grant's and the reaper's at
    the trace's scale, and what the live run measured of its machines (their boot times, in
    the order bought, and the agent's time around each job)."""
    return Params(
        price_per_hour=PRICE,
        boot_seconds=measured["boot_trace_s"],
        boot_samples=tuple(measured["boots_trace_s"]),
        job_overhead=measured["job_overhead_trace_s"],
        max_wait=MAX_WAIT,
        max_instances=500,
        reaper_interval=REAPER,
        scheduler_interval=SCHEDULER,
    )


def replay_simulated(jobs: list[TraceJob], *, pool_size: int, params: Params) -> tuple[Side, Result]:
    """The simulator's side: the same trace, policy ``pool:N:cost``, billed to the end of the
    last job."""
    policy = f"pool:{pool_size}:cost" if pool_size else "cost"
    sim = simulate(jobs, policy, params, until_done=True)
    side = Side(
        machines=sim.machines_created,
        cost=float(sim.cost),
        shares=sim.shares(),
        wait_p50=sim.wait_p50,
        wait_p95=sim.wait_p95,
        jobs=sim.jobs,
        timeline=list(sim.timeline),
    )
    return side, sim
