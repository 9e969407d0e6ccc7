"""Hand-written explanations of the measured figures, printed under each part's table.
Update them when a rerun changes the picture."""

from __future__ import annotations

CLAIM = """\
**Gap (throughput, p99): the per-claim Celery publish, not the claim statement.** Zero double
claims in every run and variant (checked: unique ids, claimed rows and `pool.member_claimed`
events all equal the claims answered). But `pool_claim` publishes `pool_refill_task` to Redis
after every commit (plus a `task-sent` event, since `CELERY_TASK_SEND_SENT_EVENT` is on): about
2-4 ms of client CPU per claim on this machine, with stalls of hundreds of ms under concurrency.
That publish dominates the service *and* the naive baseline alike, which is why the naive
`FOR UPDATE` baseline is about as fast as the service here (the row-lock queue is never the
bottleneck) and why the service reaches only ~10-15% of the raw psycopg floor. The
`no_enqueue` diagnostic (same statement and transaction, no publish) is 2-3x faster with a far
lower p99. To meet the targets the product should coalesce refills instead of publishing one
task per claim: e.g. enqueue only when no refill for that pool is already pending (a Redis
`SET NX` with a short TTL, or a `refill_requested_at` column set in the claim statement and
cleared by the refill), and turn off `task_send_sent_event` for this task. A second, smaller
finding: with stale statistics (members bulk-inserted, no ANALYZE yet) the planner uses the
plain `pool_id` index and sorts the whole pool per claim (12 ms at 4,500 members instead of
0.4 ms); the bench runs ANALYZE after filling a pool. Machine caveat: the bench shared its 2
cores with another session's `make dev` stack (web, worker, beat, Flower, agents)."""

REST = """\
**Gap: the same refill publish, inside the request.** Each acquire runs `pool_claim`, whose
after-commit `pool_refill_task.delay()` publishes to Redis on the request thread; with 8
clients, the 8 gunicorn threads and the clients on 2 shared cores, a request costs ~20 ms of
CPU in total and queues behind the others, so p50 and p99 are far above target. The fix is the
claim one (coalesced refills, no sent-events); more `web` replicas on more cores also help."""

SUBMIT = """\
Warm jobs start within the targets: submit commits and enqueues `schedule_task`, the worker
claims a pool member and wakes the agent's long poll through Redis, the agent reports
`started`. Cold here means provisioning a local agent process (about a second); on a cloud the
boot adds 30-60 s, so the warm/cold ratio on real providers is far larger than measured here."""

REPLENISH = """\
The claim's after-commit refill task reaches the provision task in well under a second: the
pool's replacement is being created before the caller has used the machine it claimed."""

REAPER = """\
The tick reads all pools' counts in one grouped query; at steady state no pool needs a refill,
so the query count is the same at 100 and 1,000 pools and the time grows only with the size of
that one grouped read."""

ADMISSION = """\
`admit()` locks one grant at a time, counts its admitted jobs, takes what fits with SKIP
LOCKED and updates them in two statements plus one bulk event insert per grant, so its cost is
per grant, not per job. Quotas were checked after every run: no org over `max_concurrent_jobs`
or its cpu quota, and exactly what the quotas allow was admitted."""

COST = """\
With hourly billing, reuse is what saves money: `speed` and `cost` keep an idle machine until
just before its paid hour ends, so a burst's later jobs ride on hours already paid for, and
both are far cheaper than `ephemeral` (an hour per job). **Gap on wait:** with the grant's
default `max_wait_seconds` = 300, `cost` waits for busy paid machines, so its p95 wait is more
than one boot time worse than `ephemeral`'s. With `max_wait_seconds` at 45-120 s (one to two
boot times) `cost` meets both targets (see the max_wait rows and the dashed line in the plot);
a default of about two boot times would meet them out of the box. Warm pools (`pool:N` in front
of ephemeral machines) buy zero wait at a high price under hourly billing, because every claim
is refilled with a new machine whose hour starts immediately; `pool:5:cost` (a pool in front of
reusable machines) gets zero p95 wait for about the price of ephemeral."""

EXPLANATIONS: dict[str, str] = {
    "claim": CLAIM,
    "rest": REST,
    "submit": SUBMIT,
    "replenish": REPLENISH,
    "reaper": REAPER,
    "admission": ADMISSION,
    "cost": COST,
}
