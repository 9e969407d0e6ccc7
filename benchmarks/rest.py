"""Part 2: REST acquire (POST /api/v1/pools/{id}/acquire/) under gunicorn, 8 HTTP clients.

gunicorn runs as `make dev` runs it (2 workers x 4 threads, gthread) against the bench
database; 8 client threads, each with one keep-alive connection, acquire from a pool
holding enough ready members. The per-user API throttle is raised for the run (it is
fairness, not a quota) so it does not answer 429 to a benchmark.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from benchmarks.harness import (
    Figure,
    PartResult,
    Progress,
    analyze,
    median,
    percentile,
    say,
    temp_dir,
    tenant,
)
from testkit.builders import ready_members
from testkit.processes import BENCH, ROOT


def _client(url: str, path: str, token: str, n: int, out: list[Any], start: threading.Barrier) -> None:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    body = json.dumps({"acquired_by": "bench", "acquired_for": "rest"})
    lat, ids, bad = [], [], 0
    start.wait()
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        lat.append(time.perf_counter() - t0)
        if response.status == 201:
            ids.append(json.loads(data)["instance"]["id"])
        else:
            bad += 1
    conn.close()
    out.append((lat, ids, bad))


# Requests/s with 8 clients measured before the lean acquire (issue 19), for the ratio.
BEFORE_RPS = 99.0


def _round(url: str, token: str, t: Any, tag: str, clients: int, n: int) -> tuple[list, list, int, float]:
    """One round of ``n`` acquires by ``clients`` keep-alive clients on a fresh pool."""
    from apps.pools.services import pool_create

    pool = pool_create(org=t.org, name=tag, machine_type=t.machine_type, target_size=0, max_size=n)
    ready_members(pool, n, provider_ids="bench-", batch_size=2000)
    analyze("machines_machineinstance")
    out: list[Any] = []
    barrier = threading.Barrier(clients + 1)
    threads = [
        threading.Thread(
            target=_client, args=(url, f"/api/v1/pools/{pool.pk}/acquire/", token, n // clients, out, barrier)
        )
        for _ in range(clients)
    ]
    for th in threads:
        th.start()
    barrier.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    lat = [x for o in out for x in o[0]]
    ids = [x for o in out for x in o[1]]
    return lat, ids, sum(o[2] for o in out), elapsed


FLAME = "acquire-flame.svg"


def _flame_graph(url: str, token: str, t: Any, pid: int, progress: Progress, n: int = 600) -> str:
    """Where one acquire's time goes: py-spy samples the gunicorn workers (``--subprocesses``)
    while one client acquires ``n`` times; the flame graph goes to docs/bench. Returns its file
    name, or why there is none (py-spy missing, or not allowed to attach)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return "none: py-spy is not installed (pip install py-spy)"
    out = ROOT / "docs" / "bench" / FLAME
    progress(f"rest: flame graph of 1 client ({n} acquires, py-spy)")
    args = [spy, "record", "--pid", str(pid), "--subprocesses", "--rate", "500", "--format", "flamegraph"]
    args += ["--output", str(out), "--nonblocking"]
    spy_proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)  # attached
    if spy_proc.poll() is not None:
        return f"none: py-spy could not attach ({(spy_proc.stdout.read() if spy_proc.stdout else '')[-200:]})"
    _round(url, token, t, "rest-flame", 1, n)
    spy_proc.send_signal(signal.SIGINT)  # py-spy writes the graph when interrupted
    spy_proc.wait(60)
    return FLAME if out.exists() else "none: py-spy wrote nothing"


def run(
    *,
    clients: int = 8,
    requests: int = 480,
    runs: int = 3,
    single: int = 200,
    flame: bool = False,
    progress: Progress = say,
) -> PartResult:
    from apps.orgs.services import api_token_create

    result = PartResult(part="rest", title="REST acquire under gunicorn")
    t = tenant("rest")
    token = api_token_create(org=t.org, user=t.user)[1]
    per_run = []
    with (
        temp_dir("rest") as tmp,
        BENCH.gunicorn(tmp, workers=2, threads=4, CATACLOUD_API_RATE="10000000/min") as (url, gunicorn),
    ):
        for r in range(runs + 1):
            warmup = r == 0
            n = clients * 5 if warmup else requests
            progress(f"rest: {clients} clients, {'warm-up' if warmup else f'run {r}/{runs}'} ({n} acquires)")
            lat, ids, errors, elapsed = _round(url, token, t, f"rest-{r}", clients, n)
            if warmup:
                continue
            per_run.append(
                {
                    "p50_ms": percentile(lat, 50) * 1000,
                    "p99_ms": percentile(lat, 99) * 1000,
                    "rps": len(lat) / elapsed,
                    "ok": len(ids),
                    "errors": errors,
                    "twice": len(ids) - len(set(ids)),
                    "latencies_ms": [x * 1000 for x in lat],
                }
            )
        progress(f"rest: 1 client ({single} acquires)")
        lat1, ids1, errors1, _ = _round(url, token, t, "rest-single", 1, single)
        single_p50 = percentile(lat1, 50) * 1000
        graph = _flame_graph(url, token, t, gunicorn.popen.pid, progress) if flame else "none: not asked"
    p50 = median([x["p50_ms"] for x in per_run])
    p99 = median([x["p99_ms"] for x in per_run])
    rps = median([x["rps"] for x in per_run])
    errors = sum(x["errors"] for x in per_run) + errors1
    twice = sum(x["twice"] for x in per_run) + len(ids1) - len(set(ids1))
    result.data = {
        "clients": clients,
        "runs": per_run and [{k: v for k, v in x.items() if k != "latencies_ms"} for x in per_run],
        "samples_ms": per_run[-1]["latencies_ms"] if per_run else [],
        "ok": sum(x["ok"] for x in per_run),
        "errors": errors,
        "double_claims": twice,
        "flame_graph": graph,
    }
    result.figures += [
        Figure(f"p50 acquire latency, {clients} clients", round(p50, 2), "ms", "<= 15 ms", met=p50 <= 15),
        Figure(f"p99 acquire latency, {clients} clients", round(p99, 2), "ms", "<= 50 ms", met=p99 <= 50),
        Figure(
            f"acquires per second, {clients} clients",
            round(rps),
            "req/s",
            ">= 3x 99 req/s",
            "99 req/s (issue 19, before the lean acquire)",
            round(rps / BEFORE_RPS, 2),
            rps >= 3 * BEFORE_RPS,
            note="gunicorn 2 workers x 4 threads; clients on the same 2 cores",
        ),
        Figure("p50 acquire latency, 1 client", round(single_p50, 2), "ms", "<= 5 ms", met=single_p50 <= 5),
        Figure(
            "non-201 answers / instances acquired twice", errors + twice, "", "0", met=errors + twice == 0
        ),
    ]
    return result
