"""Part `ci_limits`: CI against the forges' documented limits on a simulated clock (issue 49's
proofs; the clock, the worker and the runners as testkit/ci_sim.py describes them: nothing is
scaled, the clock jumps).

- **GitHub burst**: ``github_jobs`` workflow jobs queued at once over ``repositories``
  repositories of one installation, against the strict fake GitHub at its documented limits (an
  installation's 5,000 calls an hour and 50 more per repository above 20; 900 points a minute per
  endpoint; 80 content-creating requests a minute and 500 an hour, a just-in-time registration
  one), on ``github_machines`` machines, each job ``github_duration`` simulated seconds. Every job
  must succeed, no call to an endpoint may come sooner than a secondary limit's wait, calls per
  job at most 1.2, the reconciler's tick metric never standing still longer than two reaper ticks,
  and our request budget (4,500 an hour) never used up.
- **GitLab week**: ``gitlab_jobs`` CI jobs of one GitLab.com Free project (50 runners in seven
  days) arriving at random over ``days`` days, in class-runner mode: every job gets a runner, no
  cap refusal. Then ``per_job_days`` days of the same traffic in runner-per-job mode: the cap is
  a pending reason, never a failure.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.harness import Figure, PartResult, Progress, say, tenant


def _tenant(name: str, machines: int) -> Any:
    return tenant(
        name, kind="fake", max_instances=machines, max_concurrent_jobs=machines, max_pool_size=machines
    )


def _github(progress: Progress, **size: Any) -> dict[str, Any]:
    from testkit.ci_sim import github_burst

    t = _tenant("ci-limits-github", size["machines"])
    progress(f"ci_limits: GitHub burst of {size['jobs']} jobs over {size['repositories']} repositories")
    started = time.perf_counter()
    sim, figures = github_burst(t.org, t.machine_type, **size)
    figures["wall_seconds"] = time.perf_counter() - started
    start = sim.started
    figures["series"] = {
        "t": [s.t for s in sim.samples],
        "calls": [s.calls for s in sim.samples],
        "window_calls": [s.window_calls for s in sim.samples],
        "done": [s.done for s in sim.samples],
        "held": [s.held for s in sim.samples],
        "registrations": sorted(t0 - start for t0 in sim.fake.jit_issued),
        "reconciles": [r - start for r in sim.reconciles],
    }
    return figures


def _gitlab(progress: Progress, mode: str, **size: Any) -> dict[str, Any]:
    from testkit.ci_sim import gitlab_week

    t = _tenant(f"ci-limits-gitlab-{mode.replace('_', '-')}", size["machines"])
    progress(f"ci_limits: GitLab, {size['jobs']} jobs over {size['days']} days, runner mode {mode}")
    started = time.perf_counter()
    sim, figures = gitlab_week(t.org, t.machine_type, mode=mode, **size)
    figures["wall_seconds"] = time.perf_counter() - started
    figures["series"] = {
        "t": [s.t for s in sim.samples],
        "done": [s.done for s in sim.samples],
        "held": [s.held for s in sim.samples],
    }
    return figures


def run(
    *,
    github_jobs: int = 1000,
    repositories: int = 200,
    github_machines: int = 50,
    github_duration: float = 120.0,
    gitlab_jobs: int = 5000,
    days: float = 7.0,
    gitlab_machines: int = 20,
    gitlab_duration: float = 300.0,
    per_job_days: float = 1.0,
    progress: Progress = say,
) -> PartResult:
    result = PartResult(part="ci_limits", title="CI against the forges' limits, on a simulated clock")
    github = _github(
        progress,
        jobs=github_jobs,
        repositories=repositories,
        machines=github_machines,
        duration=github_duration,
    )
    week = _gitlab(
        progress, "class", jobs=gitlab_jobs, days=days, machines=gitlab_machines, duration=gitlab_duration
    )
    per_job = _gitlab(
        progress,
        "per_job",
        jobs=max(1, round(gitlab_jobs * per_job_days / days)),
        days=per_job_days,
        machines=gitlab_machines,
        duration=gitlab_duration,
        limit=per_job_days * 86400.0 + 3600.0,
    )
    result.data = {"github": github, "gitlab_class": week, "gitlab_per_job": per_job}
    result.figures = github_figures(github) + gitlab_figures(week, per_job)
    return result


def github_figures(g: dict[str, Any]) -> list[Figure]:
    n = g["jobs"]
    ok = g["outcomes"].get("success", 0)
    per_job = g["calls_per_job"]
    top = sorted(g["calls_by_endpoint"].items(), key=lambda kv: -kv[1])
    split = ", ".join(f"{k} {v / n:.3f}" for k, v in top)
    return [
        Figure(f"GitHub burst: jobs succeeded of {n}", ok, "jobs", f"= {n}", met=ok == n),
        Figure(
            "GitHub burst: simulated time to the last job's end",
            round(g["simulated_seconds"] / 3600, 2),
            "h",
            note=f"{g['wall_seconds']:.0f} s of real time",
        ),
        Figure(
            "GitHub burst: calls per job",
            round(per_job, 3),
            "calls",
            "<= 1.2",
            met=per_job <= 1.2,
            note=split,
        ),
        Figure(
            "GitHub burst: calls to an endpoint sooner than a secondary limit's wait",
            g["limit_violations"],
            "calls",
            "= 0",
            met=g["limit_violations"] == 0,
            note=f"{g['limit_answers']} secondary-limit answers",
        ),
        Figure(
            "GitHub burst: registrations in the busiest minute / hour (sliding)",
            g["registrations_peak_minute"],
            "per minute",
            note=f"{g['registrations_peak_hour']} in the busiest hour; GitHub allows 80 and 500, "
            "our pacing keeps 72 and 450 per window",
        ),
        Figure(
            "GitHub burst: longest time without a reconcile ending",
            round(g["reconcile_gap_max"], 1),
            "s",
            "<= 120 s",
            met=g["reconcile_gap_max"] <= 120.0,
            note=f"{g['reconciles']} reconciles (the reaper ticks every 60 s)",
        ),
        Figure(
            "GitHub burst: our request budget's busiest hour",
            g["budget_peak"],
            "calls",
            "< 4500",
            met=g["budget_peak"] < 4500,
            note=f"GitHub's own remaining calls never below {g['remaining_min']}",
        ),
    ]


def gitlab_figures(week: dict[str, Any], per_job: dict[str, Any]) -> list[Figure]:
    n = week["jobs"]
    ok = week["outcomes"].get("success", 0)
    ran = per_job["outcomes"].get("success", 0)
    return [
        Figure(f"GitLab week, class runner: jobs succeeded of {n}", ok, "jobs", f"= {n}", met=ok == n),
        Figure(
            "GitLab week, class runner: runner cap refusals",
            week["cap_refusals"],
            "",
            "= 0",
            met=week["cap_refusals"] == 0,
            note=f"{week['runners_created']} runner created; {week['wall_seconds']:.0f} s of real time",
        ),
        Figure(
            "GitLab week, class runner: calls per job",
            round(week["calls_per_job"], 2),
            "calls",
            note=", ".join(f"{k} {v / n:.2f}" for k, v in week["calls_by_endpoint"].items()),
        ),
        Figure(
            f"GitLab runner per job, {per_job['queued']} jobs in a day: runner jobs failed",
            per_job["runner_jobs_failed"],
            "",
            "= 0",
            met=per_job["runner_jobs_failed"] == 0,
            note=f"{ran} ran (the cap: 50 runners in seven days), {per_job['runner_jobs_held']} held "
            f"with the cap as their pending reason, {per_job['cap_refusals']} refusal (learnt)",
        ),
    ]


def plot(result: PartResult, out: Any) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.harness import save_figure

    g, week = result.data["github"]["series"], result.data["gitlab_class"]["series"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    hours = [t / 3600 for t in g["t"]]
    regs = g["registrations"]
    a.step(
        [r / 3600 for r in regs], range(1, len(regs) + 1), where="post", label="registrations (JIT configs)"
    )
    a.plot(hours, g["done"], label="jobs succeeded")
    a.plot(hours, g["held"], label="runner jobs held by a limit")
    a.set_xlabel("simulated hours")
    a.set_title(f"GitHub: a burst of {result.data['github']['jobs']} jobs")
    a.grid(alpha=0.3)
    a.legend(fontsize=7)
    b.plot(hours, g["calls"], label="calls (all)")
    b.plot(hours, g["window_calls"], label="our budget: calls this hour")
    b.axhline(4500, color="red", ls=":", label="budget (4,500 an hour)")
    b.set_xlabel("simulated hours")
    b.set_title("GitHub: calls against the budget")
    b.grid(alpha=0.3)
    b.legend(fontsize=7)
    days = [t / 86400 for t in week["t"]]
    c.plot(days, week["done"], label="class runner: jobs ended")
    c.set_xlabel("simulated days")
    c.set_title("GitLab.com Free: a week in class-runner mode")
    c.grid(alpha=0.3)
    c.legend(fontsize=7)
    path = out / "docs" / "bench"
    path.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path / "ci_limits.png")
