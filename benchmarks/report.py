"""BENCHMARKS.md and the PNG plots in docs/bench/, from every part's saved results."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from benchmarks.harness import PARTS, PartResult, save_figure

# How far apart two runs of the same code land, and how to read a figure (BENCHMARKS.md).
NOISE = [
    "## How far apart two runs of the same code land",
    "",
    "The benchmark machine is shared (2 cores, several engineers' builds and tests): a figure",
    "moves with whatever else runs. The claim part's ratio to the raw floor at 16 claimers read",
    "0.66 in one saved report and 0.33 and 0.52 in two later runs of the same code on the same",
    "machine class (claims at 1,711 and 2,558/s against a floor of 4,323 and 4,900/s): **two runs",
    "of the same code may land a factor of 2 apart on a ratio, and 1.5x apart on a throughput**.",
    "So each figure here is the median of its interleaved runs (the variants take turns, in a",
    "rotating order, within each run), the *spread over runs* column gives the lowest and highest",
    "run of what the target judges (the ratio when there is one), and a target met in some runs",
    "and missed in others reads **within noise** with the count: that target is neither met nor",
    "missed on this machine, only a quieter one can tell. Every part also records the machine's",
    "load while it ran (the 1-minute load average, and CPU use, which includes the part's own",
    "processes): numbers taken at a load above the core count are not comparable with numbers",
    "taken on a quiet machine. Compare two builds by running both in the same session, never a",
    "fresh number with an old report.",
    "",
]
ORDER = (*PARTS, "chaos")


def environment() -> dict[str, str]:
    import django
    import redis
    from django.conf import settings
    from django.db import connection

    cpu = "unknown"
    mem = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    except OSError:
        pass
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        pg = cursor.fetchone()[0]
    try:
        rv = redis.Redis.from_url(settings.REDIS_URL).info("server")["redis_version"]
    except Exception:
        rv = "unknown"
    return {
        "cores": str(os.cpu_count()),
        "memory": mem,
        "cpu": cpu,
        "os": platform.platform(),
        "python": platform.python_version(),
        "django": django.get_version(),
        "postgresql": pg,
        "redis": rv,
    }


def save(result: PartResult, out: Path) -> None:
    d = out / "docs" / "bench"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{result.part}.json").write_text(json.dumps(result.to_json(), indent=1, default=str))


def load_all(out: Path) -> list[PartResult]:
    d = out / "docs" / "bench"
    found = []
    for part in ORDER:
        p = d / f"{part}.json"
        if p.exists():
            found.append(PartResult.from_json(json.loads(p.read_text())))
    return found


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}".rstrip("0").rstrip(".") if abs(v) < 10 else f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _spread(f: Any) -> str:
    """The judged quantity's lowest and highest run, and how many runs there were."""
    if not f.runs or f.spread is None:
        return ""
    lo, hi = f.spread
    if f.ratio is not None:
        return f"{lo:g}x - {hi:g}x ({f.runs} runs)"
    return f"{_fmt(lo)} - {_fmt(hi)} ({f.runs} runs)"


def table(result: PartResult) -> str:
    lines = [
        "| figure | value (median) | spread over runs | target | baseline | ratio | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in result.figures:
        status = f.status()
        status = f"**{status}**" if status.startswith("not met") else status
        ratio = "" if f.ratio is None else f"{f.ratio:g}x"
        value = f"{_fmt(f.value)} {f.unit}".strip()
        note = f" ({f.note})" if f.note else ""
        lines.append(
            f"| {f.name}{note} | {value} | {_spread(f)} | {f.target} | {f.baseline} | {ratio} | {status} |"
        )
    return "\n".join(lines)


def load_line(result: PartResult) -> str:
    """What else the machine was doing while the part ran."""
    load = result.load
    if not load:
        return "Machine load during the part: not recorded (a run from before it was)."
    la = load["load_1m"]
    busy = load.get("cpu_busy_percent")
    text = (
        f"Machine load during the part: 1-minute load average {la['median']:.1f} "
        f"({la['min']:.1f} - {la['max']:.1f}) on {load['cores']} cores"
    )
    if busy:
        text += f"; CPU busy {busy['median']:.0f}% (max {busy['max']:.0f}%), this part's processes included"
    return text + "."


def console_table(results: list[PartResult]) -> str:
    rows = []
    for r in results:
        for f in r.figures:
            status = f.status().replace("not met", "NOT MET")
            ratio = "" if f.ratio is None else f"{f.ratio:g}x"
            rows.append((r.part, f.name[:58], f"{_fmt(f.value)} {f.unit}".strip(), f.target, ratio, status))
    widths = [
        max(len(str(row[i])) for row in rows + [("part", "figure", "value", "target", "ratio", "status")])
        for i in range(6)
    ]
    out = []
    for row in [("part", "figure", "value", "target", "ratio", "status"), *rows]:
        out.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(out)


def plots(results: list[PartResult], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    def tidy(ax: Any) -> None:
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))

    def cdf(ax: Any, values: Any, *style: str, **kw: Any) -> None:
        """The share of ``values`` at or below each of them (nothing when there are none)."""
        xs = sorted(values)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], *style, **kw)

    def cdf_axes(ax: Any, *, xlabel: str, ylabel: str, title: str) -> None:
        """Label a CDF plot whose x axis (a latency) is logarithmic."""
        ax.set_xscale("log")
        tidy(ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)

    d = out / "docs" / "bench"
    made = []
    by = {r.part: r for r in results}
    if "claim" in by:
        data = by["claim"].data
        cs = data["concurrencies"]
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
        variants = data.get("variants", ["service", "floor"])
        styles = {"service": "o-", "id only": "o:", "floor": "^:", "floor+event": "v:"}
        styles |= {"procrastinate": "s--", "pgqueuer": "d-."}
        for v in variants:
            a.plot(cs, [data["table"][str(c)][v]["throughput"] for c in cs], styles.get(v, "x-"), label=v)
        a.set_xscale("log", base=2)
        a.set_xticks(cs, [str(c) for c in cs])
        a.set_xlabel("concurrent claimers (one connection each)")
        a.set_ylabel("claims / s (median of runs)")
        a.set_title("Claim throughput")
        a.legend()
        a.grid(alpha=0.3)
        key = "16" if "16" in data["samples_ms"] else str(max(cs))
        for v in variants:
            cdf(b, data["samples_ms"][key][v], label=v)
        cdf_axes(
            b,
            xlabel="latency (ms, log)",
            ylabel="fraction of claims",
            title=f"Claim latency CDF at {key} claimers",
        )
        made.append(save_figure(fig, d / "claim.png"))
    latency = [(p, k) for p, k in (("rest", "samples_ms"),) if p in by and by[p].data.get(k)]
    if latency or "submit" in by or "replenish" in by:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        a, b = axes
        if "rest" in by and by["rest"].data.get("samples_ms"):
            cdf(a, by["rest"].data["samples_ms"], label="POST /acquire/")
            a.axvline(15, color="green", ls=":", label="p50 target 15 ms")
            a.axvline(50, color="red", ls=":", label="p99 target 50 ms")
            cdf_axes(
                a,
                xlabel="latency (ms, log)",
                ylabel="fraction of requests",
                title="REST acquire latency CDF (8 clients)",
            )
        series = []
        if "submit" in by:
            series += [
                ("submit warm", by["submit"].data["warm_s"]),
                ("submit cold", by["submit"].data["cold_s"]),
            ]
        if "replenish" in by:
            series.append(("claim -> replacement provisioning", by["replenish"].data["delays_s"]))
        for label, vals in series:
            cdf(b, [x * 1000 for x in vals], "o-", ms=3, label=label)
        cdf_axes(b, xlabel="ms (log)", ylabel="fraction", title="Submit to running; replenishment")
        made.append(save_figure(fig, d / "latency.png"))
    if "cost" in by:
        data = by["cost"].data
        fig, a = plt.subplots(figsize=(8, 4.8))
        for r in data["policies"]:
            a.scatter(r["wait_p95"], r["cost"], s=40)
            a.annotate(r["policy"], (r["wait_p95"], r["cost"]), textcoords="offset points", xytext=(5, 4))
        sw = data["sweep"]
        a.plot([r["wait_p95"] for r in sw], [r["cost"] for r in sw], "k--", alpha=0.5, lw=1)
        for r in sw:
            a.annotate(
                f"max_wait {r['max_wait']}s",
                (r["wait_p95"], r["cost"]),
                textcoords="offset points",
                xytext=(4, -12),
                fontsize=7,
                color="grey",
            )
        a.axhline(data["lower_bound"], color="green", ls=":", label=f"lower bound ${data['lower_bound']:.2f}")
        a.set_xlabel("p95 wait (s)")
        a.set_ylabel("billed cost ($, one week)")
        a.set_title(f"Cost vs p95 wait per policy ({data['jobs']} jobs, hourly billing)")
        a.legend()
        a.grid(alpha=0.3)
        made.append(save_figure(fig, d / "cost.png"))
        if data.get("replay"):
            made.append(_replay_plot(data["replay"], d))
        if data.get("budget", {}).get("spend_curve"):
            b = data["budget"]
            fig, a = plt.subplots(figsize=(8, 4))
            curve = b["spend_curve"]
            a.step([p[0] for p in curve], [p[1] for p in curve], where="post", label="spend + committed")
            a.axhline(b["budget"], color="red", ls="--", label=f"budget ${b['budget']:.2f}")
            a.set_xlabel("hours into the week")
            a.set_ylabel("$ spent and committed")
            a.set_title(
                f"Budget scenario (cost policy): {b['budget_waited']} jobs waited on the budget, "
                f"{b['not_run']} never ran"
            )
            a.legend()
            a.grid(alpha=0.3)
            made.append(save_figure(fig, d / "budget.png"))
    if "fleet" in by and (by["fleet"].data.get("rows") or by["fleet"].data.get("baseline")):
        from benchmarks.fleet import plot as fleet_plot

        made.append(fleet_plot(by["fleet"], out))
    if "ci" in by and by["ci"].data.get("forges"):
        from benchmarks.ci import plot as ci_plot

        made.append(ci_plot(by["ci"], out))
    if "chaos" in by and by["chaos"].data.get("series"):
        from benchmarks.chaos import plot

        made.append(plot(by["chaos"], out))
    if "tail" in by and "start_ms" in by["tail"].data:
        _tail_plot(by["tail"].data, d, plt)
        made.append("tail.png")
    if "ci_limits" in by and by["ci_limits"].data.get("github"):
        from benchmarks.ci_limits import plot as ci_limits_plot

        made.append(ci_limits_plot(by["ci_limits"], out))
    if "hosts" in by and "warm_s" in by["hosts"].data:
        data = by["hosts"].data
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
        for name, style in (("host slot", "o-"), ("warm machine", "s--")):
            cdf(a, [v * 1000 for v in data["warm_s"][name]], style, ms=3, label=name)
        cdf_axes(
            a, xlabel="submit -> running (ms)", ylabel="share of jobs", title="A job's start, interleaved"
        )
        latency = [v * 1000 for v in data["simulated"]["latency_s"]]
        cdf(b, latency, "o-", ms=2, label=f"{len(latency)} slots")
        cdf_axes(
            b,
            xlabel="slot request -> its host's order (ms)",
            ylabel="share of slots",
            title="Simulated hosts",
        )
        made.append(save_figure(fig, d / "hosts.png"))
    return made


def _tail_plot(data: dict[str, Any], d: Path, plt: Any) -> None:
    """tail.png: submit -> the first instruction (older runs: submit -> running) by percentile
    (each phase, and all jobs' submit -> running beside it), and each stage's share."""
    import math

    qs = [q for q in data["quantiles"] if q >= 50]
    # x: how far into the tail (p50 at 0.3, p90 at 1, p99 at 2, p99.9 at 3), the max a step beyond
    last = max(-math.log10(1 - q / 100) for q in qs if q < 100)
    xs = [-math.log10(1 - q / 100) if q < 100 else last + 0.4 for q in qs]
    ticks = {50: "p50", 90: "p90", 99: "p99", 99.9: "p99.9", 100: "max"}

    def curve(values: list[float]) -> list[float]:
        return [v for q, v in zip(data["quantiles"], values, strict=True) if q >= 50]

    measured = data.get("first_ms") or data["start_ms"]
    what = "first instruction" if "first_ms" in data else "running"
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for label, style in (("burst", "o-"), ("trickle", "s-"), ("all", "k--")):
        if label in measured:
            n = data["jobs_per_phase"].get(label, data["jobs"])
            a.plot(xs, curve(measured[label]), style, ms=3, label=f"{label} ({n} jobs)")
    if "first_ms" in data:
        a.plot(xs, curve(data["start_ms"]["all"]), ":", color="grey", label="all: submit -> running")
    a.axhline(250, color="green", ls=":", label="p99.9 goal 250 ms")
    a.axhline(1000, color="red", ls=":", label="max goal 1 s")
    a.set_title(f"Warm submit -> {what} ({data['jobs']} jobs, {data['machines']} machines)")
    a.set_ylabel("ms")
    for name, values in data["stage_ms"].items():
        b.plot(xs, curve(values), "o-", ms=3, label=name)
    b.axhline(250, color="green", ls=":")
    b.set_title("Its stages, all jobs")
    for ax in (a, b):
        marked = [(x, ticks[q]) for x, q in zip(xs, qs, strict=True) if q in ticks]
        ax.set_xticks([x for x, _ in marked], [label for _, label in marked])
        ax.set_xlabel("percentile")
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, d / "tail.png")


def _alive(timeline: list[list[float]], at: list[float]) -> list[int]:
    return [sum(1 for a, b in timeline if a <= t < b) for t in at]


def _replay_plot(replay: dict[str, Any], d: Path) -> str:
    """Machines alive over the trace, live and simulated, with the side-by-side figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    live, sim = replay["live"], replay["simulated"]
    end = max(b for _, b in live["timeline"] + sim["timeline"])
    at = [i * end / 400 for i in range(401)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    hours = [t / 3600 for t in at]
    a.step(hours, _alive(live["timeline"], at), where="post", label="live stack")
    a.step(hours, _alive(sim["timeline"], at), where="post", ls="--", label="simulator")
    a.set_xlabel("hours into the trace")
    a.set_ylabel("machines alive (billing)")
    a.set_title(f"{replay['jobs']} jobs replayed ({replay['policy']}, clock x{replay['compression']:g})")
    a.legend()
    a.grid(alpha=0.3)
    names = ["machines", "cost", "idle share", "p95 wait"]
    lv = [live["machines"], live["cost"], live["idle_share"], live["wait_p95"]]
    sv = [sim["machines"], sim["cost"], sim["idle_share"], sim["wait_p95"]]
    ratios = [x / y if y else 0.0 for x, y in zip(lv, sv, strict=True)]
    b.barh(names, ratios, color=["green" if 0.9 <= r <= 1.1 else "orange" for r in ratios])
    b.axvline(1.0, color="black", lw=1)
    for lim in (0.9, 1.1):
        b.axvline(lim, color="grey", ls=":", lw=1)
    b.set_xlabel("live / simulated (10% band dotted)")
    b.invert_yaxis()
    return save_figure(fig, d / "replay.png")


def write(results: list[PartResult], out: Path, env: dict[str, str], explanations: dict[str, str]) -> Path:
    made = plots(results, out)
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`python -m benchmarks`); `make bench ONLY=claim` reruns one part and",
        "rewrites this page from every part's saved results in `docs/bench/*.json`. Figures are medians",
        "of several runs; every ratio compares numbers measured in the same run.",
        "",
        *NOISE,
        "## Machine",
        "",
        f"- {env['cores']} cores ({env['cpu']}), {env['memory']} memory, {env['os']}",
        f"- Python {env['python']}, Django {env['django']}, PostgreSQL {env['postgresql']} (embedded), "
        f"Redis {env['redis']} (embedded)",
        "",
    ]
    for r in results:
        lines += [
            f"## {r.title} (`{r.part}`)",
            "",
            f"Run {r.date}, {r.seconds:.0f} s{' (quick sizes)' if r.quick else ''}. {load_line(r)}",
            "",
        ]
        lines.append(table(r))
        lines.append("")
        for n in r.notes:
            lines += [n, ""]
        if r.part == "fleet" and "rows" in r.data:
            from benchmarks.fleet import table_note

            lines += [table_note(r), ""]
        if r.part in explanations:
            lines += [explanations[r.part], ""]
        for png, part in (
            ("claim.png", "claim"),
            ("latency.png", "replenish"),
            ("cost.png", "cost"),
            ("replay.png", "cost"),
            ("budget.png", "cost"),
            ("chaos.png", "chaos"),
            ("fleet.png", "fleet"),
            ("ci.png", "ci"),
            ("ci_limits.png", "ci_limits"),
            ("tail.png", "tail"),
            ("hosts.png", "hosts"),
        ):
            if part == r.part and png in made:
                lines += [f"![{png}](docs/bench/{png})", ""]
    path = out / "BENCHMARKS.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path
