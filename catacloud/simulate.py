"""Replay a job trace on a simulated clock through the real placement and retention policy.

Framework-free (no Django): the decisions come from :mod:`catacloud.policy` exactly as the
scheduler (``apps/jobs/admission.py``, ``placement.py``) and the reaper make them:

- placement order (:data:`catacloud.policy.placement.ORDER`): an idle reusable machine (the one
  that last ran the same configuration first, then the one idle longest:
  :func:`~catacloud.policy.placement.idle_preference`), then a warm pool member, then new
  machines as :func:`catacloud.policy.placement.machines_to_buy` decides for the policy (counting
  machines booting, pool members included), else wait;
- pools (:func:`catacloud.policy.pools.refill_plan`): a member a job takes stays a member until
  the job ends (``max_size`` counts it), then leaves the pool; the pool refills when a member
  is claimed or leaves and at every reaper tick, taking in idle machines and machines booting
  for no job before it buys;
- retention: every reaper interval, an idle reusable machine outside the pool is destroyed when
  :func:`catacloud.policy.retention.should_retire` says its paid period is about to end;
- billing: :class:`catacloud.policy.billing.Billing` from boot start to destroy.

Policies: ``ephemeral`` (a new machine per job, destroyed after it), ``speed`` and ``cost``
(reuse machines; the grant policies), ``pool:N`` (N warm members kept in front of ephemeral
machines; a claim refills at once, like the real pool) and ``pool:N:speed`` / ``pool:N:cost``
(a warm pool in front of reusable machines). A pool's ``max_size`` is N unless
``Params.pool_max_size`` says more (``pool_create``'s default is its target).

Spot (``Params.spot_price``): machines are bought as spot first, on-demand when the spot
candidate is cooling down after a capacity error (each spot buy is refused with probability
``capacity_error_rate``; a refusal cools it down ``cooldown`` seconds, and the buy falls over to
on-demand at once, as apps/machines/capacity.py does). A spot machine is interrupted after an
exponential time of rate ``interruptions_per_hour``: its job is requeued at the front and resumes
from its last checkpoint (every ``checkpoint_seconds`` of its run; 0: it starts over).

A trace is CSV with a header: ``submit_time_seconds,duration_seconds,config``.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import itertools
import math
import random
from collections import defaultdict, deque
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from catacloud.policy import attribution, placement
from catacloud.policy.billing import Billing
from catacloud.policy.pools import adopt_preference, refill_plan
from catacloud.policy.retention import should_retire

DEFAULT_PRICE = "0.0095"

# Event kinds, in the order they are handled at the same instant: machines finish booting and
# jobs end before arrivals are placed, so a freed machine is seen by the job arriving with it.
_READY, _FINISH, _INTERRUPT, _ARRIVE, _REAPER, _SCHEDULER = range(6)


@dataclass(frozen=True)
class TraceJob:
    submit: float
    duration: float
    config: str


@dataclass
class Machine:
    id: int
    started: float  # boot start: billing starts here
    ready_at: float
    pool: bool  # a member of the pool (while a job holds it too)
    state: str = "booting"  # booting | idle | busy | gone
    idle_since: float = 0.0
    last_config: str | None = None
    job_started: float = 0.0
    job_config: str = ""
    destroyed: float | None = None
    born_in_pool: bool = False
    warm_until: float | None = None  # age of its first claim (unheld time before it is warm)
    holds: list[attribution.Hold] = field(default_factory=list)
    images: set[str] = field(default_factory=set)  # the configurations whose image it holds
    spot: bool = False
    job: tuple[int, TraceJob] | None = None  # what it runs (busy)
    job_pull: float = 0.0  # seconds of that job's start spent pulling its image


@dataclass
class Result:
    policy: str
    jobs: int
    cost: Decimal
    machine_hours: float
    machines_created: int
    wait_p50: float
    wait_p95: float
    wait_max: float
    waits: list[float] = field(default_factory=list, repr=False)
    # every cent attributed (catacloud.policy.attribution): job / warm / idle / tail
    by_kind: dict[str, Decimal] = field(default_factory=dict)
    budget: Decimal | None = None
    budget_waited: int = 0  # jobs that waited while the budget refused a machine
    not_run: int = 0  # jobs still waiting when the simulation ended
    spend_curve: list[tuple[float, Decimal]] = field(default_factory=list, repr=False)
    budget_reached_at: float | None = None  # when the budget first refused a machine
    # what machines live at that moment billed after it: spend never passes budget + this
    after_reached: Decimal = Decimal(0)
    spot_machines: int = 0  # of machines_created
    interruptions: int = 0  # spot machines reclaimed under a job
    capacity_errors: int = 0  # spot buys refused (each fell over to on-demand)
    lost_seconds: float = 0.0  # job seconds run again after interruptions (since their checkpoint)
    # (billing start, end) of every machine, in trace seconds
    timeline: list[tuple[float, float]] = field(default_factory=list, repr=False)

    def shares(self) -> dict[str, float]:
        total = sum(self.by_kind.values(), Decimal(0))
        return {k: round(float(v / total), 4) if total else 0.0 for k, v in self.by_kind.items()}

    def row(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "jobs": self.jobs,
            "cost": float(self.cost),
            "machine_hours": round(self.machine_hours, 3),
            "machines_created": self.machines_created,
            "wait_p50": round(self.wait_p50, 1),
            "wait_p95": round(self.wait_p95, 1),
            "wait_max": round(self.wait_max, 1),
            "by_kind": {k: float(v) for k, v in self.by_kind.items()},
            "shares": self.shares(),
            "spot_machines": self.spot_machines,
            "interruptions": self.interruptions,
            "capacity_errors": self.capacity_errors,
            "lost_seconds": round(self.lost_seconds, 1),
            **(
                {
                    "budget": float(self.budget),
                    "budget_waited": self.budget_waited,
                    "not_run": self.not_run,
                    "spend_curve": [[round(t / 3600, 3), float(v)] for t, v in self.spend_curve],
                    "budget_reached_hour": round(self.budget_reached_at / 3600, 2)
                    if self.budget_reached_at is not None
                    else None,
                    "after_reached": float(self.after_reached),
                }
                if self.budget is not None
                else {}
            ),
        }


@dataclass(frozen=True)
class Params:
    price_per_hour: Decimal = Decimal(DEFAULT_PRICE)
    billing_increment: int = 3600
    min_billed: int = 0
    boot_seconds: float = 45.0
    max_wait: float = 90.0  # the grant default (about two boot times)
    max_instances: int = 50
    reaper_interval: float = 60.0
    scheduler_interval: float = 15.0
    budget: Decimal | None = None  # money per budget period; no machine is bought past it
    budget_period: float = 30 * 86400.0  # seconds (a month of 30 days, or 86400)
    pool_max_size: int | None = None  # a pool's max_size (None: its target, pool_create's default)
    # measured boot times, in order: the n-th machine bought boots in boot_samples[n % len]
    # seconds (instead of boot_seconds), e.g. a live run's, so their spread is replayed too
    boot_samples: tuple[float, ...] = ()
    # seconds a machine is held beyond its job's run (the agent fetching, starting and ending
    # it): nothing on a real cloud's scale, a measurable share on a compressed live clock
    job_overhead: float = 0.0
    # Jobs as container images (one image per configuration): a job on a machine that does not
    # hold its image waits this long for the pull first; with ``pool_images`` every pool member
    # pulled every configuration's image before it was ready (a pool's ``images``).
    pull_seconds: float = 0.0
    pool_images: bool = False
    # Spot first (None: on-demand only, at price_per_hour), with on-demand as its fallback.
    spot_price: Decimal | None = None
    interruptions_per_hour: float = 0.0  # per spot machine
    capacity_error_rate: float = 0.0  # the chance a spot buy is refused
    cooldown: float = 180.0  # CATACLOUD_CAPACITY_COOLDOWN
    checkpoint_seconds: float = 0.0  # a job checkpoints this often (0: an interrupted job restarts)
    seed: int = 1

    @property
    def billing(self) -> Billing:
        return Billing(self.billing_increment, self.min_billed, self.price_per_hour)

    def billing_of(self, spot: bool) -> Billing:
        price = self.spot_price if spot and self.spot_price is not None else self.price_per_hour
        return Billing(self.billing_increment, self.min_billed, price)

    @property
    def margin(self) -> float:
        return 2 * self.reaper_interval


def parse_policy(policy: str) -> tuple[str, int, bool]:
    """``(grant policy used to buy, warm pool size, reuse machines after a job)``."""
    parts = policy.split(":")
    if parts[0] == "ephemeral" and len(parts) == 1:
        return placement.SPEED, 0, False
    if parts[0] in (placement.SPEED, placement.COST) and len(parts) == 1:
        return parts[0], 0, True
    if parts[0] == "pool" and len(parts) in (2, 3) and parts[1].isdigit():
        behind = parts[2] if len(parts) == 3 else "ephemeral"
        if behind == "ephemeral":
            return placement.SPEED, int(parts[1]), False
        if behind in (placement.SPEED, placement.COST):
            return behind, int(parts[1]), True
    raise ValueError(f"unknown policy {policy!r}: ephemeral | speed | cost | pool:N[:speed|cost]")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def load_trace(path: str | Path) -> list[TraceJob]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        jobs = [
            TraceJob(float(r["submit_time_seconds"]), float(r["duration_seconds"]), r["config"].strip())
            for r in reader
        ]
    return sorted(jobs, key=lambda j: j.submit)


def write_trace(path: str | Path, jobs: list[TraceJob]) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["submit_time_seconds", "duration_seconds", "config"])
        for job in jobs:
            writer.writerow([f"{job.submit:.1f}", f"{job.duration:.1f}", job.config])


def lower_bound(jobs: list[TraceJob], params: Params) -> Decimal:
    """Offline lower bound: every job second paid at the hourly price, nothing else."""
    seconds = sum(Decimal(str(j.duration)) for j in jobs)
    return (seconds * params.price_per_hour / Decimal(3600)).quantize(Decimal("0.000001"))


class Simulation:
    def __init__(
        self,
        jobs: list[TraceJob],
        policy: str,
        params: Params,
        until: float | None = None,
        until_done: bool = False,
    ) -> None:
        self.jobs = sorted(jobs, key=lambda j: j.submit)
        self.policy = policy
        self.buy_policy, self.pool_size, self.reuse = parse_policy(policy)
        self.p = params
        self.until = until
        self.until_done = until_done
        self.unfinished = len(self.jobs)
        self.now = 0.0
        self.machines: dict[int, Machine] = {}
        self.ids = itertools.count(1)
        self.seq = itertools.count()
        self.events: list[tuple[float, int, int, Any]] = []
        self.waiting: deque[tuple[int, TraceJob]] = deque()  # (index, job), FIFO
        self.wait_of: dict[int, float] = {}  # each job's wait (all its attempts')
        self.runtimes: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=placement.RECENT_RUNS))
        self.created = 0
        self.pending_jobs = len(self.jobs)
        self.scheduler_armed = False
        self.arrivals_left = len(self.jobs)
        self.budget_waited: set[int] = set()
        self.spend_curve: list[tuple[float, Decimal]] = []
        self.ended_cost: dict[int, Decimal] = {}
        self.reached: tuple[float, dict[int, Decimal]] | None = None
        self.next_sample = 0.0
        self.pool_open = bool(self.pool_size)
        self.random = random.Random(params.seed)
        self.spot_cooling_until = -math.inf
        self.interruptions = self.capacity_errors = 0
        self.lost_seconds = 0.0

    # ---- events -------------------------------------------------------------------------------

    def push(self, when: float, kind: int, data: Any = None) -> None:
        heapq.heappush(self.events, (when, kind, next(self.seq), data))

    def run(self) -> Result:
        for index, job in enumerate(self.jobs):
            self.push(job.submit, _ARRIVE, (index, job))
        self.refill_pool()
        self.push(self.p.reaper_interval, _REAPER)
        end_of_jobs = None
        while self.events:
            when, kind, _, data = heapq.heappop(self.events)
            if kind == _INTERRUPT and self.machines[data].state == "gone":
                continue  # the machine ended before the cloud reclaimed it: no event, no clock
            if self.until is not None and when > self.until:
                break
            self.now = when
            if kind == _READY:
                machine = self.machines[data]
                if machine.state == "booting":
                    machine.state, machine.idle_since = "idle", when
                    if machine.pool:
                        self.refill_pool()  # a member became ready: the pool re-counts
            elif kind == _FINISH:
                self.finish(data)
            elif kind == _INTERRUPT:
                self.interrupt(data)
            elif kind == _ARRIVE:
                self.waiting.append(data)
                self.arrivals_left -= 1
            elif kind == _REAPER:
                self.reap()
                self.refill_pool()  # every pool off its target, at every tick
                if self.p.budget is not None and when >= self.next_sample:
                    self.spend_curve.append((when, self.spend()))  # hourly, between purchases too
                    self.next_sample = when + 3600
                if self.pending_jobs or self.waiting or self.live(pool=False):
                    self.push(when + self.p.reaper_interval, _REAPER)
            elif kind == _SCHEDULER:
                self.scheduler_armed = False
            self.place()
            if self.until_done and not self.unfinished:
                self.until = when  # the last job ended: bill everything to this moment
                break
            if self.starved():
                break  # the budget refuses every machine, none is left and nothing more arrives
            if not self.pending_jobs and not self.waiting and end_of_jobs is None:
                end_of_jobs = when
                # Nothing more to do: the pool is given up now; reusable machines run out
                # their paid period under retention (the reaper keeps ticking).
                if self.until is None:
                    self.pool_open = False
                    for m in self.live(pool=True):
                        self.destroy(m)
        horizon = self.until if self.until is not None else self.now
        for m in list(self.machines.values()):
            if m.state != "gone":
                self.destroy(m, at=horizon)
        return self.result()

    # ---- machines -----------------------------------------------------------------------------

    def live(self, *, pool: bool | None = None) -> list[Machine]:
        return [m for m in self.machines.values() if m.state != "gone" and (pool is None or m.pool == pool)]

    # ---- money ----------------------------------------------------------------------------------

    def spend(self) -> Decimal:
        """The budget's spend in the current period, as the server counts it: machines whose
        billing started in the period, ended ones at their cost, live ones committed to the end
        of their paid period."""
        period = self.period_of(self.now)
        total = self.ended_cost.get(period, Decimal(0))
        for m in self.live():
            if self.period_of(m.started) == period:
                total += self.p.billing_of(m.spot).cost(self.now - m.started)
        return total

    def period_of(self, t: float) -> int:
        return math.floor(t / self.p.budget_period)

    def affordable(self, wanted: int) -> int:
        """How many of ``wanted`` machines the budget allows now."""
        if self.p.budget is None or wanted <= 0:
            return wanted
        price = attribution.first_period_cost(self.p.billing)
        if price <= 0:
            return wanted
        allowed = max(0, min(wanted, int((self.p.budget - self.spend()) // price)))
        if allowed == 0 and self.reached is None:
            # the budget refuses its first machine: what live machines committed now (the
            # periods they bill after this are the bound on passing the budget)
            self.reached = (
                self.now,
                {m.id: self.p.billing_of(m.spot).cost(self.now - m.started) for m in self.live()},
            )
        return allowed

    def starved(self) -> bool:
        if self.p.budget is None or not self.waiting or self.arrivals_left or self.live():
            return False
        # nothing can free a machine and the budget refuses one: it renews in the next period,
        # which counts only while it begins within the trace (else the jobs are "not run")
        last_submit = self.jobs[-1].submit if self.jobs else 0.0
        return self.period_of(self.now) >= self.period_of(last_submit) and self.affordable(1) == 0

    def refill_pool(self) -> None:
        """The pool's refill (apps/pools/services.pool_refill): take in idle machines and
        machines booting for no job, then buy what is still missing (within the budget)."""
        if not self.pool_open:
            return
        members = self.live(pool=True)
        outside = [m for m in self.live(pool=False) if m.state in ("idle", "booting")]
        plan = refill_plan(
            target=self.pool_size,
            max_size=self.p.pool_max_size or self.pool_size,
            members=len(members),
            fresh=sum(1 for m in members if m.state != "busy"),
            idle=sum(1 for m in outside if m.state == "idle"),
            booting=sum(1 for m in outside if m.state == "booting"),
            waiting=len(self.waiting),
            counted=len(self.live()),
            max_instances=self.p.max_instances,
        )
        for state, n in (("idle", plan.adopt_ready), ("booting", plan.adopt_booting)):
            for m in sorted(
                (m for m in outside if m.state == state),
                key=lambda m: adopt_preference(ran_a_job=m.last_config is not None, since=m.started),
            )[:n]:
                m.pool = True
        for _ in range(self.affordable(plan.buy)):
            self.boot(pool=True)

    def boot(self, *, pool: bool) -> Machine:
        n = next(self.ids)
        samples = self.p.boot_samples
        boot = samples[(n - 1) % len(samples)] if samples else self.p.boot_seconds
        m = Machine(
            id=n,
            started=self.now,
            ready_at=self.now + boot,
            pool=pool,
            born_in_pool=pool,
            spot=self.buy_spot(),
        )
        self.machines[m.id] = m
        self.created += 1
        self.push(m.ready_at, _READY, m.id)
        if m.spot and self.p.interruptions_per_hour > 0:
            self.push(
                self.now + self.random.expovariate(self.p.interruptions_per_hour / 3600), _INTERRUPT, m.id
            )
        if self.p.budget is not None:
            self.spend_curve.append((self.now, self.spend()))
        return m

    def buy_spot(self) -> bool:
        """Spot when there is a spot candidate not cooling down and the cloud has capacity;
        a refusal cools it down and this buy falls over to on-demand."""
        if self.p.spot_price is None or self.now < self.spot_cooling_until:
            return False
        if self.p.capacity_error_rate and self.random.random() < self.p.capacity_error_rate:
            self.capacity_errors += 1
            self.spot_cooling_until = self.now + self.p.cooldown
            return False
        return True

    def interrupt(self, machine_id: int) -> None:
        """The cloud reclaims a spot machine: its job goes back to the front of the queue with
        what its last checkpoint saved (the attempt is free), the machine is gone."""
        m = self.machines[machine_id]
        if m.state == "gone":
            return
        if m.state == "busy" and m.job is not None:
            index, job = m.job
            ran = max(0.0, self.now - m.job_started - m.job_pull)  # its image pull is no progress
            every = self.p.checkpoint_seconds
            kept = min(job.duration, math.floor(ran / every) * every) if every > 0 else 0.0
            self.lost_seconds += max(0.0, min(ran, job.duration) - kept)
            last = m.holds[-1]
            m.holds[-1] = attribution.Hold(last.start, self.now - m.started, last.ref)
            self.waiting.appendleft((index, TraceJob(self.now, job.duration - kept, job.config)))
            self.pending_jobs += 1
            self.interruptions += 1
        member = m.pool
        self.destroy(m)
        if member:
            self.refill_pool()

    def destroy(self, m: Machine, at: float | None = None) -> None:
        m.state, m.destroyed = "gone", self.now if at is None else at
        period = self.period_of(m.started)
        self.ended_cost[period] = self.ended_cost.get(period, Decimal(0)) + self.p.billing_of(m.spot).cost(
            m.destroyed - m.started
        )

    def start(self, index: int, job: TraceJob, m: Machine) -> None:
        if m.warm_until is None:
            m.warm_until = self.now - m.started
        m.state, m.job_started, m.job_config, m.job = "busy", self.now, job.config, (index, job)
        # its image first, unless the machine holds it (a pool member that pulled the pool's)
        hot = job.config in m.images or (m.born_in_pool and self.p.pool_images)
        pull = 0.0 if hot else self.p.pull_seconds
        m.job_pull = pull
        m.images.add(job.config)
        held = pull + job.duration + self.p.job_overhead  # the agent starts and ends the job around it
        m.holds.append(attribution.Hold(self.now - m.started, self.now + held - m.started, str(index)))
        # until its command runs; a job an interruption requeued waits again, from then
        self.wait_of[index] = self.wait_of.get(index, 0.0) + self.now + pull - job.submit
        self.pending_jobs -= 1
        self.push(self.now + held, _FINISH, (m.id, held))

    def finish(self, data: tuple[int, float]) -> None:
        machine_id, duration = data
        m = self.machines[machine_id]
        if m.state != "busy":
            return  # interrupted: the job ends on another machine
        m.job = None
        self.unfinished -= 1
        self.runtimes[m.job_config].append(duration)
        member = m.pool
        if self.reuse:  # kept for reuse, outside the pool
            m.state, m.idle_since, m.last_config, m.pool = "idle", self.now, m.job_config, False
        else:
            self.destroy(m)
        if member:
            self.refill_pool()  # a member left the pool

    def reap(self) -> None:
        for m in self.live(pool=False):
            if m.state == "idle" and should_retire(
                billing=self.p.billing_of(m.spot),
                runtime_seconds=self.now - m.started,
                margin_seconds=self.p.margin,
            ):
                self.destroy(m)

    # ---- placement (the scheduler's order) ----------------------------------------------------

    def typical_runtime(self, config: str) -> float:
        return placement.typical_runtime(self.runtimes.get(config, ()))

    def place(self) -> None:
        if not self.waiting:
            return
        idle = {
            placement.IDLE: [m for m in self.live(pool=False) if m.state == "idle"],
            placement.POOL: [m for m in self.live(pool=True) if m.state == "idle"],
        }
        remaining: deque[tuple[int, TraceJob]] = deque()
        claimed_from_pool = False
        while self.waiting:
            index, job = self.waiting.popleft()
            for source in placement.ORDER:
                if not idle[source]:
                    continue
                if source == placement.IDLE:
                    best = min(
                        idle[source],
                        key=lambda m: placement.idle_preference(
                            same_config=m.last_config == job.config, idle_since=m.idle_since
                        ),
                    )
                else:  # the pool's oldest ready member (claims.pool_sql)
                    best = min(idle[source], key=lambda m: m.idle_since)
                    claimed_from_pool = True
                idle[source].remove(best)
                self.start(index, job, best)
                break
            else:
                remaining.append((index, job))
        self.waiting = remaining
        if remaining:
            self.buy(remaining)
        if claimed_from_pool or (remaining and self.pool_size):
            # After the placement commits: the claims ask for their pool's refill (and a pool
            # the budget held back fills again once it allows)
            self.refill_pool()

    def buy(self, remaining: deque[tuple[int, TraceJob]]) -> None:
        live = self.live()
        horizon = self.now + self.p.max_wait
        busy = [m for m in live if m.state == "busy"] if self.reuse else []
        supply = placement.Supply(
            total=len(live),
            coming=sum(1 for m in live if m.state == "booting" and not m.pool),
            pool_coming=sum(1 for m in live if m.state == "booting" and m.pool),
            busy=len(busy),
            free_soon=placement.free_soon(
                ((m.job_started, self.typical_runtime(m.job_config)) for m in busy), horizon
            )
            if self.buy_policy == placement.COST
            else 0,
            max_instances=self.p.max_instances,
        )
        overdue = sum(1 for _, job in remaining if self.now - job.submit >= self.p.max_wait)
        n = placement.machines_to_buy(
            waiting=len(remaining), overdue=overdue, supply=supply, policy=self.buy_policy
        )
        if self.affordable(n) < n:
            n = self.affordable(n)
            self.budget_waited.update(i for i, _ in list(remaining)[n + supply.on_the_way :])
        for _ in range(n):
            self.boot(pool=False)
        if not self.scheduler_armed:  # the scheduler's periodic safety net while jobs wait
            self.scheduler_armed = True
            self.push(self.now + self.p.scheduler_interval, _SCHEDULER)

    # ---- result -------------------------------------------------------------------------------

    @property
    def waits(self) -> list[float]:
        return list(self.wait_of.values())

    def result(self) -> Result:
        cost = Decimal(0)
        seconds = 0
        by_kind = {k: Decimal(0) for k in attribution.KINDS}
        for m in self.machines.values():
            runtime = (m.destroyed if m.destroyed is not None else self.now) - m.started
            # born in the pool: unheld time before its first claim (all of it, if never) is warm
            warm_until = (runtime if m.warm_until is None else m.warm_until) if m.born_in_pool else 0.0
            a = attribution.attribute(
                billing=self.p.billing_of(m.spot),
                runtime_seconds=runtime,
                holds=m.holds,
                warm_until=warm_until,
            )
            cost += a.cost
            seconds += a.billed_seconds
            for kind, amount in a.by_kind().items():
                by_kind[kind] += amount
        return Result(
            policy=self.policy,
            jobs=len(set(self.wait_of) - {index for index, _ in self.waiting}),  # requeued: not run
            cost=cost.quantize(Decimal("0.0001")),
            machine_hours=seconds / 3600,
            machines_created=self.created,
            wait_p50=percentile(self.waits, 50),
            wait_p95=percentile(self.waits, 95),
            wait_max=max(self.waits, default=0.0),
            waits=self.waits,
            by_kind=by_kind,
            budget=self.p.budget,
            budget_waited=len(self.budget_waited),
            not_run=len(self.waiting),
            # the curve ends with what the period finally cost
            spend_curve=[*self.spend_curve, (self.now, self.spend())] if self.p.budget is not None else [],
            budget_reached_at=self.reached[0] if self.reached else None,
            after_reached=self.after_reached(),
            timeline=[
                (m.started, m.destroyed if m.destroyed is not None else self.now)
                for m in self.machines.values()
            ],
            spot_machines=sum(1 for m in self.machines.values() if m.spot),
            interruptions=self.interruptions,
            capacity_errors=self.capacity_errors,
            lost_seconds=self.lost_seconds,
        )

    def after_reached(self) -> Decimal:
        if self.reached is None:
            return Decimal(0)
        _, committed = self.reached
        total = Decimal(0)
        for machine_id, then in committed.items():
            m = self.machines[machine_id]
            end = m.destroyed if m.destroyed is not None else self.now
            total += self.p.billing_of(m.spot).cost(end - m.started) - then
        return total


def simulate(
    jobs: list[TraceJob],
    policy: str,
    params: Params | None = None,
    *,
    until: float | None = None,
    until_done: bool = False,
) -> Result:
    """Replay ``jobs`` under ``policy``. ``until`` stops the clock there (and bills to it);
    ``until_done`` stops it when the last job ends: machines still alive then are billed what
    they committed (their current paid period), its unused rest reported as ``tail``, as the
    server's cost report does for live machines."""
    return Simulation(jobs, policy, params or Params(), until=until, until_done=until_done).run()


def format_table(results: list[Result], bound: Decimal) -> str:
    head = f"{'policy':<16}{'cost':>10}{'vs bound':>10}{'p50 wait':>10}{'p95 wait':>10}{'max wait':>10}"
    head += f"{'machines':>10}{'mach-h':>10}{'job':>6}{'warm':>6}{'idle':>6}{'tail':>6}"
    budgeted = any(r.budget is not None for r in results)
    if budgeted:
        head += f"{'budget-waited':>15}{'not run':>9}"
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = f"{float(r.cost / bound):.2f}x" if bound else "-"
        shares = r.shares()
        line = (
            f"{r.policy:<16}{float(r.cost):>10.2f}{ratio:>10}{r.wait_p50:>9.0f}s{r.wait_p95:>9.0f}s"
            f"{r.wait_max:>9.0f}s{r.machines_created:>10}{r.machine_hours:>10.1f}"
            + "".join(f"{shares.get(k, 0.0):>6.0%}" for k in attribution.KINDS)
        )
        if budgeted:
            line += f"{r.budget_waited:>15}{r.not_run:>9}"
        lines.append(line)
    lines.append(f"{'lower bound':<16}{float(bound):>10.2f}{'1.00x':>10}  (total job seconds x price)")
    lines.append("job / warm / idle / tail: shares of the billed cost (catacloud.policy.attribution)")
    return "\n".join(lines)


def format_spend_curve(result: Result, points: int = 12) -> str:
    """A few points of the spend curve (spend and commitments in the period, when buying)."""
    curve = result.spend_curve
    if not curve:
        return f"{result.policy}: no machine bought"
    step = max(1, len(curve) // points)
    shown = [*curve[::step], curve[-1]] if (len(curve) - 1) % step else curve[::step]
    return f"{result.policy} spend curve (hour: spend): " + ", ".join(
        f"{t / 3600:.1f}h: {float(v):.2f}" for t, v in shown
    )


def params_from_args(args: argparse.Namespace) -> Params:
    return Params(
        price_per_hour=Decimal(str(args.price)),
        billing_increment=args.billing_increment,
        min_billed=args.min_billed,
        boot_seconds=args.boot_seconds,
        max_wait=args.max_wait,
        max_instances=args.max_instances,
        reaper_interval=args.reaper_interval,
        budget=Decimal(str(args.budget)) if args.budget is not None else None,
        budget_period=86400.0 if args.budget_period == "day" else 30 * 86400.0,
        pool_max_size=args.pool_max_size,
        spot_price=Decimal(str(args.spot_price)) if args.spot_price is not None else None,
        interruptions_per_hour=args.interruptions_per_hour,
        capacity_error_rate=args.capacity_error_rate,
        cooldown=args.cooldown,
        checkpoint_seconds=args.checkpoint_every,
        seed=args.seed,
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    jobs = load_trace(args.trace)
    params = params_from_args(args)
    policies = args.policy or ["ephemeral", "speed", "cost", "pool:2", "pool:5", "pool:10"]
    for policy in policies:
        parse_policy(policy)
    results = [simulate(jobs, policy, params, until_done=args.until_done) for policy in policies]
    span = (max(j.submit + j.duration for j in jobs) - jobs[0].submit) / 3600 if jobs else 0
    print(
        f"{len(jobs)} jobs over {span:.1f} h from {args.trace}; billing every {params.billing_increment}s "
        f"(min {params.min_billed}s) at {params.price_per_hour}/h; boot {params.boot_seconds:.0f}s; "
        f"max_wait {params.max_wait:.0f}s; max_instances {params.max_instances}"
    )
    if params.budget is not None:
        print(f"budget: {params.budget} per {args.budget_period}; no machine is bought past it")
    print(format_table(results, lower_bound(jobs, params)))
    if params.spot_price is not None:
        print(
            f"spot at {params.spot_price}/h first, on-demand at {params.price_per_hour}/h after a capacity "
            f"error ({params.capacity_error_rate:.0%} of spot buys; {params.cooldown:.0f} s cool-down); "
            f"{params.interruptions_per_hour:g} interruptions per spot machine-hour; checkpoints every "
            f"{params.checkpoint_seconds:g} s"
        )
        for r in results:
            print(
                f"{r.policy}: {r.spot_machines} of {r.machines_created} machines spot, {r.interruptions} "
                f"interrupted under a job, {r.capacity_errors} capacity errors, "
                f"{r.lost_seconds / 3600:.2f} job-hours run again"
            )
    if params.budget is not None:
        for r in results:
            print(format_spend_curve(r))
    return 0


def add_simulate_command(subparsers: Any) -> None:
    sim = subparsers.add_parser(
        "simulate", help="replay a job trace through the real placement and retention policy"
    )
    sim.add_argument("--trace", required=True, help="CSV: submit_time_seconds,duration_seconds,config")
    sim.add_argument(
        "--policy",
        action="append",
        help="ephemeral | speed | cost | pool:N[:speed|cost] (repeat; default: a set of them)",
    )
    sim.add_argument("--price", type=float, default=float(DEFAULT_PRICE), help="price per machine-hour")
    sim.add_argument(
        "--billing-increment", type=int, default=3600, help="seconds (3600 hourly, 1 per second)"
    )
    sim.add_argument("--min-billed", type=int, default=0, help="minimum billed seconds")
    sim.add_argument("--boot-seconds", type=float, default=45.0)
    sim.add_argument(
        "--max-wait", type=float, default=90.0, help="cost policy: seconds to wait for a paid machine"
    )
    sim.add_argument("--max-instances", type=int, default=50)
    sim.add_argument("--reaper-interval", type=float, default=60.0)
    sim.add_argument(
        "--budget", type=float, default=None, help="money per budget period: no machine is bought past it"
    )
    sim.add_argument("--budget-period", choices=["month", "day"], default="month")
    sim.add_argument(
        "--pool-max-size",
        type=int,
        default=None,
        help="pool:N policies: the pool's max_size (default N, like a pool created without one)",
    )
    sim.add_argument("--spot-price", type=float, default=None, help="buy spot first at this price per hour")
    sim.add_argument(
        "--interruptions-per-hour", type=float, default=0.0, help="spot: interruptions per machine-hour"
    )
    sim.add_argument(
        "--capacity-error-rate", type=float, default=0.0, help="spot: the chance a buy is refused (0..1)"
    )
    sim.add_argument("--cooldown", type=float, default=180.0, help="seconds a refused candidate cools down")
    sim.add_argument(
        "--checkpoint-every", type=float, default=0.0, help="a job checkpoints this often (0: restarts)"
    )
    sim.add_argument("--seed", type=int, default=1, help="random seed of interruptions and capacity errors")
    sim.add_argument(
        "--until-done",
        action="store_true",
        help="bill to the end of the last job (the rest of live machines' paid periods is tail)",
    )
    sim.set_defaults(func=cmd_simulate)
