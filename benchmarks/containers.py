"""Part: containers in jobs (``make bench ONLY=containers``).

A real registry on loopback (Debian's docker-registry, testkit/registry.py) holding a busybox
image, the live stack (gunicorn, agent server, worker, beat) and local machines of two machine
types alike but for ``containers`` (both allowing the registry's port), each a warm pool.

- **A job's start**: `date` jobs on a member of each pool, interleaved; submit -> the job's first
  instruction (the time its command prints first) and submit -> finished. A containers job's
  shell starts its own rootless Podman before the command (catacloud/agent/containers.py): the
  difference of the two first-instruction medians is what the engine's start costs every job.
- **docker run**: in each of ``jobs`` jobs on the containers pool, ``docker run --rm busybox
  true`` once into the job's empty engine (the pull from the registry and the run) and then
  ``runs`` times more with the image cached, each timed inside the job.
- **Where a pull comes from**: ``docker pull`` of a 64 MB image (one layer of random bytes) into
  the job's empty engine, timed inside each of ``jobs`` jobs, three ways in turn: straight from
  the registry (the organization holds no credentials for it, the machine's store no image);
  through the agent's mirror (the organization's credentials set for the registry:
  catacloud/agent/registry_proxy.py relays every byte); and seeded (a job ran inside the image
  first, so the machine's store holds its layer, which the mirror serves from there).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import Figure, PartResult, Progress, job_until, median, percentile, say, tenant
from benchmarks.stack import live_stack, wait_quiet
from testkit.builders import job_config
from testkit.processes import wait_for
from testkit.registry import Registry, build_image, push

FIRST = 'echo "FIRST $(date +%s.%N)"'
# One `docker pull` into the job's empty engine, timed by its shell in microseconds.
PULL = (
    "s=$(date +%s%N); docker pull -q {image} >/dev/null || exit 1; "
    'e=$(date +%s%N); echo "PULL $(( (e - s) / 1000 ))"'
)
BIG_BYTES = 64 * 2**20
# Each `docker run` timed by the job's own shell, in microseconds (the first pulls the image).
DOCKER_RUNS = (
    "for i in $(seq 0 {runs}); do s=$(date +%s%N); "
    "docker run --rm {image} true >/dev/null || exit 1; "
    'e=$(date +%s%N); echo "RUN $i $(( (e - s) / 1000 ))"; done'
)


def _output(job_id: Any, streams: tuple[str, ...] = ("stdout",)) -> str:
    """The job's output as its agent streamed it (the last chunk may trail the finished row)."""
    from apps.jobs.models import JobLogChunk

    chunks = JobLogChunk.objects.filter(job_id=job_id, stream__in=streams)
    return "".join(chunks.values_list("data", flat=True))


def _run(t: Any, cfg: Any, mark: str) -> tuple[dict[str, float], str, Any]:
    """Submit one job of ``cfg``, wait for its end and for its output line ``mark``: its
    timestamps (seconds from its submit), its output and its id."""
    job_id, (queued, started, finished, status) = job_until(
        t, cfg, "finished_at", ("queued_at", "started_at", "finished_at", "status"), 300
    )
    if status != "succeeded":
        time.sleep(2)  # its last output
        raise RuntimeError(f"bench job {job_id} {status}: {_output(job_id, ('stdout', 'stderr'))[-3000:]}")

    def printed() -> str:
        out = _output(job_id)
        return out if mark in out else ""

    text = wait_for(printed, 30, f"job {job_id}'s output")
    base = queued.timestamp()
    stamps = {"running": started.timestamp() - base, "finished": finished.timestamp() - base}
    for line in text.splitlines():
        if line.startswith("FIRST "):
            stamps["first"] = float(line.split()[1]) - base
    return stamps, text, job_id


def _machine_of(job_id: Any) -> str:
    from apps.jobs.models import Job

    return str(Job.objects.get(pk=job_id).instance_id)


def _retire_idle_but(t: Any, keep: str) -> None:
    """Terminate the type's idle machines kept for reuse, all but ``keep``."""
    from apps.core.errors import InvalidTransition
    from apps.machines.choices import InstanceStatus
    from apps.machines.lifecycle import instance_terminate
    from apps.machines.models import MachineInstance

    idle = MachineInstance.objects.filter(
        org=t.org, machine_type=t.machine_type, pool=None, status=InstanceStatus.READY
    ).exclude(pk=keep)
    for pk in idle.values_list("pk", flat=True):
        with contextlib.suppress(InvalidTransition):  # claimed meanwhile
            instance_terminate(instance_id=pk, actor="bench", reason="not the image's holder", only_idle=True)


def _pool(t: Any, name: str) -> Any:
    from apps.pools.services import pool_create, pool_refill

    pool = pool_create(org=t.org, name=name, machine_type=t.machine_type, target_size=1, max_size=4)
    pool_refill(pool_id=pool.pk)
    return pool


def run(*, samples: int = 20, jobs: int = 5, runs: int = 20, progress: Progress = say) -> PartResult:
    from apps.machines.services import machine_type_update

    result = PartResult(part="containers", title="Containers in jobs (a job's start, docker run)")
    work = Path(tempfile.mkdtemp(prefix="catacloud-bench-containers-"))
    starts: dict[str, dict[str, list[float]]] = {
        kind: {"running": [], "first": [], "finished": []} for kind in ("plain", "containers")
    }
    first_runs: list[float] = []
    cached_runs: list[float] = []
    pulls: dict[str, list[float]] = {}
    try:
        with Registry(work / "registry") as registry:
            progress("containers: building and pushing busybox")
            push(build_image(work / "img", "1"), f"{registry.host}/bench/busybox:1")
            image = f"{registry.host}/bench/busybox:1"
            big = f"{registry.host}/bench/big:1"
            push(build_image(work / "big", "1", files={"/big.bin": os.urandom(BIG_BYTES)}), big)
            progress("containers: starting gunicorn, agent server, worker, beat")
            with live_stack("containers") as stack:
                tenants = {}
                for kind in ("plain", "containers"):
                    t = tenant(
                        kind, kind="local", state_dir=stack.state_dir, max_pool_size=8, max_instances=8
                    )
                    machine_type_update(
                        machine_type=t.machine_type,
                        actor="bench",
                        containers=kind == "containers",
                        network={"allow": [registry.host]},
                    )
                    t.machine_type.refresh_from_db()
                    tenants[kind] = t
                configs = {
                    kind: job_config(t.org, t.machine_type, f"{kind}-start", FIRST, reuse="reuse")
                    for kind, t in tenants.items()
                }
                pools = {kind: _pool(t, kind) for kind, t in tenants.items()}
                for i in range(samples):
                    for kind, t in tenants.items():
                        wait_quiet(pools[kind].pk, 1, timeout=180)
                        stamps, _, _ = _run(t, configs[kind], "FIRST ")
                        for key, values in starts[kind].items():
                            values.append(stamps[key])
                    progress(f"containers: start sample {i + 1}/{samples}")
                t = tenants["containers"]
                docker = job_config(
                    t.org,
                    t.machine_type,
                    "docker-run",
                    DOCKER_RUNS.format(runs=runs, image=image),
                    reuse="reuse",
                )
                for i in range(jobs):
                    wait_quiet(pools["containers"].pk, 1, timeout=180)
                    _, text, _ = _run(t, docker, f"RUN {runs} ")
                    timed = {
                        int(p[1]): int(p[2]) / 1e6
                        for p in (line.split() for line in text.splitlines())
                        if p[:1] == ["RUN"]
                    }
                    first_runs.append(timed[0])
                    cached_runs += [timed[k] for k in sorted(timed) if k > 0]
                    progress(f"containers: docker run job {i + 1}/{jobs}")
                pulls = _pull_sources(t, pools["containers"], registry.host, big, jobs, progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _result(result, starts, first_runs, cached_runs, pulls, samples=samples, jobs=jobs)


def _pull_sources(
    t: Any, pool: Any, registry: str, image: str, jobs: int, progress: Progress
) -> dict[str, list[float]]:
    """Seconds of ``docker pull image`` in ``jobs`` jobs each: direct, through the mirror, seeded."""
    from apps.orgs.registries import registry_credential_set

    pull = job_config(t.org, t.machine_type, "docker-pull", PULL.format(image=image), reuse="reuse")
    times: dict[str, list[float]] = {"direct": [], "mirror": [], "seeded": []}
    holder = None
    for way in times:
        if way == "mirror":  # the open registry takes any login; the mirror adds it all the same
            registry_credential_set(org=t.org, registry=registry, username="bench", password="bench-secret")
        if way == "seeded":  # the machine's store pulls the image for a job that runs inside it
            inside = job_config(t.org, t.machine_type, "in-big", "echo inside", reuse="reuse", image=image)
            wait_quiet(pool.pk, 1, timeout=180)
            _, _, job_id = _run(t, inside, "inside")
            holder = _machine_of(job_id)
        for i in range(jobs):
            # A seeded pull counts only on the machine holding the image. Placement prefers an idle
            # machine that last ran the same configuration (an earlier direct or mirror pull's),
            # so those are retired first; the pool's member is taken only when no idle machine
            # is left. A run elsewhere all the same pulled directly and is not counted.
            for _ in range(5):
                wait_quiet(pool.pk, 1, timeout=180)
                if holder is not None:
                    _retire_idle_but(t, holder)
                _, text, job_id = _run(t, pull, "PULL ")
                if way != "seeded" or _machine_of(job_id) == holder:
                    break
            else:
                raise RuntimeError("5 seeded pulls in a row ran on machines not holding the image")
            times[way] += [
                int(line.split()[1]) / 1e6 for line in text.splitlines() if line.startswith("PULL ")
            ]
            progress(f"containers: docker pull {way} {i + 1}/{jobs}")
    return times


def _result(
    result: PartResult,
    starts: dict[str, dict[str, list[float]]],
    first_runs: list[float],
    cached_runs: list[float],
    pulls: dict[str, list[float]],
    *,
    samples: int,
    jobs: int,
) -> PartResult:
    def ms(values: list[float], q: float = 50) -> float:
        return round(percentile(values, q) * 1000, 1)

    plain, ctr = starts["plain"], starts["containers"]
    engine_ms = (median(ctr["first"]) - median(plain["first"])) * 1000
    result.data = {"starts": starts, "first_run_s": first_runs, "cached_run_s": cached_runs, "pull_s": pulls}
    result.figures += [
        Figure(
            "job submit -> first instruction p50, containers type",
            ms(ctr["first"]),
            "ms",
            "",
            f"without the setting {ms(plain['first'])} ms",
            note=f"{samples} interleaved pairs, each on a warm pool member; p99 {ms(ctr['first'], 99)} ms",
        ),
        Figure(
            "the job's engine start (difference of the two medians)",
            round(engine_ms, 1),
            "ms",
            "",
            f"submit -> running p50 {ms(ctr['running'])} ms with, {ms(plain['running'])} ms without",
            note="rootless Podman's API service started by the job's shell, waited for before the command",
        ),
        Figure(
            "docker run --rm busybox true, image cached: p50",
            ms(cached_runs),
            "ms",
            "",
            f"p99 {ms(cached_runs, 99)} ms",
            note=f"{len(cached_runs)} runs in {jobs} jobs, timed inside each job",
        ),
        Figure(
            "docker run --rm busybox true, first in a job (pull + run): p50",
            ms(first_runs),
            "ms",
            "",
            f"max {round(max(first_runs, default=float('nan')) * 1000, 1)} ms",
            note=f"{len(first_runs)} jobs, each engine empty at its start; the registry on loopback",
        ),
        *(
            Figure(
                f"docker pull of a {BIG_BYTES // 2**20} MiB image, {way}: p50",
                ms(pulls[way]),
                "ms",
                "",
                f"max {round(max(pulls[way], default=float('nan')) * 1000, 1)} ms",
                note=f"{len(pulls[way])} jobs, each engine empty at its start; {how}",
            )
            for way, how in (
                ("direct", "from the registry on loopback, no credentials, no image on the machine"),
                ("mirror", "through the agent's mirror, which adds the organization's credentials"),
                ("seeded", "the machine's store holds the layer: the mirror serves it from there"),
            )
            if pulls.get(way)
        ),
    ]
    return result
