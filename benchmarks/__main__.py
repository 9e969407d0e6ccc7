"""`python -m benchmarks [--only PART[,PART]] [--quick] [--out DIR]`: run the benchmark parts
on the bench database, print a table, write BENCHMARKS.md and docs/bench/*.png."""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import PARTS, LoadSampler, PartResult, end_on_sigterm, say
from testkit.processes import ROOT

# Sizes: full and --quick (the smoke tests pass even smaller ones to the parts directly).
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "claim": {
        "full": {},
        "quick": {"concurrencies": (1, 4, 16), "runs": 1, "duration": 0.3, "members": 1500},
    },
    "rest": {"full": {"flame": True}, "quick": {"requests": 200, "runs": 1}},
    "submit": {"full": {}, "quick": {"warm": 3, "cold": 1}},
    "replenish": {"full": {}, "quick": {"samples": 3}},
    "reaper": {"full": {}, "quick": {"sizes": (10, 100), "runs": 1}},
    "admission": {"full": {}, "quick": {"orgs": 10, "jobs_per_org": 50, "runs": 1}},
    "cost": {"full": {}, "quick": {}},
    "fleet": {"full": {}, "quick": {"sizes": (20, 50), "baseline_sizes": (10,), "window": 6.0}},
    "ci": {"full": {}, "quick": {"samples": 3, "burst": 20, "pool_size": 4}},
    "ci_limits": {
        "full": {},
        "quick": {
            "github_jobs": 40,
            "repositories": 10,
            "github_machines": 10,
            "gitlab_jobs": 40,
            "days": 0.1,
            "gitlab_machines": 5,
            "per_job_days": 0.05,
        },
    },
    "images": {"full": {}, "quick": {"samples": 2, "cold_runs": 1, "jobs": 3}},
    "containers": {"full": {}, "quick": {"samples": 3, "jobs": 1, "runs": 5}},
    "tail": {"full": {}, "quick": {"jobs": 12, "machines": 3}},
    "hosts": {"full": {}, "quick": {"samples": 3, "hosts": 10, "window": 6.0, "rate": 5.0}},
    "selection": {"full": {}, "quick": {"samples": 3, "days": 1}},
}


def run_part(part: str, **kwargs: Any) -> PartResult:
    import importlib

    module = importlib.import_module(f"benchmarks.{part}")
    t0 = time.perf_counter()
    with LoadSampler() as load:
        result: PartResult = module.run(**kwargs)
    result.seconds = time.perf_counter() - t0
    result.load = load.summary()
    result.date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--only", default="", help=f"comma-separated parts: {','.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds, not minutes)")
    parser.add_argument("--out", default=str(ROOT), help="where BENCHMARKS.md and docs/bench/ go")
    parser.add_argument("--report", action="store_true", help="only rewrite BENCHMARKS.md and the plots")
    args = parser.parse_args(argv)
    end_on_sigterm()
    parts = [p.strip() for p in args.only.split(",") if p.strip()] or list(PARTS)
    if args.report:
        parts = []
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    out = Path(args.out)

    from benchmarks.harness import flush, setup_django_for_bench

    started = time.perf_counter()
    say("bench: preparing database catacloud_bench (Redis db 14)")
    setup_django_for_bench()
    from benchmarks import report
    from benchmarks.explain import EXPLANATIONS

    for part in parts:
        flush()
        say(f"{part}: starting")
        result = run_part(part, **SIZES[part]["quick" if args.quick else "full"])
        result.quick = args.quick
        report.save(result, out)
        say(f"{part}: done in {result.seconds:.0f}s")
    flush()
    results = report.load_all(out)
    path = report.write(results, out, report.environment(), EXPLANATIONS)
    say("")
    say(report.console_table([r for r in results if r.part in parts or args.report]))
    say(f"\nbench: wrote {path} and docs/bench/*.png in {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
