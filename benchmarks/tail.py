"""The tail of warm starts (`make bench ONLY=tail`): submit -> the job's first instruction (and
submit -> running) of many warm jobs through the live stack, in bursts and trickles; p50, p99,
p99.9 and max, and every slow job explained.

The stack is `make dev`'s (gunicorn, the agent server, a Celery worker, beat; the local provider
starts real agent processes). ``machines`` machines are made warm first: as many `sleep`
jobs of a ``reuse`` configuration at once, on an empty grant of ``machines`` instances; when
they end, the machines stay ready for reuse (an hour is paid for) and every later job lands on
one of them (placement takes an idle paid machine first), so no job waits for a boot or for
another job. Then ``jobs`` jobs whose first act prints the time (`date`) are submitted through
``POST /api/v1/jobs/``, alternating bursts (``machines`` jobs at once, each from its own
thread) and trickles (one job at a time, ``gap`` apart), each burst or trickle starting once
the previous one's jobs all ended (in the database: their machines may still be tidying up),
so that every job finds an idle machine.

A job's time is its first instruction minus ``queued_at`` (the submit's commit; same host, same
clock), split in five: queued -> admitted (admission, in the submit's own request after its
commit, or the scheduling pass), admitted -> assigned (placement), assigned -> delivered (the
agent woken from its long poll, its poll answered with the job), delivered -> started (the
agent's ``started`` report, sent as the job's folder and sandbox are made), started -> first
instruction (the sandbox released at its gate, the shell runs `date`). Submit -> running
(``started_at - queued_at``) is reported beside it. With tracing on, a job's trace has the spans
within those stages (`catacloud jobs show --timing`).
The saved results keep percentile curves, not the jobs (`summary`): every job above ``slow`` is
counted by the stage that took most of its time, and the slowest are listed by id.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from benchmarks.harness import (
    CPU_OWNERS,
    Figure,
    PartResult,
    Progress,
    cpu_per_job,
    cpu_seconds,
    percentile,
    say,
    tenant,
)
from benchmarks.stack import live_stack
from benchmarks.submit import FIRST, first_instructions
from testkit.builders import job_config
from testkit.processes import wait_for

STAGES = (("admission", "queued_at", "admitted_at"), ("placement", "admitted_at", "assigned_at"))
STAGES += (("delivery", "assigned_at", "delivered_at"), ("agent start", "delivered_at", "started_at"))
STAGES += (("launch", "started_at", "first_at"),)
SLOW = 0.25


def _submit(session: Any, url: str, config_id: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    r = session.post(f"{url}/api/v1/jobs/", json={"config": config_id}, timeout=30)
    assert r.status_code == 201, r.text
    return str(r.json()["id"]), time.perf_counter() - t0


def _wait_ended(ids: list[str], timeout: float = 120) -> None:
    from apps.jobs.choices import JOB_TERMINAL
    from apps.jobs.models import Job

    def ended() -> bool:
        return Job.objects.filter(pk__in=ids, status__in=JOB_TERMINAL).count() == len(ids)

    wait_for(ended, timeout, f"{len(ids)} jobs to end", 0.02)


def _idle_machines(t: Any) -> int:
    from apps.machines.models import MachineInstance

    return MachineInstance.objects.filter(machine_type=t.machine_type, status="ready").count()


def run(
    *,
    jobs: int = 1000,
    machines: int = 6,
    gap: tuple[float, float] = (0.02, 0.2),
    seed: int = 7,
    slow: float = SLOW,
    progress: Progress = say,
    **stack_env: str,
) -> PartResult:
    import requests

    from apps.jobs.models import Job
    from apps.orgs.services import api_token_create

    rng = random.Random(seed)
    result = PartResult(part="tail", title="The tail of warm starts: submit -> running")
    records: list[dict[str, Any]] = []
    progress("tail: starting gunicorn, the agent server, worker and beat")
    with live_stack("tail", **stack_env) as stack:
        t = tenant("tail", kind="local", state_dir=stack.state_dir, max_instances=machines)
        warm_cfg = job_config(t.org, t.machine_type, "warm-up", "sleep 2", reuse="reuse")
        cfg = job_config(t.org, t.machine_type, "first", FIRST, reuse="reuse")
        _, token = api_token_create(org=t.org, user=t.user)
        local = threading.local()

        def session() -> Any:
            s = getattr(local, "s", None)
            if s is None:
                s = local.s = requests.Session()
                s.headers["Authorization"] = f"Bearer {token}"
            return s

        progress(f"tail: warming {machines} machines (reuse)")
        warm = [_submit(session(), stack.url, str(warm_cfg.pk))[0] for _ in range(machines)]
        _wait_ended(warm, 180)
        wait_for(lambda: _idle_machines(t) >= machines, 60, f"{machines} idle machines", 0.05)
        phase, n = 0, 0
        cpu_before = cpu_seconds()
        while n < jobs:
            size = min(machines, jobs - n)
            kind = "burst" if phase % 2 == 0 else "trickle"
            submitted: list[tuple[str, float, str]] = []

            def one(kind: str = kind, submitted: list[tuple[str, float, str]] = submitted) -> None:
                job_id, seconds = _submit(session(), stack.url, str(cfg.pk))
                submitted.append((job_id, seconds, kind))  # list.append: atomic

            if kind == "burst":
                threads = [threading.Thread(target=one) for _ in range(size)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
            else:
                for _ in range(size):
                    one()
                    time.sleep(rng.uniform(*gap))
            _wait_ended([s[0] for s in submitted])
            for job_id, seconds, k in submitted:
                records.append({"id": job_id, "submit_http_s": seconds, "phase": k})
            n += size
            phase += 1
            if phase % 20 == 0:
                progress(f"tail: {n}/{jobs} jobs")
        cpu = cpu_per_job(cpu_before, cpu_seconds(), len(records))
        ids = [r["id"] for r in records]
        firsts = first_instructions(ids)
        launches = _launches(ids)
        stamps = ("queued_at", "admitted_at", "assigned_at", "delivered_at", "started_at")
        rows = {str(r["id"]): r for r in Job.objects.filter(pk__in=ids).values("id", "status", *stamps)}
        for rec in records:
            row = rows[rec["id"]]
            at = {k: row[k].timestamp() if row[k] else None for k in stamps}
            at["first_at"] = firsts.get(rec["id"])
            rec["status"] = row["status"]
            rec["start_s"] = at["started_at"] - at["queued_at"]
            rec["first_s"] = at["first_at"] - at["queued_at"] if at["first_at"] else None
            rec["stages"] = {name: at[b] - at[a] if at[a] and at[b] else None for name, a, b in STAGES}
            rec["agent_launch_s"], rec["network"] = launches.get(rec["id"], (None, ""))
    result = _result(result, records, machines, slow)
    result.data["cpu_ms_per_job"] = cpu
    result.figures.append(_cpu_figure(cpu, machines))
    result.figures.append(_control_plane_figure(cpu, machines))
    return result


def _launches(ids: list[str]) -> dict[str, tuple[float, str]]:
    """Each job's launch as its agent reported it with the outcome: the start's answer -> its
    command launched (seconds), and how its network came (``ahead``, ``at start``)."""
    from apps.events.models import Event

    rows = Event.objects.filter(job_id__in=ids, data__has_key="launch_ms").values_list("job_id", "data")
    return {
        str(job_id): (float(data["launch_ms"]) / 1000, str(data.get("network") or ""))
        for job_id, data in rows
    }


# The percentiles the saved results keep (docs/bench/tail.json) and tail.png plots: the curve of
# each phase's submit -> first instruction (and submit -> running) and of each stage, not the
# 1,000 jobs behind it.
QUANTILES = (0, 10, 25, 50, 75, 90, 95, 98, 99, 99.5, 99.8, 99.9, 100)
LISTED = 20  # the slowest jobs named one by one; every job above ``slow`` is counted by stage


def _took(rec: dict[str, Any]) -> float:
    """A job's time: submit -> its first instruction (a job that printed none: infinite)."""
    return rec["first_s"] if rec.get("first_s") is not None else float("inf")


def _slowest_stage(rec: dict[str, Any]) -> str:
    stages = {k: v for k, v in rec["stages"].items() if v is not None}
    return max(stages, key=lambda k: stages[k])


def _curve(values: list[float]) -> list[float]:
    return [round(percentile(values, q) * 1000, 1) for q in QUANTILES]


def _curves(records: list[dict[str, Any]], key: str, phases: list[str]) -> dict[str, list[float]]:
    def values(phase: str | None) -> list[float]:
        return [r[key] for r in records if r.get(key) is not None and phase in (None, r["phase"])]

    return {"all": _curve(values(None)), **{ph: _curve(values(ph)) for ph in phases}}


def _burst_needs(ms_per_job: float, machines: int) -> str:
    """The CPU a burst of ``machines`` jobs needs, spread over this machine's cores."""
    import os

    cores = os.cpu_count() or 1
    return f"a burst of {machines}: {ms_per_job * machines / cores:.0f} ms on {cores} cores"


def _cpu_figure(cpu: dict[str, float], machines: int) -> Figure:
    """The CPU a job costs, every process of this machine counted: the budget a burst shares.
    A burst of ``machines`` jobs needs ``machines`` times it, spread over this machine's cores."""
    split = ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if k != "all")
    return Figure(
        "CPU per job, every process",
        cpu["all"],
        "ms",
        "",
        _burst_needs(cpu["all"], machines),
        note=f"from submit to its end, measured over the part's jobs (ms): {split}",
    )


def _control_plane_figure(cpu: dict[str, float], machines: int) -> Figure:
    """The control plane's share of a job's CPU (its programs: :data:`CPU_OWNERS`): what a
    burst shares when its machines are elsewhere (cloud machines: their agents, sandboxes and
    networks run on their own CPUs), against everything here, where local machines share it."""
    owners = [owner for owner, _, _ in CPU_OWNERS]
    ms = round(sum(cpu.get(owner, 0.0) for owner in owners), 1)
    return Figure(
        "CPU per job, the control plane only",
        ms,
        "ms",
        "",
        _burst_needs(ms, machines),
        note=f"{', '.join(owners)}; the rest here (the machines, this bench): {cpu['all'] - ms:.0f} ms",
    )


def _percentile_figure(took: list[float], starts: list[float], q: float, goal: float | None) -> Figure:
    """Submit -> first instruction at percentile ``q`` (100: the slowest), submit -> running beside."""
    value = percentile(took, q)
    return Figure(
        f"warm: submit -> first instruction {'max' if q == 100 else f'p{q:g}'}",
        round(value * 1000, 1),
        "ms",
        f"<= {goal * 1000:.0f} ms" if goal else "",
        f"submit -> running {percentile(starts, q) * 1000:.1f} ms",
        met=value <= goal if goal else None,
    )


def _stage_figure(records: list[dict[str, Any]], name: str) -> Figure:
    values = [r["stages"][name] for r in records if r["stages"].get(name) is not None]
    p99 = percentile(values, 99) * 1000
    return Figure(
        f"stage p50 / p99: {name}", round(percentile(values, 50) * 1000, 1), "ms", "", f"p99 {p99:.1f} ms"
    )


def _kinds(records: list[dict[str, Any]]) -> list[str]:
    return sorted({str(r.get("network") or "") for r in records})


def _agent_launch_figure(records: list[dict[str, Any]]) -> Figure:
    """Of the launch stage, the agent's own share (the start's answer -> its command launched),
    and how the jobs' networks came."""
    values = [r["agent_launch_s"] for r in records if r.get("agent_launch_s") is not None]
    came = ", ".join(
        f"{sum(r.get('network') == k for r in records)} {k or 'unreported'}" for k in _kinds(records)
    )
    return Figure(
        "launch, the agent's share p50 / p99",
        round(percentile(values, 50) * 1000, 1),
        "ms",
        "",
        f"p99 {percentile(values, 99) * 1000:.1f} ms",
        note=f"the start's answer -> the command launched, as the agent reported it; networks: {came}",
    )


def summary(records: list[dict[str, Any]], machines: int, slow: float) -> dict[str, Any]:
    """What the report keeps of the jobs: percentile curves (all jobs, each phase, each stage)
    and the jobs above ``slow`` (to their first instruction) counted by their slowest stage and
    phase."""
    phases = sorted({r["phase"] for r in records})
    over = [r for r in records if _took(r) > slow]
    by_stage: dict[str, dict[str, int]] = {name: dict.fromkeys(phases, 0) for name, _, _ in STAGES}
    for r in over:
        by_stage[_slowest_stage(r)][r["phase"]] += 1
    return {
        "jobs": len(records),
        "machines": machines,
        "slow_s": slow,
        "quantiles": list(QUANTILES),
        "first_ms": _curves(records, "first_s", phases),
        "start_ms": _curves(records, "start_s", phases),
        "stage_ms": {
            name: _curve([r["stages"][name] for r in records if r["stages"].get(name) is not None])
            for name, _, _ in STAGES
        },
        "agent_launch_ms": _curves(records, "agent_launch_s", phases),
        "networks": {kind: sum(r.get("network") == kind for r in records) for kind in _kinds(records)},
        "jobs_per_phase": {ph: sum(r["phase"] == ph for r in records) for ph in phases},
        "slow_by_stage": by_stage,
    }


def _result(result: PartResult, records: list[dict[str, Any]], machines: int, slow: float) -> PartResult:
    took = [_took(r) for r in records]
    starts = [r["start_s"] for r in records]
    over = sorted((r for r in records if _took(r) > slow), key=lambda r: -_took(r))
    missing = sum(r.get("first_s") is None for r in records)
    result.data = summary(records, machines, slow)
    goals = {99.9: 0.25, 100: 1.0}  # the p99.9, and no job above a second
    result.figures += [
        *(_percentile_figure(took, starts, q, goals.get(q)) for q in (50, 99, 99.9, 100)),
        Figure("jobs without a first instruction", float(missing), "", "0", met=missing == 0),
        Figure(
            f"jobs above {slow * 1000:.0f} ms",
            float(len(over)),
            "",
            "each explained",
            note=f"of {len(records)} ({sum(r['phase'] == 'burst' for r in records)} in bursts of {machines})",
        ),
        *(_stage_figure(records, name) for name, _, _ in STAGES),
        _agent_launch_figure(records),
    ]
    if over:
        counts = "; ".join(
            f"{name}: {sum(n.values())} ({', '.join(f'{n[ph]} {ph}' for ph in sorted(n))})"
            for name, n in result.data["slow_by_stage"].items()
            if sum(n.values())
        )
        result.notes.append(
            f"**Jobs above {slow * 1000:.0f} ms** ({len(over)}), by the stage that took the most of their "
            f"time: {counts}. The {min(LISTED, len(over))} slowest:\n\n"
            + "\n".join(
                f"- {_took(r) * 1000:.0f} ms ({r['phase']}) job {r['id']}: {_slowest_stage(r)} "
                f"{r['stages'][_slowest_stage(r)] * 1000:.0f} ms"
                for r in over[:LISTED]
            )
        )
    return result
