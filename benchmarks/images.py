"""Part: jobs as container images (``make bench ONLY=images``).

A real registry on loopback (Debian's docker-registry, testkit/registry.py) behind a counting
proxy, images built from busybox-static, the live stack (gunicorn, agent server, worker, beat,
local machines whose agents pull with skopeo and unpack with umoci).

- **Hot**: a warm pool whose ``images`` hold the job's image; plain ``true`` jobs and ``true``
  jobs in the image, interleaved, each on a pool member: submit -> running p50 of both, and
  submit -> finished (the image job's command ran inside the image).
- **Cold**: a 50 MB image (one incompressible layer plus busybox) pulled and unpacked into an
  empty store, as the agent does it (ImageStore.ensure: look the tag up, copy into the store's
  OCI layout, unpack, make its mount points), against ``skopeo copy`` + ``umoci unpack`` alone,
  interleaved runs.
- **Once**: 10 jobs of one image on one reusable machine: how many pulls (events, and blob
  requests the registry served).
- **Simulator**: the week-long CI trace (catacloud/data/traces/ci-week.csv) with each
  configuration an image pulled in ``PULL_SECONDS``: the wait of the ``cost`` and ``speed``
  policies, plain, with images on cold pools, with image-hot pools.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import Figure, PartResult, Progress, job_until, median, percentile, say, tenant
from benchmarks.stack import live_stack, wait_quiet
from testkit.builders import job_config
from testkit.processes import wait_for
from testkit.registry import FaultyProxy, Registry, build_image, push

PULL_SECONDS = 30.0  # an image pull on a cloud machine (a few hundred MB), for the simulator
SIM_POLICIES = ("cost", "speed", "pool:3:cost", "pool:3:speed", "pool:6:cost", "pool:6:speed")


def _job(t: Any, cfg: Any) -> tuple[float, float]:
    """Submit one job, wait for its end: (submit -> running, submit -> finished) seconds."""
    job_id, (queued, started, finished, status) = job_until(
        t, cfg, "finished_at", ("queued_at", "started_at", "finished_at", "status"), 120
    )
    assert status == "succeeded", f"bench job {job_id} {status}"
    return (started - queued).total_seconds(), (finished - queued).total_seconds()


def cold_pulls(registry: Registry, reference: str, runs: int) -> dict[str, list[float]]:
    """The 50 MB image into an empty store, the agent's way and the tools' alone, interleaved."""
    from catacloud.agent.images import ImageStore, find_tools
    from catacloud.agent.reference import parse

    tools = find_tools()
    assert not isinstance(tools, str), tools
    ours: list[float] = []
    alone: list[float] = []
    never = threading.Event()
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="catacloud-bench-store-") as folder:
            store = ImageStore(
                os.path.join(folder, "store"), tools=tools, mount_dirs=["/var/lib/catacloud/work"]
            )
            t0 = time.perf_counter()
            got = store.ensure(parse(reference), auth=None, deadline=time.monotonic() + 600, cancel=never)
            ours.append(time.perf_counter() - t0)
            assert got.pulled
        with tempfile.TemporaryDirectory(prefix="catacloud-bench-tools-") as folder:
            t0 = time.perf_counter()
            subprocess.run(
                [
                    "skopeo",
                    "copy",
                    "--quiet",
                    "--src-tls-verify=false",
                    f"docker://{reference}",
                    f"oci:{folder}/oci:x",
                ],
                check=True,
                capture_output=True,
            )
            subprocess.run(
                ["umoci", "unpack", "--rootless", "--image", f"{folder}/oci:x", f"{folder}/bundle"],
                check=True,
                capture_output=True,
            )
            alone.append(time.perf_counter() - t0)
    return {"ours_s": ours, "tools_s": alone}


def simulated() -> list[dict[str, Any]]:
    from catacloud.simulate import Params, load_trace, simulate

    trace = load_trace(Path(__file__).resolve().parents[1] / "catacloud" / "data" / "traces" / "ci-week.csv")
    rows = []
    for policy in SIM_POLICIES:
        for label, params in (
            ("no image", Params()),
            ("images, cold pools", Params(pull_seconds=PULL_SECONDS)),
            ("images, image-hot pools", Params(pull_seconds=PULL_SECONDS, pool_images=True)),
        ):
            result = simulate(trace, policy, params, until_done=True)
            rows.append(
                {
                    "policy": policy,
                    "case": label,
                    "p50": round(result.wait_p50, 1),
                    "p95": round(result.wait_p95, 1),
                    "mean": round(sum(result.waits) / len(result.waits), 1),
                    "cost": float(result.cost),
                }
            )
    return rows


def run(*, samples: int = 20, cold_runs: int = 5, jobs: int = 10, progress: Progress = say) -> PartResult:
    from apps.events.models import Event
    from apps.pools.services import pool_create, pool_refill

    result = PartResult(part="images", title="Jobs as container images (hot, cold, once)")
    work = Path(tempfile.mkdtemp(prefix="catacloud-bench-images-"))
    plain_run: list[float] = []
    image_run: list[float] = []
    plain_end: list[float] = []
    image_end: list[float] = []
    try:
        with Registry(work / "registry") as registry:
            proxy = FaultyProxy(registry.host).start()
            try:
                progress("images: building and pushing the images (busybox-static; 50 MB)")
                small = build_image(work / "img", "small")
                big = build_image(work / "img", "big", files={"/data/blob.bin": os.urandom(50 * 10**6)})
                push(small, f"{registry.host}/bench/small:1")
                push(big, f"{registry.host}/bench/big:1")
                hot_ref = f"{proxy.host}/bench/small:1"
                progress(f"images: cold pulls of the 50 MB image, {cold_runs} interleaved runs")
                cold = cold_pulls(registry, f"{registry.host}/bench/big:1", cold_runs)
                progress("images: starting gunicorn, agent server, worker, beat")
                with live_stack("images") as stack:
                    t = tenant(
                        "images", kind="local", state_dir=stack.state_dir, max_pool_size=20, max_instances=40
                    )
                    cfg_plain = job_config(t.org, t.machine_type, "plain", "true", reuse="ephemeral")
                    cfg_image = job_config(
                        t.org, t.machine_type, "image", "true", reuse="ephemeral", image=hot_ref
                    )
                    pool = pool_create(
                        org=t.org,
                        name="hot",
                        machine_type=t.machine_type,
                        target_size=2,
                        max_size=20,
                        images=[hot_ref],
                    )
                    pool_refill(pool_id=pool.pk)
                    wait_quiet(pool.pk, 2, timeout=180)
                    for i in range(samples):
                        for cfg, runs, ends in (
                            (cfg_plain, plain_run, plain_end),
                            (cfg_image, image_run, image_end),
                        ):
                            wait_quiet(pool.pk, 2, timeout=180)
                            ran, ended = _job(t, cfg)
                            runs.append(ran)
                            ends.append(ended)
                        progress(f"images: hot sample {i + 1}/{samples}")
                    progress(f"images: {jobs} jobs of one image on one machine")
                    once = tenant("once", kind="local", state_dir=stack.state_dir, max_instances=1)
                    cfg_once = job_config(
                        once.org, once.machine_type, "once", "true", reuse="reuse", image=hot_ref
                    )
                    blobs = proxy.blob_gets()
                    from apps.jobs.submission import job_submit

                    submitted = [
                        job_submit(org=once.org, config=cfg_once, actor="bench").pk for _ in range(jobs)
                    ]
                    wait_for(
                        lambda: (
                            Event.objects.filter(job_id__in=submitted, kind="job.finished").count() == jobs
                        ),
                        300,
                        "the jobs of one image to end",
                        0.1,
                    )
                    pulls = Event.objects.filter(job_id__in=submitted, kind="job.image_pulled").count()
                    cached = Event.objects.filter(job_id__in=submitted, kind="job.image_cached").count()
                    machines = len(
                        set(
                            Event.objects.filter(job_id__in=submitted, kind="job.started").values_list(
                                "instance_id", flat=True
                            )
                        )
                    )
                    once_blobs = proxy.blob_gets() - blobs
            finally:
                proxy.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress("images: the simulator on the week-long trace")
    sim = simulated()

    p_plain, p_image = percentile(plain_run, 50), percentile(image_run, 50)
    e_plain, e_image = percentile(plain_end, 50), percentile(image_end, 50)
    ours, alone = median(cold["ours_s"]), median(cold["tools_s"])
    result.data = {
        "plain_running_s": plain_run,
        "image_running_s": image_run,
        "plain_finished_s": plain_end,
        "image_finished_s": image_end,
        "cold": cold,
        "once": {
            "jobs": jobs,
            "pulls": pulls,
            "cached": cached,
            "machines": machines,
            "blob_gets": once_blobs,
        },
        "simulator": sim,
        "pull_seconds": PULL_SECONDS,
    }
    diff_ms = (p_image - p_plain) * 1000
    result.figures += [
        Figure(
            "hot: image job submit -> running p50",
            round(p_image * 1000, 1),
            "ms",
            "within 20 ms of a plain job's",
            f"plain {p_plain * 1000:.1f} ms; difference {diff_ms:+.1f} ms",
            None,
            diff_ms <= 20,
            f"{samples} interleaved pairs, each on a pool member holding the image",
        ),
        Figure(
            "hot: image job submit -> finished p50 (`true` in the image)",
            round(e_image * 1000, 1),
            "ms",
            "",
            f"plain {e_plain * 1000:.1f} ms",
            note="the store's lookup, the sandbox on the image's root, the command, the report",
        ),
        Figure(
            "cold: 50 MB image pulled and unpacked (agent's store)",
            round(ours, 2),
            "s",
            "<= 1.2x skopeo copy + umoci unpack alone",
            f"tools alone {alone:.2f} s",
            round(ours / alone, 2) if alone else None,
            bool(alone) and ours <= 1.2 * alone,
            f"medians of {len(cold['ours_s'])} interleaved runs from the loopback registry",
        ),
        Figure(
            f"{jobs} jobs of one image on one machine: pulls",
            pulls,
            "",
            "1",
            f"{cached} found it held, on {machines} machine(s)",
            None,
            pulls == 1,
            note="job.image_pulled and job.image_cached events of the 10 jobs",
        ),
    ]
    for row in sim:
        if row["case"] != "no image":
            continue
        cold_row = next(r for r in sim if r["policy"] == row["policy"] and r["case"] == "images, cold pools")
        hot_row = next(
            r for r in sim if r["policy"] == row["policy"] and r["case"] == "images, image-hot pools"
        )
        result.figures.append(
            Figure(
                f"simulated week, {row['policy']}: mean / p95 wait with image-hot pools",
                hot_row["mean"],
                "s",
                "",
                f"cold pools {cold_row['mean']} / {cold_row['p95']} s; "
                f"no images {row['mean']} / {row['p95']} s",
                note=f"p95 {hot_row['p95']} s; pull {PULL_SECONDS:.0f} s per image a machine lacks",
            )
        )
    return result
