"""Part `hosts`: enrolled hosts (machines the user owns) beside bought ones.

Real gunicorn, agent server, Celery worker and beat. Three parts, one run:

- **Enrolment to first job**: a job of an enrolled host type is submitted while no host exists
  (it waits, saying so); then a real ``catacloud host`` process starts with an enrolment token
  and the clock runs from its start to the host's enrolment, its first slot (a sandboxed machine
  with its own agent, made on the host) and the job running in it.
- **A job's start on a host slot** against a warm pool machine of the local provider, in the
  same run, interleaved: submit -> running of ``true`` on a warm pool of slots (a pool of the
  host type keeps slots warm) and on a warm pool of bought (local) machines. Goal: the host
  slot within 10 ms of the warm machine at p50.
- **A hundred hosts**: simulated (benchmarks/host_fleet.py: the real host Agent API over HTTP,
  every host long-polling its exchange); slots are requested at a steady rate through the real
  services and worker, and the time from a slot's request to its host's order is measured,
  with the exchanges' errors and the slots per host against its capacity.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from decimal import Decimal
from typing import Any

from benchmarks.harness import Figure, PartResult, Progress, percentile, say, tenant
from benchmarks.stack import live_stack, wait_quiet
from benchmarks.submit import _one
from testkit.builders import job_config
from testkit.processes import ROOT, Proc, stop_local_machines, wait_for

SLOT = {"price_per_hour": Decimal(0), "billing_increment_seconds": 1}


def _host(stack: Any, name: str, token: str, cpus: int) -> Proc:
    folder = stack.tmp / f"host-{name}"
    folder.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CATACLOUD_ENROLMENT_TOKEN": token}
    args = [sys.executable, "-m", "catacloud.agent", "host", "--url", stack.agent_url]
    args += ["--state-file", str(folder / "host.json"), "--slots-dir", str(folder / "slots")]
    args += ["--cpus", str(cpus), "--memory-mb", "16384"]
    return Proc(f"host-{name}", args, env, folder / "host.log")


def _first_job(stack: Any, th: Any, token: str) -> tuple[dict[str, float], Proc]:
    """Submit, then start a host: seconds from the host's start to its enrolment, its first slot
    ready and the job running."""
    from apps.jobs.submission import job_submit
    from apps.machines.models import Host, MachineInstance

    cfg = job_config(th.org, th.machine_type, "first", "true", reuse="reuse")
    job = job_submit(org=th.org, config=cfg, actor="bench")
    time.sleep(1.0)  # it waits: no host yet
    started = time.time()
    proc = _host(stack, "first", token, cpus=2)
    host = wait_for(lambda: Host.objects.first(), 60, "the host to enroll", 0.01)
    slot = wait_for(
        lambda: MachineInstance.objects.filter(host=host, ready_at__isnull=False).first(),
        90,
        "its slot",
        0.01,
    )
    job.refresh_from_db()
    wait_for(
        lambda: job.__class__.objects.filter(pk=job.pk, started_at__isnull=False).exists(),
        90,
        "the job",
        0.01,
    )
    job.refresh_from_db()
    return {
        "enrolled": host.enrolled_at.timestamp() - started,
        "slot_ready": slot.ready_at.timestamp() - started,
        "running": job.started_at.timestamp() - started,
    }, proc


def _warm_pair(th: Any, tw: Any, samples: int, pool_size: int, progress: Progress) -> dict[str, list[float]]:
    """Interleaved submit -> running on a warm pool of host slots and of bought machines."""
    from apps.pools.services import pool_create, pool_refill

    setups = []
    for name, t in (("host slot", th), ("warm machine", tw)):
        cfg = job_config(t.org, t.machine_type, "w", "true", reuse="ephemeral")
        pool = pool_create(
            org=t.org, name="w", machine_type=t.machine_type, target_size=pool_size, max_size=10
        )
        pool_refill(pool_id=pool.pk)
        setups.append((name, t, cfg, pool))
    for name, _, _, pool in setups:
        progress(f"hosts: warming a pool of {pool_size} ({name})")
        wait_quiet(pool.pk, pool_size, timeout=120)
    found: dict[str, list[float]] = {name: [] for name, *_ in setups}
    for i in range(samples):
        for name, t, cfg, pool in setups if i % 2 else reversed(setups):
            wait_quiet(pool.pk, pool_size, timeout=120)
            progress(f"hosts: {name}, job {i + 1}/{samples}")
            found[name].append(_one(t, cfg))
    return found


def _simulated(stack: Any, hosts: int, window: float, rate: float, progress: Progress) -> dict[str, Any]:
    """Slots requested at ``rate`` a second on ``hosts`` simulated hosts: request -> order."""
    from apps.machines.hosts import enrolment_token_create
    from apps.machines.lifecycle import instance_request

    ts = tenant("sim", kind="hosts", cpus=1, machine_type=SLOT, max_instances=100_000)
    _, token = enrolment_token_create(provider_account=ts.account, org=ts.org, max_uses=hosts)
    out = stack.tmp / "host-fleet.json"
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.host_fleet",
            "--url",
            stack.agent_url,
            "--token",
            token,
            "--hosts",
            str(hosts),
            "--cpus",
            "4",
            "--window",
            str(window),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert sim.stdout is not None
    for line in sim.stdout:
        if line.strip() == "READY":
            break
    progress(f"hosts: {hosts} simulated hosts enrolled; requesting slots for {window * 0.7:.0f} s")
    requested: dict[str, float] = {}
    end = time.monotonic() + window * 0.7
    while time.monotonic() < end:
        instance = instance_request(org=ts.org, machine_type=ts.machine_type, reason="bench")
        requested[str(instance.pk)] = time.time()
        time.sleep(1.0 / rate)
    sim.wait(timeout=window + 60)
    result = json.loads(out.read_text())
    orders = result["orders"]
    latency = [orders[i][0] - at for i, at in requested.items() if i in orders]
    per_host: dict[int, int] = {}
    for _, host in orders.values():
        per_host[host] = per_host.get(host, 0) + 1
    return {
        "requested": len(requested),
        "ordered": len(latency),
        "latency_s": latency,
        "errors": result["errors"],
        "exchanges": result["exchanges"],
        "most_on_a_host": max(per_host.values(), default=0),
    }


def run(
    *,
    samples: int = 30,
    pool_size: int = 2,
    hosts: int = 100,
    window: float = 20.0,
    rate: float = 20.0,
    progress: Progress = say,
) -> PartResult:
    from apps.machines.hosts import enrolment_token_create

    result = PartResult(part="hosts", title="Enrolled hosts: enrolment to first job, slots vs warm machines")
    procs: list[Proc] = []
    with live_stack("hosts") as stack:
        try:
            th = tenant("owned", kind="hosts", cpus=1, machine_type=SLOT, max_pool_size=20, max_instances=100)
            tw = tenant(
                "bought", kind="local", state_dir=stack.state_dir, cpus=1, max_pool_size=20, max_instances=40
            )
            _, token = enrolment_token_create(provider_account=th.account, org=th.org, max_uses=3)
            progress("hosts: a job waits; a host starts, enrolls, starts a slot, runs it")
            first, proc = _first_job(stack, th, token)
            procs.append(proc)
            procs.append(_host(stack, "second", token, cpus=2))
            warm = _warm_pair(th, tw, samples, pool_size, progress)
            sim = _simulated(stack, hosts, window, rate, progress)
        finally:
            for proc in procs:
                proc.stop()
            for proc in procs:
                stop_local_machines(stack.tmp / f"{proc.name}" / "slots", stop_timeout=1, ignore_errors=True)
    result.data = {"first": first, "warm_s": warm, "simulated": {k: v for k, v in sim.items()}}
    result.figures = figures(first, warm, sim, hosts)
    return result


def figures(
    first: dict[str, float], warm: dict[str, list[float]], sim: dict[str, Any], hosts: int
) -> list[Figure]:
    slot, machine = (percentile(warm[k], 50) * 1000 for k in ("host slot", "warm machine"))
    latency = sim["latency_s"] or [0.0]
    return [
        Figure(
            "host slot: warm submit -> running p50, vs a warm pool machine",
            round(slot, 1),
            "ms",
            "within 10 ms",
            f"warm machine {machine:.1f} ms ({slot - machine:+.1f} ms)",
            None,
            slot - machine <= 10,
            note=f"`true`, {len(warm['host slot'])} jobs each, interleaved",
        ),
        Figure("enrolment to first job: host start -> enrolled", round(first["enrolled"], 2), "s", ""),
        Figure(
            "enrolment to first job: host start -> its first slot ready",
            round(first["slot_ready"], 2),
            "s",
            "",
        ),
        Figure(
            "enrolment to first job: host start -> the waiting job running",
            round(first["running"], 2),
            "s",
            "",
            note="the slot is a sandboxed machine with its own agent, made on the host",
        ),
        Figure(
            f"{hosts} simulated hosts: slot request -> its host's order p50",
            round(percentile(latency, 50) * 1000, 1),
            "ms",
            "",
            f"p99 {percentile(latency, 99) * 1000:.0f} ms",
            note=f"{sim['ordered']}/{sim['requested']} ordered, {sim['errors']} exchange errors, "
            f"at most {sim['most_on_a_host']} slots on a host of 4 cpus",
        ),
    ]
