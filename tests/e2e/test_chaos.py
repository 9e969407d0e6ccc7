"""The short chaos soak (issue 13): real web, two workers, beat, agents and Redis; jobs and pool
claims through the API while workers, agents, Redis and PostgreSQL are killed or restarted and
queued messages dropped. The system must keep its invariants and converge. `make chaos` is the
long version.

It runs as `make chaos` does (``python -m benchmarks.chaos`` under ``catacloud services run``),
on embedded services of its own: its PostgreSQL restart must not cut the database of the tests
that run meanwhile on the run's other pytest processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import chaos
from testkit.processes import ROOT

pytestmark = [pytest.mark.e2e]

SOAK = {
    "--jobs": 50,
    "--faults": 16,
    "--seed": 13,
    "--fault-interval": 2,
    "--workload-timeout": 240,
    "--settle-timeout": 60,
    "--beat-stopped": 15,
    "--redis-gone": 15,
}


def test_the_system_converges_under_faults_and_keeps_its_invariants(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # Its own services: none of the run's (the variables pointing at them left out).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYTEST_") and k not in ("DATABASE_URL", "REDIS_URL", "CATACLOUD_EMBEDDED")
    }
    env["CATACLOUD_HOME"] = str(tmp_path / "home")
    args = [str(a) for pair in SOAK.items() for a in pair]
    soak = subprocess.run(
        [sys.executable, "-m", "catacloud.cli", "services", "run", "--"]
        + [sys.executable, "-m", "benchmarks.chaos", *args, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    saved = out / "docs" / "bench" / "chaos.json"
    assert saved.exists(), (
        f"the soak saved no result (exit {soak.returncode}):\n{soak.stdout[-4000:]}\n{soak.stderr[-4000:]}"
    )
    data = json.loads(saved.read_text())["data"]
    kinds = {f["kind"] for f in data["faults"]}
    assert kinds == set(chaos.FAULT_KINDS), data["faults"]  # restart_postgres among them: its server
    assert len(data["faults"]) == 16
    broken = {i: data["examples"].get(i, []) for i, n in data["violations"].items() if n}
    assert not broken, "invariants violated:\n" + "\n".join(
        f"{i} ({data['violations'][i]}):\n  " + "\n  ".join(examples) for i, examples in broken.items()
    )
    assert soak.returncode == 0, soak.stderr[-4000:]
    assert data["final"]["converged_at"] is not None, "the system did not converge after the workload"
    assert not data["final"]["never_converged"], data["final"]["never_converged"]
    assert sum(data["outcomes"].values()) >= 50
    # One job across each kind of fault, traced from its submit (jobs run through the whole soak,
    # so most kinds have one; a kind with none would mean the trace misses jobs).
    traces = data["fault_traces"]
    assert len(traces) >= len(chaos.FAULT_KINDS) // 2, traces
    assert all("): queued " in line for line in traces.values()), traces
