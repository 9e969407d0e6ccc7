"""Part 7: cost by policy, replaying a CI-like week through the real placement and retention
code on a simulated clock (catacloud.simulate), hourly billing."""

from __future__ import annotations

import time
from decimal import Decimal
from pathlib import Path

from benchmarks.harness import Figure, PartResult, Progress, say
from catacloud.simulate import Params, TraceJob, load_trace, lower_bound, simulate

TRACE = Path(__file__).resolve().parent.parent / "catacloud" / "data" / "traces" / "ci-week.csv"
POLICIES = ("ephemeral", "speed", "cost", "pool:2", "pool:5", "pool:10", "pool:5:cost")
SWEEP = (45, 90, 120, 300)
# The budget scenario: the cost policy under a money budget for the week, a fraction of what
# it spends without one, so the budget is reached mid-week.
BUDGET_FRACTION = 0.5


def run(
    *,
    trace: Path | None = None,
    jobs: list[TraceJob] | None = None,
    progress: Progress = say,
    sweep: tuple[int, ...] = SWEEP,
) -> PartResult:
    result = PartResult(part="cost", title="Cost by policy (simulated week, hourly billing)")
    jobs = jobs if jobs is not None else load_trace(trace or TRACE)
    params = Params()
    rows = []
    t0 = time.perf_counter()
    for policy in POLICIES:
        progress(f"cost: simulating {policy} over {len(jobs)} jobs")
        rows.append(simulate(jobs, policy, params).row())
    swept = []
    for max_wait in sweep:
        progress(f"cost: simulating cost with max_wait {max_wait}s")
        r = simulate(jobs, "cost", Params(max_wait=max_wait)).row()
        r["max_wait"] = max_wait
        swept.append(r)
    bound = float(lower_bound(jobs, params))
    by = {r["policy"]: r for r in rows}
    budget = Decimal(str(round(by["cost"]["cost"] * BUDGET_FRACTION, 2))) or Decimal("0.01")
    progress(f"cost: simulating cost under a budget of {budget}")
    budgeted = simulate(jobs, "cost", Params(budget=budget)).row()
    # The bound: past the budget only by machines already running when it was reached
    # (their jobs go on, and a running machine renews its paid period).
    overshoot = round(budgeted["cost"] - float(budget), 4)
    eph, cost = by["ephemeral"], by["cost"]
    saving = 1 - cost["cost"] / eph["cost"] if eph["cost"] else 0.0
    worse = cost["wait_p95"] - eph["wait_p95"]
    result.data = {
        "jobs": len(jobs),
        "policies": rows,
        "sweep": swept,
        "budget": budgeted,
        "budget_overshoot": overshoot,
        "lower_bound": bound,
        "boot_seconds": params.boot_seconds,
        "trace": str(trace or TRACE.name),
        "sim_seconds": time.perf_counter() - t0,
    }
    result.figures += [
        Figure(
            "cost policy vs ephemeral: billed cost",
            cost["cost"],
            "$",
            ">= 30% cheaper",
            f"ephemeral ${eph['cost']:.2f}",
            round(cost["cost"] / eph["cost"], 2) if eph["cost"] else None,
            saving >= 0.30,
            f"{saving:.0%} cheaper",
        ),
        Figure(
            "cost policy: p95 wait (max_wait 90 s, the grant default)",
            cost["wait_p95"],
            "s",
            f"<= ephemeral + boot ({eph['wait_p95'] + params.boot_seconds:.0f} s)",
            f"ephemeral {eph['wait_p95']:.0f} s",
            met=worse <= params.boot_seconds,
        ),
    ]
    for r in swept:
        if r["max_wait"] == 90:
            continue
        s = 1 - r["cost"] / eph["cost"] if eph["cost"] else 0.0
        result.figures.append(
            Figure(
                f"cost policy with max_wait {r['max_wait']} s",
                r["cost"],
                "$",
                "",
                f"p95 wait {r['wait_p95']:.0f} s",
                round(r["cost"] / eph["cost"], 2) if eph["cost"] else None,
                (s >= 0.30 and r["wait_p95"] - eph["wait_p95"] <= params.boot_seconds),
                f"{s:.0%} cheaper than ephemeral",
            )
        )
    for r in rows:
        sh = r["shares"]
        result.figures.append(
            Figure(
                f"{r['policy']}: share of cost that ran jobs",
                round(sh["job"] * 100, 1),
                "%",
                "",
                "",
                note=f"warm {sh['warm']:.0%}, idle {sh['idle']:.0%}, tail {sh['tail']:.0%} "
                f"(of ${r['cost']:.2f}; parts sum exactly)",
            )
        )
    result.figures += [
        Figure(
            f"budget ${budget} (cost policy): final spend",
            budgeted["cost"],
            "$",
            "<= budget + periods of machines running when reached",
            f"without budget ${by['cost']['cost']:.2f}",
            round(budgeted["cost"] / float(budget), 3) if budget else None,
            overshoot <= budgeted["after_reached"] + 1e-9,
            f"reached at hour {budgeted['budget_reached_hour']}; over it by ${overshoot:.2f}, "
            f"machines running then billed ${budgeted['after_reached']:.2f} more",
        ),
        Figure(
            "budget: jobs that waited on it / never ran",
            budgeted["budget_waited"],
            "jobs",
            "",
            "",
            note=f"{budgeted['not_run']} of {len(jobs)} not run by the end of the week",
        ),
    ]
    result.figures.append(
        Figure(
            "offline lower bound (job seconds x price)",
            round(bound, 2),
            "$",
            "",
            f"cost policy {cost['cost'] / bound:.2f}x the bound" if bound else "",
        )
    )
    return result
