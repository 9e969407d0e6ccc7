"""Part 4: replenishment: a claim -> the replacement's provision task started.

A pool of local machines is claimed from (pool_claim, which enqueues the pool's refill after
commit); the refill requests a replacement whose provision task records
``pool.member_provisioning`` when it starts. The figure is that event's created_at minus the
claim's ``pool.member_claimed`` event's created_at.
"""

from __future__ import annotations

from benchmarks.harness import Figure, PartResult, Progress, percentile, say, tenant
from benchmarks.stack import live_stack, wait_quiet
from testkit.processes import wait_for


def run(*, samples: int = 10, pool_size: int = 2, progress: Progress = say) -> PartResult:
    from apps.events.models import Event
    from apps.machines.lifecycle import instance_terminate
    from apps.pools.services import pool_claim, pool_create, pool_refill

    result = PartResult(part="replenish", title="Replenishment: claim to replacement provisioning")
    delays: list[float] = []
    progress("replenish: starting gunicorn, worker, beat")
    with live_stack("replenish") as stack:
        t = tenant("refill", kind="local", state_dir=stack.state_dir, max_pool_size=50, max_instances=100)
        pool = pool_create(
            org=t.org, name="refill", machine_type=t.machine_type, target_size=pool_size, max_size=50
        )
        pool_refill(pool_id=pool.pk)
        progress(f"replenish: warming a pool of {pool_size} local machines")
        for i in range(samples):
            wait_quiet(pool.pk, pool_size)
            progress(f"replenish: claim {i + 1}/{samples}")
            last = (
                Event.objects.filter(kind="pool.member_provisioning", pool_id=pool.pk)
                .order_by("-id")
                .values_list("id", flat=True)
                .first()
                or 0
            )
            claim = pool_claim(pool_id=pool.pk, acquired_by="bench")
            claimed_at = Event.objects.get(
                kind="pool.member_claimed", instance_id=claim.instance.pk
            ).created_at
            started = wait_for(
                lambda last=last: (
                    Event.objects.filter(kind="pool.member_provisioning", pool_id=pool.pk, id__gt=last)
                    .order_by("id")
                    .values_list("created_at", flat=True)
                    .first()
                ),
                60,
                "the replacement's provision task",
                0.005,
            )
            delays.append((started - claimed_at).total_seconds())
            instance_terminate(instance_id=claim.instance.pk, actor="bench", reason="sample done")
    p50, p95 = percentile(delays, 50), percentile(delays, 95)
    result.data = {"delays_s": delays}
    result.figures += [
        Figure(
            "claim -> replacement provisioning p50", round(p50 * 1000), "ms", "<= 1000 ms", met=p50 <= 1.0
        ),
        Figure(
            "claim -> replacement provisioning p95", round(p95 * 1000), "ms", "", note=f"{len(delays)} claims"
        ),
    ]
    return result
