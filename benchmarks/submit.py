"""Part 3: submit -> running, on a warm pool member and on a cold (new) machine; and what a
job's sandbox costs at each start.

Real gunicorn, Celery worker and beat; the local driver starts real agent processes. A job
is submitted with the job_submit service (as POST /jobs/ does); the time is its
``started_at`` (the agent reported the command running) minus its ``queued_at``. Warm: the
org has a ready pool of the job's machine type. Cold: another machine type with no pool, so
the scheduler provisions a machine (local boot: a new agent process) for each job.

The sandbox's cost: ``true`` started the way the agent starts a job, as a job uid, interleaved:
through the bubblewrap sandbox (every job now) and through the uid-only supervisor (the Python
supervisor every job went through before the sandbox, and the fallback where bubblewrap cannot
run); spawn to exit, p50 and p99. ``running`` is reported before the command is spawned, so
submit -> running does not include it; started -> finished of the warm ``true`` jobs does.
"""

from __future__ import annotations

import contextlib
from typing import Any

from benchmarks.harness import (
    Figure,
    PartResult,
    Progress,
    job_until,
    job_when,
    median,
    percentile,
    say,
    tenant,
)
from benchmarks.stack import live_stack, wait_quiet
from testkit.builders import job_config
from testkit.processes import wait_for

STAGES = ("admitted", "assigned", "delivered", "started")
POLL = 0.05  # how often a sample looks at the job's row (see _one)


def _one(t: Any, cfg: Any, breakdown: dict[str, list[float]] | None = None) -> float:
    """Submit one job and wait for it; returns submit -> running (seconds). With
    ``breakdown``, appends each stage's share: queued -> admitted (the rest of the submit's
    transaction, then admission), admitted -> assigned (placement), assigned -> delivered (the
    commit, the agent woken, its long poll answered), delivered -> started (the agent confirms)."""
    stamps = ("started_at", "queued_at", "admitted_at", "assigned_at", "delivered_at")
    # What is measured are the rows' own stamps and the job's own clock, not when this process
    # notices them: it looks every 50 ms (it looked every 5 ms), so that its looking (a query,
    # this process's and PostgreSQL's CPU) does not compete with the job's start for the cores.
    job_id, started = job_until(t, cfg, "started_at", stamps, 90, POLL)
    if breakdown is not None:
        start, queued, admitted, assigned, delivered = started
        delivered = delivered or assigned
        for stage, (a, b) in zip(
            STAGES,
            ((queued, admitted), (admitted, assigned), (assigned, delivered), (delivered, start)),
            strict=True,
        ):
            breakdown.setdefault(stage, []).append((b - a).total_seconds())
        agent_ms = _agent_ms(job_id)
        if agent_ms is not None:  # of delivered -> started: the agent's own share
            breakdown.setdefault("agent", []).append(agent_ms / 1000)
    finished = job_when(job_id, "finished_at", ("finished_at",), 60, POLL)
    if breakdown is not None:
        breakdown.setdefault("finished", []).append((finished[0] - started[0]).total_seconds())
        first = _first_instruction(job_id) if cfg.command == FIRST else None
        if first is not None:  # the job's own clock, as its first act (FIRST): same host, same clock
            breakdown.setdefault("first", []).append(first - started[1].timestamp())
            breakdown.setdefault("launched", []).append(first - started[0].timestamp())
    return (started[0] - started[1]).total_seconds()


def _agent_ms(job_id: Any) -> float | None:
    """What the agent reported it spent from the poll's answer to its ``started`` report."""
    from apps.events.models import Event

    data = Event.objects.filter(job_id=job_id, kind="job.started").values_list("data", flat=True).first()
    value = (data or {}).get("agent_ms")
    return float(value) if value is not None else None


# A warm job's command: its first act prints the time (``date``: the shell's first program).
FIRST = "date +%s.%N"


def _first_instruction(job_id: Any) -> float | None:
    """When the job ran its first instruction: the epoch time :data:`FIRST` printed."""
    return first_instructions([job_id]).get(str(job_id))


def first_instructions(job_ids: list[Any], timeout: float = 30) -> dict[str, float]:
    """When each job ran its first instruction (the epoch time :data:`FIRST` printed), once
    every job's output has come (``timeout``); a job whose output is not a time is left out."""
    from django.db.models import Count

    from apps.jobs.models import JobLogChunk

    chunks = JobLogChunk.objects.filter(job_id__in=job_ids, stream="stdout")
    wait_for(
        lambda: chunks.aggregate(n=Count("job_id", distinct=True))["n"] == len(set(job_ids)),
        timeout,
        "the jobs' output",
        POLL,
    )
    out: dict[str, str] = {}
    for job_id, data in chunks.order_by("job_id", "attempt", "seq").values_list("job_id", "data"):
        out[str(job_id)] = out.get(str(job_id), "") + data
    times: dict[str, float] = {}
    for job_id, text in out.items():
        try:
            times[job_id] = float(text.split()[0])
        except (IndexError, ValueError):
            continue
    return times


def sandbox_starts(samples: int = 60, stream_mb: int = 512) -> dict[str, Any]:
    """Spawn-to-exit of ``true`` through each launcher, as the agent starts a job (interleaved),
    measured inside a local machine's sandbox (where `make dev`'s jobs start: its tun device, its
    capabilities): the uid-only supervisor, the bubblewrap sandbox with a network namespace and
    no egress (a loopback only), and the same with the job network (rules, then pasta). Then
    pasta's throughput: a job reads ``stream_mb`` MB from a server on this host's loopback
    through an allowed port (``{"starts": {...}, "loopback_mb_per_s": [...]}``)."""
    import json
    import os
    import shutil
    import socket
    import subprocess
    import sys
    import tempfile
    import threading
    from pathlib import Path

    from catacloud.agent.sandbox import bwrap_path
    from catacloud.providers.machine_sandbox import MachineSandbox, Mount, tun_device

    bwrap = bwrap_path()
    if bwrap is None:
        return {"starts": {}}
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    block = b"\0" * (1 << 20)

    def stream() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                for _ in range(stream_mb):
                    conn.sendall(block)

    threading.Thread(target=stream, daemon=True).start()
    machine = tempfile.mkdtemp(prefix="catacloud-bench-machine-")
    os.chmod(machine, 0o711)
    here = str(Path(__file__).resolve().parent)
    argv = MachineSandbox(
        bwrap=bwrap,
        hostname="bench",
        machine_dir=machine,
        mounts=[Mount(here, here)],
        tun=tun_device(Path(machine)),
    ).argv([sys.executable, os.path.join(here, "job_starts.py"), str(samples), str(server.getsockname()[1])])
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=True).stdout
    finally:
        server.close()
        shutil.rmtree(machine, ignore_errors=True)
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _no_live_machines(t: Any) -> bool:
    from apps.machines.models import MachineInstance

    return not MachineInstance.objects.filter(
        machine_type=t.machine_type,
        status__in=["pending", "provisioning", "warming", "ready", "claimed", "terminating"],
    ).exists()


def _retire_idle(t: Any) -> None:
    from apps.core.errors import InvalidTransition
    from apps.machines.lifecycle import instance_terminate
    from apps.machines.models import MachineInstance

    for pk in MachineInstance.objects.filter(machine_type=t.machine_type, status="ready").values_list(
        "pk", flat=True
    ):
        with contextlib.suppress(InvalidTransition):
            instance_terminate(instance_id=pk, actor="bench", reason="cold sample")


Timings = dict[str, dict[str, list[float]]]


def disk_bounds(stack: Any, samples: int, pool_size: int, progress: Progress) -> Timings:
    """Warm submit -> running, and started -> finished, of ``true`` on two machine types of
    ``disk_gb: 1``, interleaved in one run: one whose machines write their jobs to a file system
    of that size (the kernel's bound, catacloud/agent/disk.py), one whose account turns that off
    (``job_areas: false``: the watchdog alone, as every machine before)."""
    from apps.pools.services import pool_create, pool_refill

    kinds = {"file system": {}, "watchdog alone": {"job_areas": False}}
    setups = []
    for name, config in kinds.items():
        t = tenant(
            name.split()[0],
            kind="local",
            state_dir=stack.state_dir,
            config=config,
            machine_type={"disk_gb": 1},
            max_pool_size=20,
            max_instances=40,
        )
        cfg = job_config(t.org, t.machine_type, "d", "true", reuse="ephemeral")
        pool = pool_create(
            org=t.org, name="d", machine_type=t.machine_type, target_size=pool_size, max_size=20
        )
        pool_refill(pool_id=pool.pk)
        setups.append((name, t, cfg, pool))
    found: Timings = {name: {"submit": []} for name in kinds}
    for name, _, _, pool in setups:
        progress(f"submit: warming a pool of {pool_size} machines ({name})")
        wait_quiet(pool.pk, pool_size)
    for i in range(samples):
        for name, t, cfg, pool in setups if i % 2 else reversed(setups):
            wait_quiet(pool.pk, pool_size)
            progress(f"submit: disk bound, {name}, job {i + 1}/{samples}")
            found[name]["submit"].append(_one(t, cfg, found[name]))
    return found


def run(*, warm: int = 30, cold: int = 4, pool_size: int = 2, progress: Progress = say) -> PartResult:
    from apps.pools.services import pool_create, pool_refill

    result = PartResult(part="submit", title="Submit to running (warm pool vs cold provisioning)")
    warm_s: list[float] = []
    cold_s: list[float] = []
    stages: dict[str, list[float]] = {}
    late: dict[str, list[float]] = {}  # the same jobs, their network made at their start
    reused: dict[str, list[float]] = {}  # the same jobs on a machine kept for reuse
    progress("submit: starting gunicorn, worker, beat")
    with live_stack("submit") as stack:
        tw = tenant("warm", kind="local", state_dir=stack.state_dir, max_pool_size=20, max_instances=40)
        # The same, with each job's network made at its start (the agent's --no-network-ahead):
        # the path before networks were made ahead, interleaved in the same run.
        tl = tenant(
            "late",
            kind="local",
            state_dir=stack.state_dir,
            config={"network_ahead": False},
            max_pool_size=20,
            max_instances=40,
        )
        # A warm machine with nothing to replace: one kept for reuse, idle between its jobs (a
        # pool member a job takes is replaced at that moment, its new agent booting on the same
        # cores as the job's start).
        tr = tenant("reused", kind="local", state_dir=stack.state_dir, max_instances=40)
        tc = tenant("cold", kind="local", state_dir=stack.state_dir, max_instances=40)
        cfg_w = job_config(tw.org, tw.machine_type, "w", FIRST, reuse="ephemeral")
        cfg_l = job_config(tl.org, tl.machine_type, "l", FIRST, reuse="ephemeral")
        cfg_r = job_config(tr.org, tr.machine_type, "r", FIRST, reuse="reuse")
        cfg_c = job_config(tc.org, tc.machine_type, "c", "true", reuse="ephemeral")
        pools = [
            pool_create(org=t.org, name=name, machine_type=t.machine_type, target_size=pool_size, max_size=20)
            for name, t in (("warm", tw), ("late", tl))
        ]
        for pool in pools:
            pool_refill(pool_id=pool.pk)
        progress(f"submit: warming two pools of {pool_size} local machines")
        for pool in pools:
            wait_quiet(pool.pk, pool_size)
        progress("submit: a machine kept for reuse (its first job buys it)")
        _one(tr, cfg_r)
        for i in range(warm):
            for which in (0, 1, 2)[i % 3 :] + (0, 1, 2)[: i % 3]:
                # Each sample starts on a quiet host: the last sample's replacement booted, the
                # reused machine idle again (a pool member's own replacement boots during its
                # job all the same: the claim asks for it).
                for pool in pools:
                    wait_quiet(pool.pk, pool_size)
                wait_for(lambda: _idle(tr), 60, "the reused machine to be idle again", 0.02)
                if which == 0:
                    progress(f"submit: warm job {i + 1}/{warm}")
                    warm_s.append(_one(tw, cfg_w, stages))
                elif which == 1:
                    _one(tl, cfg_l, late)
                else:
                    _one(tr, cfg_r, reused)
        for i in range(cold):
            _retire_idle(tc)  # an idle machine left by a previous sample would make it warm
            wait_for(lambda: _no_live_machines(tc), 60, "the cold machine type to have no machine", 0.02)
            progress(f"submit: cold job {i + 1}/{cold}")
            cold_s.append(_one(tc, cfg_c))
        disks = disk_bounds(stack, warm, pool_size, progress)
    progress("submit: the sandbox's and the job network's cost per job start; pasta's throughput")
    measured = sandbox_starts()
    starts = measured["starts"]
    throughput = measured.get("loopback_mb_per_s") or []
    w50, w95 = percentile(warm_s, 50), percentile(warm_s, 95)
    c50, c95 = percentile(cold_s, 50), percentile(cold_s, 95)
    result.data = {
        "warm_s": warm_s,
        "cold_s": cold_s,
        "pool_size": pool_size,
        "warm_stages_s": stages,
        "network_at_start_stages_s": late,
        "reused_stages_s": reused,
        "job_start_s": starts,
        "loopback_mb_per_s": throughput,
        "disk_bounds_s": disks,
    }
    result.figures += [
        Figure(
            "warm: submit -> running p50",
            round(w50 * 1000),
            "ms",
            "<= 50 ms",
            f"cold {c50 * 1000:.0f} ms",
            round(c50 / w50, 1) if w50 else None,
            w50 <= 0.05,
            "ratio: cold / warm",
        ),
        *(
            Figure(
                f"warm: {name} p50",
                round(percentile(stages.get(stage, [0.0]), 50) * 1000, 1),
                "ms",
                "",
                note=why,
            )
            for stage, name, why in (
                (
                    "admitted",
                    "queued -> admitted",
                    "the rest of the submit's transaction, then admission in it",
                ),
                ("assigned", "admitted -> assigned", "placement: the pool claim, same transaction"),
                (
                    "delivered",
                    "assigned -> delivered",
                    "the commit wakes the agent's long poll, which answers with the job",
                ),
                ("started", "delivered -> started", "the agent confirms the start (its report)"),
                ("agent", "of which the agent's own share", "from the poll's answer to its report sent"),
            )
        ),
        *_first_figures(stages, late, reused),
        Figure(
            "warm: started -> finished p50 (`date`)",
            round(percentile(stages.get("finished", [0.0]), 50) * 1000, 1),
            "ms",
            "",
            note="spawn in the sandbox, exit, output flushed, outcome reported",
        ),
        *(
            Figure(
                f"job start, {name}: p50 / p99",
                round(percentile(values, 50) * 1000, 1),
                "ms",
                "",
                f"p99 {percentile(values, 99) * 1000:.1f} ms",
                note=f"`true` as a job uid, spawn to exit, {len(values)} interleaved runs",
            )
            for name, values in starts.items()
        ),
        *(
            [
                Figure(
                    "job network: a job reads from the host's loopback (allowed port), median",
                    round(median(throughput)),
                    "MB/s",
                    "",
                    f"{min(throughput):.0f}-{max(throughput):.0f} MB/s in {len(throughput)} runs",
                    note="512 MB through pasta's forward of an allowed loopback port",
                )
            ]
            if throughput
            else []
        ),
        *_disk_figures(disks),
        Figure(
            "warm: submit -> running p95",
            round(w95 * 1000),
            "ms",
            "<= 1000 ms",
            f"cold {c95 * 1000:.0f} ms",
            round(c95 / w95, 1) if w95 else None,
            w95 <= 1.0,
        ),
        Figure(
            "cold (empty pool): submit -> running p50",
            round(c50 * 1000),
            "ms",
            "",
            note="local driver: boot = starting an agent process; a cloud boot adds 30-60 s",
        ),
        Figure(
            "samples",
            len(warm_s) + len(cold_s),
            "jobs",
            "",
            f"{len(warm_s)} warm, {len(cold_s)} cold",
            note=f"median warm {median(warm_s) * 1000:.0f} ms",
        ),
    ]
    return result


def _first_figures(
    ahead: dict[str, list[float]], late: dict[str, list[float]], reused: dict[str, list[float]]
) -> list[Figure]:
    """Submit -> the job's first instruction on a warm machine, its network made ahead (the
    default) against made at its start, and on a machine kept for reuse (same run, interleaved)."""
    first, old = ahead.get("first") or [float("nan")], late.get("first") or [float("nan")]
    p50, p99 = percentile(first, 50) * 1000, percentile(first, 99) * 1000
    launched = percentile(ahead.get("launched") or [float("nan")], 50) * 1000
    old_launched = percentile(late.get("launched") or [float("nan")], 50) * 1000
    return [
        Figure(
            "warm: submit -> first instruction p50",
            round(p50, 1),
            "ms",
            "<= 50 ms",
            f"network made at the start {percentile(old, 50) * 1000:.1f} ms",
            round(percentile(old, 50) * 1000 / p50, 2) if p50 else None,
            p50 <= 50,
            note=f"the job's first act prints the time; {len(first)} jobs each, interleaved",
        ),
        Figure(
            "warm: submit -> first instruction p99",
            round(p99, 1),
            "ms",
            "<= 150 ms",
            f"network made at the start {percentile(old, 99) * 1000:.1f} ms",
            None,
            p99 <= 150,
        ),
        *_reused_figures(reused),
        Figure(
            "warm: started -> first instruction p50",
            round(launched, 1),
            "ms",
            "",
            f"network made at the start {old_launched:.1f} ms",
            note="its folder, its sandbox and its network, then the shell runs `date`",
        ),
    ]


def _reused_figures(reused: dict[str, list[float]]) -> list[Figure]:
    """The same jobs on a machine kept for reuse: nothing boots beside them."""
    first = reused.get("first") or [float("nan")]
    p50, p99 = percentile(first, 50) * 1000, percentile(first, 99) * 1000
    stages = ", ".join(
        f"{stage} {percentile(reused.get(stage) or [float('nan')], 50) * 1000:.1f}"
        for stage in (*STAGES, "agent", "launched")
    )
    return [
        Figure(
            "reused machine: submit -> first instruction p50",
            round(p50, 1),
            "ms",
            "<= 50 ms",
            f"p99 {p99:.1f} ms",
            None,
            p50 <= 50,
            note=f"a machine kept for reuse, idle; no replacement boots beside it. Stages p50 (ms): {stages}",
        ),
    ]


def _idle(t: Any) -> bool:
    from apps.machines.models import MachineInstance

    return MachineInstance.objects.filter(machine_type=t.machine_type, status="ready", pool=None).exists()


def _disk_figures(disks: Timings) -> list[Figure]:
    """What the kernel's disk bound costs a warm job, against the watchdog alone (same run)."""
    p50 = {name: percentile(d["submit"], 50) * 1000 for name, d in disks.items()}
    done = {name: percentile(d.get("finished", [0.0]), 50) * 1000 for name, d in disks.items()}
    cost = p50["file system"] - p50["watchdog alone"]
    return [
        Figure(
            "disk bound: warm submit -> running p50, file system vs watchdog alone",
            round(p50["file system"], 1),
            "ms",
            "<= 5 ms more",
            f"watchdog alone {p50['watchdog alone']:.1f} ms ({cost:+.1f} ms)",
            None,
            cost <= 5,
            note=f"disk_gb 1, `true`, {len(disks['file system']['submit'])} jobs each, interleaved",
        ),
        Figure(
            "disk bound: started -> finished p50 (`true`), file system vs watchdog alone",
            round(done["file system"], 1),
            "ms",
            "",
            f"watchdog alone {done['watchdog alone']:.1f} ms",
            note="the watchdog's checks: before the start and at the end of every job",
        ),
    ]
