"""The cost simulator replays the real policy code: pure, fast, no Django."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import pytest

from catacloud.simulate import Params, TraceJob, load_trace, lower_bound, parse_policy, simulate, write_trace
from catacloud.trace import generate

HOURLY = Params(price_per_hour=Decimal("1"), billing_increment=3600, boot_seconds=45)
TWO = [TraceJob(0, 300, "unit"), TraceJob(600, 300, "unit")]  # two jobs 10 minutes apart


@pytest.mark.parametrize("policy", ["speed", "cost"])
def test_reusing_policies_run_two_nearby_jobs_on_one_machine_billed_one_hour(policy: str) -> None:
    result = simulate(TWO, policy, HOURLY)
    assert result.machines_created == 1
    assert result.machine_hours == 1 and result.cost == Decimal(1)
    assert sorted(result.waits) == [0, 45]  # the first job waits for the boot, the second not at all


def test_ephemeral_destroys_after_every_job_and_bills_two_hours() -> None:
    result = simulate(TWO, "ephemeral", HOURLY)
    assert result.machines_created == 2
    assert result.machine_hours == 2 and result.cost == Decimal(2)
    assert result.wait_max == 45


def test_lower_bound_is_total_job_seconds_times_price() -> None:
    params = Params(price_per_hour=Decimal("0.0095"))
    assert lower_bound(TWO, params) == (Decimal(600) * Decimal("0.0095") / 3600).quantize(Decimal("0.000001"))


@pytest.mark.parametrize("size", [1, 3])
def test_a_pool_with_no_jobs_bills_its_size_in_machine_hours_per_hour(size: int) -> None:
    result = simulate([], f"pool:{size}", HOURLY, until=3 * 3600)
    assert result.machine_hours == 3 * size
    assert result.jobs == 0


def test_retention_destroys_an_idle_machine_before_its_second_hour() -> None:
    result = simulate([TraceJob(0, 60, "unit")], "speed", HOURLY)
    assert result.machines_created == 1
    assert result.machine_hours == 1  # retired by the reaper inside the first paid hour


def test_a_machine_kept_busy_past_the_hour_bills_the_started_second_hour() -> None:
    result = simulate([TraceJob(0, 3000, "a"), TraceJob(3100, 600, "a")], "speed", HOURLY)
    assert result.machines_created == 1 and result.machine_hours == 2


def test_a_warm_pool_member_takes_the_job_without_waiting_and_refills_within_max_size() -> None:
    roomy = simulate([TraceJob(100, 60, "unit")], "pool:1", replace(HOURLY, pool_max_size=2))
    assert roomy.wait_max == 0
    assert roomy.machines_created == 2  # the member, and its replacement
    # max_size 1 (pool_create's default: the target): the member a job holds still counts
    tight = simulate([TraceJob(100, 60, "unit")], "pool:1", HOURLY)
    assert (tight.wait_max, tight.machines_created) == (0, 1)


def test_cost_waits_for_a_paid_machine_instead_of_buying() -> None:
    # Teach the simulator the runtime of "a" (60 s), then two overlapping jobs: cost waits for
    # the busy machine (free within max_wait, 90 s by default), speed buys a second one.
    jobs = [TraceJob(0, 60, "a"), TraceJob(1000, 60, "a"), TraceJob(1010, 60, "a")]
    assert simulate(jobs, "cost", HOURLY).machines_created == 1
    assert simulate(jobs, "speed", HOURLY).machines_created == 2


def test_policies_parse_and_bad_ones_are_refused() -> None:
    assert parse_policy("ephemeral") == ("speed", 0, False)
    assert parse_policy("pool:5:cost") == ("cost", 5, True)
    with pytest.raises(ValueError):
        parse_policy("cheap")


def test_trace_round_trips_and_the_generator_is_bursty_and_sized(tmp_path: Path) -> None:
    jobs = generate(days=2, seed=1)
    path = tmp_path / "t.csv"
    write_trace(path, jobs)
    loaded = load_trace(path)
    assert len(loaded) == len(jobs) > 100
    assert all(120 <= j.duration <= 1200 for j in loaded)
    day = [j for j in loaded if 9 * 3600 <= j.submit < 18 * 3600]
    assert len(day) > len(loaded) / 2  # working hours dominate


def test_the_shipped_trace_has_a_few_thousand_jobs() -> None:
    path = Path(__file__).resolve().parents[2] / "catacloud" / "data" / "traces" / "ci-week.csv"
    assert path.stat().st_size < 1_000_000
    assert 2000 <= len(load_trace(path)) <= 5000


def simulate_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """What ``catacloud simulate`` on the trace of TWO with ``args`` prints (it must exit 0)."""
    from catacloud.cli import main

    path = tmp_path / "t.csv"
    write_trace(path, TWO)
    assert main(["simulate", "--trace", str(path), *args]) == 0
    return capsys.readouterr().out


def test_the_cli_prints_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = simulate_cli(tmp_path, capsys, "--policy", "ephemeral", "--policy", "cost")
    assert "ephemeral" in out and "cost" in out and "lower bound" in out


# ---- attribution and budgets in the simulator -------------------------------------------------


def test_shares_split_every_cent_of_the_simulated_cost() -> None:
    # Two 5-minute jobs 10 minutes apart on one hourly machine: 45 s boot (idle), 600 s of
    # jobs, 255 s between them (idle), the rest of the hour after retention destroys it (tail)
    result = simulate(TWO, "cost", HOURLY)
    assert sum(result.by_kind.values()) == result.cost == Decimal(1)
    assert result.by_kind["job"] == (Decimal(600) / 3600).quantize(Decimal("0.000001"))
    assert result.by_kind["warm"] == 0
    assert result.by_kind["tail"] > 0
    pooled = simulate([TraceJob(600, 300, "unit")], "pool:1", HOURLY, until=3600)
    assert pooled.by_kind["warm"] > 0  # the member waited 600 s in the pool before its claim


def test_a_budget_stops_buying_and_counts_the_jobs_that_waited_on_it() -> None:
    # Three 10-minute jobs far apart, ephemeral machines at 1/h, budget 2: the third never runs
    jobs = [TraceJob(0, 600, "a"), TraceJob(7200, 600, "a"), TraceJob(14400, 600, "a")]
    result = simulate(jobs, "ephemeral", Params(price_per_hour=Decimal("1"), budget=Decimal("2")))
    assert (result.jobs, result.not_run, result.budget_waited) == (2, 1, 1)
    assert result.cost == Decimal(2)
    # hourly samples and one at every purchase, ending with the final spend
    assert [float(v) for _, v in result.spend_curve][-1] == 2.0
    assert sorted(float(v) for _, v in result.spend_curve) == [float(v) for _, v in result.spend_curve]
    unlimited = simulate(jobs, "ephemeral", Params(price_per_hour=Decimal("1")))
    assert unlimited.jobs == 3 and unlimited.budget_waited == 0


def test_a_daily_budget_renews_the_next_day() -> None:
    # one machine-hour a day: the second job waits for the next day's budget
    jobs = [TraceJob(0, 600, "a"), TraceJob(600, 600, "a"), TraceJob(90000, 600, "a")]
    params = Params(price_per_hour=Decimal("1"), budget=Decimal("1"), budget_period=86400)
    result = simulate(jobs, "ephemeral", params)
    assert (result.jobs, result.not_run, result.budget_waited) == (2, 1, 2)
    assert result.wait_max > 80000


def test_the_cli_takes_a_budget_and_prints_the_spend_curve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = simulate_cli(tmp_path, capsys, "--policy", "ephemeral", "--budget", "0.01")
    assert "budget-waited" in out and "spend curve" in out and "tail" in out


def test_spend_passes_the_budget_only_by_what_machines_running_when_it_was_reached_bill_after() -> None:
    # A 3-hour job runs; a second job arrives 10 minutes in; budget 1.5 at 1/h: no second
    # machine is bought, the short job waits for the paid one (which renews its hour and
    # takes it in its fourth hour)
    jobs = [TraceJob(0, 3 * 3600, "long"), TraceJob(600, 600, "short")]
    result = simulate(jobs, "cost", Params(price_per_hour=Decimal("1"), budget=Decimal("1.5")))
    assert result.budget_reached_at == 600
    assert (result.machines_created, result.budget_waited, result.not_run) == (1, 1, 0)
    assert result.waits == [45.0, 3 * 3600 + 45 - 600]
    assert result.cost == Decimal(4)  # four started hours of the one machine
    assert result.after_reached == Decimal(3)  # all billed after the budget was reached
    assert result.cost <= result.budget + result.after_reached


# ---- paid capacity first, as the scheduler decides ---------------------------------------------


def test_with_a_pool_in_front_sequential_jobs_reuse_the_machine_they_left() -> None:
    # Twelve 1-minute jobs one after another behind a pool of 2 (max_size 3: room for one
    # replacement while a job holds a member): the first job takes a member, which the pool
    # replaces; every later job takes the machine the previous one left (idle first)
    jobs = [TraceJob(600 + 120 * i, 60, "unit") for i in range(12)]
    result = simulate(jobs, "pool:2:cost", replace(HOURLY, pool_max_size=3), until=2400)
    assert result.machines_created == 3
    assert result.wait_max == 0


def test_a_short_pool_takes_in_an_idle_machine_instead_of_buying() -> None:
    # max_size 2: while a job holds a member the pool cannot replace it; when the job ends the
    # machine leaves the pool (it is used) and the short pool takes it back: nothing is bought
    jobs = [TraceJob(600 + 120 * i, 60, "unit") for i in range(12)]
    result = simulate(jobs, "pool:2:cost", HOURLY, until=2400)
    assert result.machines_created == 2


def test_until_done_bills_to_the_last_job_and_calls_the_rest_of_the_hour_tail() -> None:
    result = simulate([TraceJob(0, 600, "unit")], "cost", HOURLY, until_done=True)
    # 45 s boot (idle), 600 s job, then the unused rest of the paid hour is tail, not idle
    assert result.cost == Decimal(1)
    assert result.shares()["idle"] == pytest.approx(45 / 3600, abs=1e-3)
    assert result.shares()["tail"] == pytest.approx(1 - 645 / 3600, abs=1e-3)
    run_out = simulate([TraceJob(0, 600, "unit")], "cost", HOURLY)
    assert run_out.shares()["idle"] >= 0.75  # kept for reuse until retention, nobody came


def test_measured_boot_times_and_the_agents_time_around_a_job_are_replayed() -> None:
    jobs = [TraceJob(0, 600, "a"), TraceJob(0, 600, "b")]
    result = simulate(jobs, "speed", replace(HOURLY, boot_samples=(10.0, 70.0), job_overhead=30.0))
    assert sorted(result.waits) == [10.0, 70.0]  # the n-th machine boots in the n-th sample
    assert (result.machines_created, result.cost) == (2, Decimal(2))
    assert result.by_kind["job"] == (Decimal(2 * 630) / 3600).quantize(Decimal("0.000001"))


def test_the_busy_window_is_two_hours_of_pushes_each_a_burst_of_jobs() -> None:
    from catacloud.trace import busy_window

    jobs = busy_window(minutes=120, seed=7)
    shipped = load_trace(Path(__file__).resolve().parents[2] / "catacloud/data/traces/ci-2h.csv")
    assert [(round(j.submit, 1), round(j.duration, 1), j.config) for j in jobs] == [
        (j.submit, j.duration, j.config) for j in shipped
    ]
    assert all(0 <= j.submit < 7200 for j in jobs)
    pushes = {round(j.submit / 10) for j in jobs}  # jobs of one push arrive within seconds
    assert len(jobs) >= 2 * len(pushes) > 100


# ---- spot, capacity errors and interruptions ------------------------------------------------------

SPOT = replace(HOURLY, billing_increment=1, spot_price=Decimal("0.3"))


def test_spot_first_costs_its_price_and_a_capacity_error_falls_over_to_on_demand_for_the_cooldown() -> None:
    jobs = [TraceJob(0, 3600, "a")]
    spot = simulate(jobs, "ephemeral", SPOT)
    assert (spot.spot_machines, spot.cost) == (1, Decimal("0.3038"))  # 3,645 s (boot + job) at 0.3/h
    refused = simulate(
        [TraceJob(0, 600, "a"), TraceJob(100, 600, "a"), TraceJob(400, 600, "a")],
        "ephemeral",
        replace(SPOT, capacity_error_rate=1.0, cooldown=300),
    )
    # every spot try is refused; inside its cool-down none is tried: the first and the last
    # buys tried spot (the last after the cool-down ended), the middle one went on-demand at once
    assert (refused.capacity_errors, refused.spot_machines, refused.machines_created) == (2, 0, 3)
    assert refused.wait_max == 45  # falling over costs no wait


def test_an_interrupted_job_resumes_from_its_last_checkpoint_on_another_machine() -> None:
    jobs = [TraceJob(0, 7200, "train")]
    often = replace(SPOT, interruptions_per_hour=2.0, checkpoint_seconds=60, seed=3)
    result = simulate(jobs, "ephemeral", often)
    assert result.interruptions >= 1
    assert result.machines_created >= result.interruptions + 1  # a new machine after each (some die booting)
    assert result.jobs == 1 and result.not_run == 0
    # each interruption loses at most one checkpoint interval of work
    assert 0 < result.lost_seconds <= 60 * result.interruptions
    restart = simulate(jobs, "ephemeral", replace(often, checkpoint_seconds=0))
    assert restart.lost_seconds > result.lost_seconds  # without checkpoints it starts over
    assert restart.cost > result.cost


def test_a_week_on_spot_costs_less_than_on_demand_and_says_what_it_costs_in_wait() -> None:
    from catacloud.trace import generate

    jobs = generate(days=1, seed=5)
    ondemand = simulate(jobs, "speed", replace(HOURLY, billing_increment=1))
    spot = simulate(
        jobs,
        "speed",
        replace(SPOT, interruptions_per_hour=0.05, capacity_error_rate=0.05, checkpoint_seconds=300),
    )
    assert spot.cost < ondemand.cost
    assert spot.interruptions > 0 and spot.capacity_errors > 0
    assert spot.wait_p95 >= ondemand.wait_p95 - 1e-9  # interruptions only add waiting
    assert spot.jobs == ondemand.jobs and spot.not_run == 0


def test_a_reclaimed_idle_machine_moves_no_clock_and_a_requeued_job_is_not_counted_as_run() -> None:
    """An interruption scheduled for a machine that already ended moved the clock to it (a run
    of 30 minutes billed to day 2); a job interrupted and still waiting at the cut-off counted as
    run and as not run."""
    jobs = [TraceJob(0, 600, "a")]
    rare = replace(SPOT, interruptions_per_hour=0.01, seed=2, budget=Decimal(10))  # long after the job
    result = simulate(jobs, "ephemeral", rare)
    assert result.interruptions == 0
    assert result.spend_curve[-1][0] <= 700  # the spend curve ends when the work did
    sure = replace(SPOT, interruptions_per_hour=3600.0)  # within a second of each boot
    cut = simulate(jobs, "ephemeral", replace(sure, boot_seconds=0.0), until=100)
    assert cut.jobs + cut.not_run == 1
