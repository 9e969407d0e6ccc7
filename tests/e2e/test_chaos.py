"""The short chaos soak (issue 13): real web, two workers, beat, agents and Redis; jobs and pool
claims through the API while workers, agents and Redis are killed and queued messages dropped.
The system must keep its invariants and converge. `make chaos` is the long version."""

from __future__ import annotations

import pytest

from benchmarks import chaos

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_the_system_converges_under_faults_and_keeps_its_invariants() -> None:
    result = chaos.run(
        jobs=50,
        faults=16,
        seed=13,
        fault_interval=2,
        workload_timeout=240,
        settle_timeout=60,
        beat_stopped=15,
        redis_gone=15,
    )
    data = result.data
    kinds = {f["kind"] for f in data["faults"]}
    assert kinds == set(chaos.FAULT_KINDS), data["faults"]
    assert len(data["faults"]) == 16
    broken = {i: data["examples"].get(i, []) for i, n in data["violations"].items() if n}
    assert not broken, "invariants violated:\n" + "\n".join(
        f"{i} ({data['violations'][i]}):\n  " + "\n  ".join(examples) for i, examples in broken.items()
    )
    assert data["final"]["converged_at"] is not None, "the system did not converge after the workload"
    assert not data["final"]["never_converged"], data["final"]["never_converged"]
    assert sum(data["outcomes"].values()) >= 50
    # One job across each kind of fault, traced from its submit (jobs run through the whole soak,
    # so most kinds have one; a kind with none would mean the trace misses jobs).
    traces = data["fault_traces"]
    assert len(traces) >= len(chaos.FAULT_KINDS) // 2, traces
    assert all("): queued " in line for line in traces.values()), traces
