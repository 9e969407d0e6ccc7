"""Every benchmark part at tiny size, so the harness cannot rot. No timing assertions: only
shapes, counts and invariants (no double claims, quotas respected)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.__main__ import run_part
from benchmarks.harness import PartResult
from catacloud.agent.containers import engine_path

pytestmark = pytest.mark.django_db(transaction=True)


def quiet(_: str) -> None:
    pass


def sane(result: PartResult, part: str) -> None:
    assert result.part == part and result.figures
    for f in result.figures:
        assert isinstance(f.value, int | float) and not math.isnan(f.value), f


def test_claim(tmp_path: Path) -> None:
    result = run_part("claim", concurrencies=(1, 4), runs=2, duration=0.1, members=300, progress=quiet)
    sane(result, "claim")
    assert result.data["double_claims"] == 0
    for c in ("1", "4"):
        for v in result.data["variants"]:  # service, id only, floor(+event), the installed peers
            row = result.data["table"][c][v]
            assert row["claims"] > 0
            # what a claim costs the claimers and PostgreSQL, counted (the gap's split)
            assert row["client_ms"] > 0 and row["postgres_ms"] > 0
    # every judged figure is the median of its runs with their spread; the load is recorded
    vs_floor = result.figures[0]
    assert vs_floor.runs == 2 and vs_floor.spread is not None and vs_floor.met_runs is not None
    assert vs_floor.spread[0] <= vs_floor.ratio <= vs_floor.spread[1]  # type: ignore[operator]
    assert result.load["cores"] and result.load["load_1m"]["max"] >= result.load["load_1m"]["min"]
    report.save(result, tmp_path)
    assert report.plots(report.load_all(tmp_path), tmp_path) == ["claim.png"]
    text = report.write(report.load_all(tmp_path), tmp_path, report.environment(), {}).read_text()
    assert "## How far apart two runs of the same code land" in text
    assert "Machine load during the part: 1-minute load average" in text
    assert f"({vs_floor.runs} runs)" in text


def test_a_target_met_in_some_runs_only_reads_within_noise() -> None:
    """The claim's ratio to the floor read 0.66, then 0.33 and 0.52 on the same code: one
    number per figure made the 60% target met or missed by the machine's mood."""
    from benchmarks.harness import of_runs

    def at_least_60(x: float) -> bool:
        return x >= 0.6

    noisy = of_runs("vs floor", [1711, 2558, 2900], "claims/s", ratios=[0.33, 0.52, 0.66], check=at_least_60)
    assert (noisy.ratio, noisy.spread, noisy.runs, noisy.met_runs) == (0.52, [0.33, 0.66], 3, 1)
    assert noisy.status() == "not met, within noise (1 of 3 runs met it)"
    clear = of_runs("vs floor", [2900, 3000], "claims/s", ratios=[0.61, 0.7], check=at_least_60)
    assert clear.status() == "met"
    assert "0.33x - 0.66x (3 runs)" in report.table(PartResult(part="claim", title="t", figures=[noisy]))


def test_rest() -> None:
    result = run_part("rest", clients=2, requests=20, runs=1, single=10, progress=quiet)
    sane(result, "rest")
    assert result.data["errors"] == 0 and result.data["double_claims"] == 0
    assert result.data["ok"] == 20


def test_submit() -> None:
    result = run_part("submit", warm=1, cold=1, pool_size=1, progress=quiet)
    sane(result, "submit")
    assert len(result.data["warm_s"]) == 1 and len(result.data["cold_s"]) == 1
    assert all(x > 0 for x in result.data["warm_s"] + result.data["cold_s"])


def test_replenish() -> None:
    result = run_part("replenish", samples=1, pool_size=1, progress=quiet)
    sane(result, "replenish")
    assert len(result.data["delays_s"]) == 1 and result.data["delays_s"][0] >= 0


def test_reaper() -> None:
    result = run_part("reaper", sizes=(3, 12), members=2, runs=1, progress=quiet)
    sane(result, "reaper")
    assert result.data["at_large"]["pools_seen"] == 12
    assert result.data["at_small"]["refilled"] == result.data["at_large"]["refilled"] == 0


def test_admission() -> None:
    result = run_part("admission", orgs=4, jobs_per_org=40, runs=2, progress=quiet)
    sane(result, "admission")
    assert result.data["violations"] == 0
    assert result.data["admitted"][0] == result.data["admitted"][1] == result.data["expected"] > 0


def test_cost_and_report(tmp_path: Path) -> None:
    from catacloud.trace import busy_window, generate

    result = run_part(
        "cost",
        jobs=generate(days=1, seed=3),
        sweep=(45, 300),
        replay_jobs=busy_window(minutes=4, seed=3),
        progress=quiet,
    )
    sane(result, "cost")
    policies = {r["policy"]: r for r in result.data["policies"]}
    assert {"ephemeral", "speed", "cost", "pool:2"} <= set(policies)
    assert all(r["cost"] >= result.data["lower_bound"] for r in policies.values())
    # the live replay ran every job and bought nothing a paid machine could have served
    replay = result.data["replay"]
    assert replay["live"]["jobs"] == replay["simulated"]["jobs"] == replay["jobs"] > 0
    assert replay["measured"]["failed"] == 0 and replay["measured"]["needless_purchases"] == 0
    report.save(result, tmp_path)
    path = report.write(report.load_all(tmp_path), tmp_path, report.environment(), {})
    text = path.read_text()
    assert "## Machine" in text and "cost.png" in text and "replay.png" in text
    assert (tmp_path / "docs" / "bench" / "cost.png").exists()


def test_export_job_trace_writes_finished_jobs_relative_to_the_first(tmp_path: Path) -> None:
    from datetime import timedelta

    from django.core.management import call_command
    from django.utils import timezone

    from apps.jobs.models import Job, JobConfiguration
    from benchmarks.harness import tenant
    from catacloud.simulate import load_trace

    t = tenant("export")
    cfg = JobConfiguration.objects.create(org=t.org, name="unit", machine_type=t.machine_type, command="true")
    now = timezone.now()
    for i, (status, run) in enumerate([("succeeded", 300), ("failed", 60), ("queued", None)]):
        job = Job.objects.create(
            org=t.org, config=cfg, machine_type=t.machine_type, command="true", status=status
        )
        queued = now + timedelta(seconds=100 * i)
        started = queued + timedelta(seconds=5) if run else None
        Job.objects.filter(pk=job.pk).update(
            queued_at=queued,
            started_at=started,
            finished_at=started + timedelta(seconds=run) if run else None,
        )
    path = tmp_path / "trace.csv"
    call_command("export_job_trace", "--org", t.org.slug, "--output", str(path))
    jobs = load_trace(path)
    assert [(j.submit, j.duration, j.config) for j in jobs] == [(0.0, 300.0, "unit"), (100.0, 60.0, "unit")]


def test_fleet(tmp_path: Path) -> None:
    result = run_part(
        "fleet",
        sizes=(6,),
        baseline_sizes=(3,),
        window=3.0,
        job_rate=2.0,
        heartbeat=1.0,
        idle_seconds=1.0,
        progress=quiet,
    )
    sane(result, "fleet")
    (row,) = result.data["rows"]
    assert row["agents"] == 6 and row["heartbeats"] > 0 and row["jobs_woken"] > 0
    assert len(result.data["baseline"]) == 1
    # the crash step: one of the two agent-server processes SIGKILLed, the other kept answering
    kill = result.data["kill"]
    assert kill["agents"] == 6 and kill["killed"] > 0 and kill["heartbeats_after_kill"] > 0
    report.save(result, tmp_path)
    assert "fleet.png" in report.plots(report.load_all(tmp_path), tmp_path)


def test_ci(tmp_path: Path) -> None:
    result = run_part("ci", samples=2, burst=4, pool_size=2, progress=quiet)
    sane(result, "ci")
    runs = {data["forge"]: data for data in result.data["forges"]}
    assert set(runs) == {"github", "gitlab"}  # both forges in the same run
    for data in runs.values():
        latency, burst = data["latency"], data["burst"]
        assert len(latency["handoff_s"]) == 2 and burst["jobs"] == 4
        assert all(x > 0 for x in latency["handoff_s"] + latency["online_s"])
        assert latency["calls"] >= 2  # at least a registration per job
        # the hand-off split by stage: every stage of every sample, adding up to the hand-off
        from benchmarks.ci import STAGES

        counts = {kind: len(latency["stages_s"].get(kind, [])) for kind, _ in STAGES}
        assert counts == {kind: 2 for kind, _ in STAGES}
        for i, total in enumerate(latency["handoff_s"]):
            assert abs(sum(latency["stages_s"][k][i] for k, _ in STAGES) - total) < 1e-3
    assert runs["github"]["burst"]["outcomes"] == {"success": 4}
    assert runs["gitlab"]["burst"]["outcomes"] == {"success": 4}
    report.save(result, tmp_path)
    assert "ci.png" in report.plots(report.load_all(tmp_path), tmp_path)


def test_images(tmp_path: Path) -> None:
    result = run_part("images", samples=1, cold_runs=1, jobs=2, progress=quiet)
    sane(result, "images")
    assert result.data["once"]["pulls"] == 1 and result.data["once"]["cached"] == 1
    assert len(result.data["cold"]["ours_s"]) == 1 and len(result.data["image_running_s"]) == 1
    assert {row["case"] for row in result.data["simulator"]} == {
        "no image",
        "images, cold pools",
        "images, image-hot pools",
    }


@pytest.mark.skipif(engine_path() is None, reason="no podman here (apt-get install podman crun)")
def test_containers() -> None:
    result = run_part("containers", samples=1, jobs=1, runs=2, progress=quiet)
    sane(result, "containers")
    starts = result.data["starts"]
    assert all(len(starts[kind]["first"]) == 1 for kind in ("plain", "containers"))
    # each figure a time the job itself took: its first instruction after its submit
    assert 0 < starts["containers"]["running"][0] < starts["containers"]["first"][0]
    assert len(result.data["first_run_s"]) == 1 and len(result.data["cached_run_s"]) == 2
    # a pull of each way, timed inside its job (the seeded one on the machine holding the image)
    assert {way: len(s) for way, s in result.data["pull_s"].items()} == {
        "direct": 1,
        "mirror": 1,
        "seeded": 1,
    }
    assert all(s[0] > 0 for s in result.data["pull_s"].values())


def test_tail_report_keeps_percentiles_and_counts_every_slow_job(tmp_path: Path) -> None:
    """The tail part's saved results are curves and counts (not its thousand jobs), and the
    report plots them: tail.png, and every job above 250 ms to its first instruction counted by
    its slowest stage."""
    import json

    from benchmarks.tail import _result

    def rec(i: int, phase: str, adm: float, place: float, agent: float, launch: float = 0.01) -> dict:
        stages = {
            "admission": adm,
            "placement": place,
            "delivery": 0.005,
            "agent start": agent,
            "launch": launch,
        }
        running = adm + place + 0.005 + agent
        return {
            "id": f"job-{i}",
            "phase": phase,
            "start_s": running,
            "first_s": running + launch,
            "stages": stages,
        }

    records = [rec(i, "trickle", 0.002, 0.01, 0.02) for i in range(90)]
    records += [rec(100 + i, "burst", 0.01, 0.3, 0.05) for i in range(3)]  # placement-bound
    records += [rec(200 + i, "burst", 0.01, 0.02, 0.6 + i / 100) for i in range(6)]  # agent-bound
    records += [rec(300, "burst", 0.01, 0.02, 0.05, launch=0.4)]  # running in 85 ms, its launch slow
    result = _result(PartResult(part="tail", title="tail"), records, machines=6, slow=0.25)
    assert result.figure("jobs above 250 ms").value == 10
    assert result.figure("warm: submit -> first instruction max").value == 695.0  # 10+20+5+650+10 ms
    assert result.figure("jobs without a first instruction").met
    assert result.data["slow_by_stage"]["agent start"] == {"burst": 6, "trickle": 0}
    assert result.data["slow_by_stage"]["placement"] == {"burst": 3, "trickle": 0}
    assert result.data["slow_by_stage"]["launch"] == {"burst": 1, "trickle": 0}
    assert "agent start: 6 (6 burst, 0 trickle)" in result.notes[0]
    report.save(result, tmp_path)
    saved = json.loads((tmp_path / "docs" / "bench" / "tail.json").read_text())
    assert "job-0" not in json.dumps(saved["data"])  # no per-job rows kept
    assert len(saved["data"]["first_ms"]["all"]) == len(saved["data"]["quantiles"])
    text = report.write(report.load_all(tmp_path), tmp_path, report.environment(), {}).read_text()
    assert "tail.png" in text and (tmp_path / "docs" / "bench" / "tail.png").exists()


def test_tail_counts_the_control_planes_cpu_apart_from_the_machines() -> None:
    """What a burst would share with its machines elsewhere: the control plane's programs only,
    never the machines (local agents, sandboxes, pastas: "machines and the rest") or the bench."""
    import os

    from benchmarks.tail import _control_plane_figure

    cpu = {"all": 130.0, "PostgreSQL": 15.0, "Redis": 1.0, "agent server": 22.0, "API (gunicorn)": 15.0}
    cpu |= {"Celery beat": 0.5, "Celery worker": 10.0, "bench": 4.0, "machines and the rest": 62.5}
    figure = _control_plane_figure(cpu, machines=6)
    assert figure.value == 63.5
    assert (
        figure.baseline
        == f"a burst of 6: {63.5 * 6 / (os.cpu_count() or 1):.0f} ms on {os.cpu_count()} cores"
    )
    assert "the rest here (the machines, this bench): 66 ms" in figure.note


def test_hosts(tmp_path: Path) -> None:
    result = run_part("hosts", samples=1, pool_size=1, hosts=5, window=4.0, rate=4.0, progress=quiet)
    sane(result, "hosts")
    first = result.data["first"]
    assert 0 < first["enrolled"] <= first["slot_ready"] <= first["running"]
    sim = result.data["simulated"]
    assert sim["requested"] and sim["ordered"] == sim["requested"] and sim["errors"] == 0
    assert sim["most_on_a_host"] <= 4  # a host of 4 cpus, slots of 1
    report.save(result, tmp_path)
    assert "hosts.png" in report.plots(report.load_all(tmp_path), tmp_path)


def test_selection() -> None:
    result = run_part("selection", samples=2, days=1, progress=quiet)
    sane(result, "selection")
    assert len(result.data["delays_s"]) == 2 and all(d > 0 for d in result.data["delays_s"])
    week = result.data["week"]
    assert week["spot"]["cost"] < week["on_demand"]["cost"]
    assert week["spot"]["spot_machines"] > 0
