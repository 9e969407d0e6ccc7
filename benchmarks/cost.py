"""Part 7: cost by policy, replaying a CI-like week through the real placement and retention
code on a simulated clock (catacloud.simulate), hourly billing; and one busy 2-hour window
replayed through the live stack and the simulator side by side (benchmarks.replay)."""

from __future__ import annotations

import time
from decimal import Decimal
from pathlib import Path

from benchmarks.harness import Figure, PartResult, Progress, say
from benchmarks.replay import replay_live, replay_params, replay_simulated
from catacloud.simulate import Params, TraceJob, load_trace, lower_bound, simulate

TRACES = Path(__file__).resolve().parent.parent / "catacloud" / "data" / "traces"
TRACE = TRACES / "ci-week.csv"
# The live replay: busy hours behind a merge queue (catacloud.trace.busy_window, seed 7), on a
# clock 30 times faster (a billed hour lasts 2 minutes), a warm pool of 2 in front.
REPLAY_TRACE = TRACES / "ci-2h.csv"
COMPRESSION = 30.0
REPLAY_POOL = 2
AGREE = 0.10  # live and simulated within 10% of each other
IDLE_TARGET = 0.30
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
    replay: bool = True,
    replay_jobs: list[TraceJob] | None = None,
    compression: float = COMPRESSION,
    replay_pool: int = REPLAY_POOL,
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
    if replay:
        _replay(result, replay_jobs or load_trace(REPLAY_TRACE), compression, replay_pool, progress)
    return result


def _replay(
    result: PartResult, jobs: list[TraceJob], compression: float, pool: int, progress: Progress
) -> None:
    """The same trace through the live stack and the simulator: bought, cost, idle, wait."""
    live, measured = replay_live(jobs, compression=compression, pool_size=pool, progress=progress)
    progress("cost: simulating the replayed trace with the measured boot times")
    params = replay_params(measured)
    sim, sim_result = replay_simulated(jobs, pool_size=pool, params=params)
    run_out = simulate(jobs, f"pool:{pool}:cost" if pool else "cost", params)
    policy = f"pool:{pool}:cost" if pool else "cost"
    result.data["replay"] = {
        "policy": policy,
        "jobs": len(jobs),
        "compression": compression,
        "trace": REPLAY_TRACE.name,
        "live": live.row(),
        "simulated": sim.row(),
        "measured": measured,
        "run_out_idle_share": run_out.shares()["idle"],
    }

    def agree(name: str, a: float, b: float, unit: str, shown: str) -> Figure:
        ratio = round(a / b, 3) if b else None
        met = b > 0 and abs(a - b) <= AGREE * b
        return Figure(
            f"replay ({policy}): {name}, live",
            shown_value(a),
            unit,
            "within 10% of the simulator",
            f"simulated {shown}",
            ratio,
            met,
        )

    def shown_value(v: float) -> float:
        return round(v, 4) if v < 10 else round(v, 1)

    result.figures += [
        agree("machines bought", live.machines, sim.machines, "machines", f"{sim.machines}"),
        agree("cost", live.cost, sim.cost, "$", f"${sim.cost:.4f}"),
        agree(
            "idle share of cost",
            live.shares["idle"] * 100,
            sim.shares["idle"] * 100,
            "%",
            f"{sim.shares['idle']:.1%}",
        ),
        agree("p95 wait", live.wait_p95, sim.wait_p95, "s", f"{sim.wait_p95:.0f} s"),
        Figure(
            f"replay ({policy}): idle share of cost, live",
            round(live.shares["idle"] * 100, 1),
            "%",
            f"<= {IDLE_TARGET:.0%}",
            f"simulated {sim.shares['idle']:.1%}",
            met=live.shares["idle"] <= IDLE_TARGET and sim.shares["idle"] <= IDLE_TARGET,
            note=f"job {live.shares['job']:.0%}, warm {live.shares['warm']:.0%}, "
            f"tail {live.shares['tail']:.0%}; billed to the end of the last job (run out "
            f"under retention, simulated: idle {run_out.shares()['idle']:.0%})",
        ),
        Figure(
            f"replay ({policy}): machines bought while a paid one could serve",
            measured["needless_purchases"],
            "machines",
            "0",
            met=measured["needless_purchases"] == 0,
            note=f"read back from the event log; {live.jobs} jobs, {measured['failed']} not succeeded",
        ),
        Figure(
            "replay: live boot (local machine), median",
            round(measured["boot_live_s"], 2),
            "s",
            "",
            note=f"{measured['boot_trace_s']:.0f} s at trace scale; the simulator boots its n-th "
            "machine in the n-th live machine's time",
        ),
        Figure(
            "replay: agent's time around a job (fetch, start, end), median",
            round(measured["job_overhead_trace_s"] / compression, 2),
            "s",
            "",
            note=f"{measured['job_overhead_trace_s']:.0f} s at trace scale (clock x{compression:g}); "
            "the simulator holds each machine that much longer than its job's run",
        ),
    ]
    assert sim_result.jobs == len(jobs)
