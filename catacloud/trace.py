"""Bursty CI-like job trace generators (for ``catacloud simulate`` and the benchmarks).

``generate``: a week. Working hours (09:00-18:00 on weekdays) see bursts of pushes: a burst
(a merge train, a review round) brings a few pushes minutes apart, and every push triggers
several jobs of a few configurations at once. Nights and weekends are quiet: an occasional
push and a nightly batch. Durations are lognormal around each configuration's median, clipped
to 2-20 minutes.

``busy_window``: the busy hours of a team behind a merge queue: a push every ``push_every``
seconds on average (gaps gamma-distributed, ``regularity`` 1 is Poisson, higher is steadier),
each a burst of jobs of the same configurations at once.

    python -m catacloud.trace --days 7 --seed 7 --output catacloud/data/traces/ci-week.csv
    python -m catacloud.trace --window-minutes 120 --seed 7 --output catacloud/data/traces/ci-2h.csv
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

from catacloud.simulate import TraceJob, write_trace

# config: (median minutes, probability that a push runs it)
CONFIGS: dict[str, tuple[float, float]] = {
    "lint": (3.0, 1.0),
    "unit": (6.0, 1.0),
    "integration": (12.0, 0.6),
    "build": (9.0, 0.4),
    "e2e": (15.0, 0.25),
}
DAY = 86400.0


def _duration(rng: random.Random, median_minutes: float) -> float:
    seconds = rng.lognormvariate(math.log(median_minutes * 60), 0.45)
    return min(1200.0, max(120.0, seconds))


def _push(rng: random.Random, at: float) -> list[TraceJob]:
    jobs = []
    for name, (median, p) in CONFIGS.items():
        if rng.random() < p:
            jobs.append(TraceJob(at + rng.uniform(0, 5), _duration(rng, median), name))
    return jobs


def generate(
    *, days: int = 7, seed: int = 7, bursts_per_hour: float = 7.0, pushes_per_burst: float = 3.0
) -> list[TraceJob]:
    """Jobs over ``days`` days starting on a Monday at 00:00 (times in seconds from then)."""
    rng = random.Random(seed)
    jobs: list[TraceJob] = []
    for day in range(days):
        start = day * DAY
        weekday = day % 7 < 5
        if weekday:
            t = start + 9 * 3600
            while True:
                t += rng.expovariate(bursts_per_hour / 3600)
                if t >= start + 18 * 3600:
                    break
                pushes = 1 + int(rng.expovariate(1 / max(0.01, pushes_per_burst - 1)))
                at = t
                for _ in range(pushes):
                    jobs += _push(rng, at)
                    at += rng.expovariate(1 / 90)  # pushes in a burst: ~90 s apart
        # Quiet hours: an occasional push.
        t = start
        while True:
            t += rng.expovariate(0.3 / 3600)
            if t >= start + DAY:
                break
            if weekday and start + 9 * 3600 <= t < start + 18 * 3600:
                continue
            jobs += _push(rng, t)
        # The nightly batch at 02:00: every configuration a few times.
        for name, (median, _) in CONFIGS.items():
            for _ in range(3):
                jobs.append(TraceJob(start + 2 * 3600 + rng.uniform(0, 60), _duration(rng, median), name))
    return sorted(jobs, key=lambda j: j.submit)


def busy_window(
    *, minutes: float = 120.0, seed: int = 7, push_every: float = 90.0, regularity: float = 4.0
) -> list[TraceJob]:
    """Jobs over ``minutes`` of busy hours (times in seconds from the window's start)."""
    rng = random.Random(seed)
    jobs: list[TraceJob] = []
    t = 0.0
    while True:
        t += rng.gammavariate(regularity, push_every / regularity)
        if t >= minutes * 60:
            break
        jobs += _push(rng, t)
    return sorted(jobs, key=lambda j: j.submit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--bursts-per-hour", type=float, default=7.0)
    parser.add_argument(
        "--window-minutes", type=float, default=None, help="busy hours only: a window this long"
    )
    parser.add_argument("--push-every", type=float, default=90.0, help="window: mean seconds between pushes")
    parser.add_argument("--output", default="-")
    args = parser.parse_args(argv)
    if args.window_minutes is not None:
        jobs = busy_window(minutes=args.window_minutes, seed=args.seed, push_every=args.push_every)
    else:
        jobs = generate(days=args.days, seed=args.seed, bursts_per_hour=args.bursts_per_hour)
    if args.output == "-":
        import sys

        print("submit_time_seconds,duration_seconds,config")
        for j in jobs:
            sys.stdout.write(f"{j.submit:.1f},{j.duration:.1f},{j.config}\n")
    else:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        write_trace(args.output, jobs)
        print(f"wrote {len(jobs)} jobs to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
