"""Part `selection`: machines chosen among candidates, capacity errors, spot.

- **Capacity error to the next candidate**: a live stack (gunicorn, agent server, Celery worker
  and beat) against the fake Hetzner API (tests/fakes/hetzner_api.py, driven by the real
  ``hcloud`` client in the worker). A machine type ``cx23`` at fsn1 lists ``cx23`` at nbg1 as its
  alternative; fsn1 is sold out (``resource_unavailable``). Each sample submits a job: the
  worker's create at fsn1 is refused, the type cools down, the job falls over, and the worker
  creates at nbg1. The figure is the time from the refused create (the fake's clock) to the
  next candidate's create (the same clock). Between samples the cool-down is ended by hand.
- **A week on spot against on-demand** (catacloud.simulate, the real placement policy): the
  same generated week of CI jobs, EC2 prices from deploy/catalog/aws.yaml (m7i.large on-demand
  0.1008/h, spot 0.04/h, billed per second, 60 s minimum), spot with 5 % of buys refused (each
  falls over to on-demand for a 180 s cool-down) and 0.05 interruptions per spot machine-hour,
  jobs checkpointing every 300 s: cost saved and the wait it adds.
"""

from __future__ import annotations

import time
from decimal import Decimal
from pathlib import Path
from typing import Any

from benchmarks.harness import Figure, PartResult, Progress, percentile, say, tenant
from benchmarks.stack import live_stack
from testkit.builders import granted_type, job_config, provider_account
from testkit.processes import wait_for

ON_DEMAND, SPOT = Decimal("0.1008"), Decimal("0.04")


def run(*, samples: int = 20, days: int = 7, progress: Progress = say) -> PartResult:
    result = PartResult(
        part="selection", title="Selection: capacity errors fall over, spot against on-demand"
    )
    delays = _capacity_errors(samples, progress)
    p50, p99 = percentile(delays, 50), percentile(delays, 99)
    result.data["delays_s"] = delays
    result.figures += [
        Figure(
            "capacity error -> next candidate's create p50",
            round(p50 * 1000),
            "ms",
            "<= 5000 ms",
            met=p50 <= 5,
        ),
        Figure(
            "capacity error -> next candidate's create p99",
            round(p99 * 1000),
            "ms",
            "<= 5000 ms",
            met=p99 <= 5,
            note=f"{len(delays)} capacity errors",
        ),
    ]
    progress(f"selection: simulating {days} day(s) on-demand and spot")
    result.figures += _spot_week(days, result)
    return result


def _capacity_errors(samples: int, progress: Progress) -> list[float]:
    from apps.jobs.models import Job
    from apps.jobs.submission import job_cancel, job_submit
    from apps.machines.lifecycle import instance_terminate
    from apps.machines.models import MachineInstance, MachineType
    from tests.fakes.hetzner_api import FakeHetzner

    token = "bench-hetzner-token"
    delays: list[float] = []
    with FakeHetzner(token=token, action_polls=1) as fake:
        wheels = Path(fake_wheels())
        extra = {"CATACLOUD_CAPACITY_COOLDOWN": "600", "CATACLOUD_AGENT_WHEEL": str(wheels)}
        progress("selection: starting gunicorn, worker, beat and the fake Hetzner API")
        with live_stack("selection", **extra):
            t = tenant("select", max_instances=1000)
            account = provider_account(
                "hetzner",
                f"hz-{t.org.slug}",
                {"api_endpoint": fake.url, "location": "fsn1", "poll_interval": 0.05, "timeout": 5},
                credentials={"token": token},
            )
            common: dict[str, Any] = {"server_type": "cx23", "image": "ubuntu-24.04", "memory_mb": 4096}
            grant = {"max_instances": 1000, "max_concurrent_jobs": 1000}
            first, _ = granted_type(
                t.org, account, f"{t.org.slug}-fsn1", location="fsn1", price_per_hour=Decimal("0.006"),
                alternatives=[f"{t.org.slug}-nbg1"], grant=grant, **common,
            )  # fmt: skip
            second, _ = granted_type(
                t.org, account, f"{t.org.slug}-nbg1", location="nbg1", price_per_hour=Decimal("0.0065"),
                grant=grant, **common,
            )  # fmt: skip
            config = job_config(t.org, first, "select", "true")
            for i in range(samples):
                progress(f"selection: capacity error {i + 1}/{samples}")
                MachineType.objects.filter(pk=first.pk).update(capacity_cooling_until=None)
                fake.sell_out("cx23", "fsn1")
                refused, made = len(fake.capacity_refusals), len(fake.creates)
                job = job_submit(org=t.org, config=config, actor="bench")
                wait_for(
                    lambda refused=refused: len(fake.capacity_refusals) > refused,
                    60,
                    "the capacity error",
                    0.005,
                )
                fake.sell_out("cx23", "fsn1", sold_out=False)
                created = wait_for(
                    lambda made=made: next((c for c in fake.creates[made:] if c[1] == "nbg1"), None),
                    60,
                    "the next candidate's create",
                    0.005,
                )
                delays.append(created[2] - fake.capacity_refusals[refused][2])
                job_cancel(job=Job.objects.get(pk=job.pk), actor="bench")
                for instance_id in MachineInstance.objects.filter(
                    machine_type=second, status__in=["pending", "provisioning", "warming"]
                ).values_list("pk", flat=True):
                    instance_terminate(instance_id=instance_id, actor="bench", reason="sample done")
            time.sleep(0.5)
    return delays


def fake_wheels() -> str:
    """A folder with an agent wheel (a cloud machine is made only with one to install)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="catacloud-bench-wheel-"))
    (folder / "catacloud_agent-0.1.0-py3-none-any.whl").write_bytes(b"an agent wheel")
    return str(folder)


def _spot_week(days: int, result: PartResult) -> list[Figure]:
    from dataclasses import replace

    from catacloud.simulate import Params, simulate
    from catacloud.trace import generate

    jobs = generate(days=days, seed=7)
    ondemand_params = Params(price_per_hour=ON_DEMAND, billing_increment=1, min_billed=60)
    spot_params = replace(
        ondemand_params,
        spot_price=SPOT,
        interruptions_per_hour=0.05,
        capacity_error_rate=0.05,
        checkpoint_seconds=300,
    )
    ondemand = simulate(jobs, "speed", ondemand_params)
    spot = simulate(jobs, "speed", spot_params)
    saved = float(1 - spot.cost / ondemand.cost) if ondemand.cost else 0.0
    result.data["week"] = {"jobs": len(jobs), "on_demand": ondemand.row(), "spot": spot.row()}
    note = (
        f"{len(jobs)} jobs; spot: {spot.spot_machines} of {spot.machines_created} machines, "
        f"{spot.interruptions} interrupted under a job, {spot.capacity_errors} capacity errors, "
        f"{spot.lost_seconds / 3600:.2f} job-hours run again"
    )
    return [
        Figure("week on demand: cost", float(ondemand.cost), "USD"),
        Figure("week on spot first: cost", float(spot.cost), "USD", note=note),
        Figure("spot: cost saved", round(saved * 100, 1), "%"),
        Figure("spot: extra wait p95", round(spot.wait_p95 - ondemand.wait_p95, 1), "s"),
        Figure("spot: extra wait max", round(spot.wait_max - ondemand.wait_max, 1), "s"),
    ]
