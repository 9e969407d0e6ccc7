"""A simulated fleet for the `fleet` benchmark part: N agents in one asyncio process speaking the
real Agent API over HTTP (aiohttp), as the real agent does: enroll with the machine's bootstrap
token (once), then heartbeat every H seconds and long-poll ``GET work`` back to back; a job that
arrives is reported ``started`` and ``finished`` at once.

    python -m benchmarks.fleet_agents --url URL --agents FILE --out FILE --heartbeat 10 --window 20

``--agents`` is a JSON list of ``{"instance": id, "bootstrap": token}`` or ``{"instance": id,
"token": agent_token}``. The process prints ``ENROLLED n`` once every agent has its token,
``HANDSHAKEN n`` once every agent's first heartbeat (the handshake that makes its machine ready;
first heartbeats are spread over one interval, as machines' start times are) was answered, and
``READY`` one quiet heartbeat interval later. Heartbeats then follow the real agent's schedule
(``catacloud.agent.backoff.heartbeat_delay``). For ``--window`` seconds it records every
heartbeat sent in the window and every job's arrival (wall clock, to compare with the
assignment's), then writes ``--out`` (with the agent tokens, for the next, larger run) and
exits. No Django here.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from typing import Any

import aiohttp

from catacloud.agent.backoff import heartbeat_delay  # the real agent's schedule

API = "/api/agent/v1/"
# A pause of the simulator's own loop this long is reported (it reads as server latency).
STALL = 0.05


class Fleet:
    def __init__(self, url: str, agents: list[dict[str, Any]], heartbeat: float, poll: float) -> None:
        self.url = url.rstrip("/") + API
        self.agents = agents
        self.heartbeat = heartbeat
        self.poll = poll
        self.measuring = False
        self.stop = asyncio.Event()
        self.heartbeats: list[float] = []
        self.heartbeat_at: list[float] = []  # when each of them was sent (wall clock)
        self.window_started = 0.0
        self.heartbeat_errors = 0
        self.heartbeat_gaps: list[float] = []  # per agent: the longest time without a good beat
        self.first_beats = 0  # agents whose first heartbeat (the handshake) was answered
        self.poll_errors = 0
        self.polls = 0
        self.jobs: dict[str, float] = {}
        self.job_errors = 0
        self.stalls: list[float] = []  # this process's own loop pauses over STALL in the window

    async def watch_loop(self) -> None:
        """The instrument's own pauses: a late wake-up of this loop is latency no server caused."""
        while not self.stop.is_set():
            asked = time.monotonic()
            await asyncio.sleep(0.01)
            late = time.monotonic() - asked - 0.01
            if self.measuring and late > STALL:
                self.stalls.append(late)

    async def enroll(self, session: aiohttp.ClientSession, agent: dict[str, Any]) -> None:
        for attempt in range(5):
            try:
                async with session.post(
                    self.url + "enroll", json={"bootstrap_token": agent["bootstrap"], "hostname": "sim"}
                ) as r:
                    body = await r.json()
                    if r.status == 200:
                        agent["token"] = body["agent_token"]
                        return
                    raise RuntimeError(f"enroll answered {r.status}: {body}")
            except (aiohttp.ClientError, TimeoutError):
                await asyncio.sleep(0.5 * (attempt + 1))
        raise RuntimeError("enroll failed five times")

    async def beat_loop(self, session: aiohttp.ClientSession, agent: dict[str, Any]) -> None:
        headers = {"Authorization": f"Agent {agent['token']}"}
        await asyncio.sleep(random.uniform(0, self.heartbeat))
        last_ok: float | None = None
        gap = 0.0
        while not self.stop.is_set():
            started = time.monotonic()
            sent_at = time.time()
            ok = False
            for _ in range(
                2
            ):  # like the agent's client: a kept-alive connection the server closed is retried
                try:
                    async with session.post(
                        self.url + "heartbeat",
                        json={"running_job": None},
                        headers=headers,
                        timeout=aiohttp.ClientTimeout(total=30),
                    ) as r:
                        await r.read()
                        ok = r.status == 200
                        break
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                    continue
                except (aiohttp.ClientError, TimeoutError):
                    break
            took = time.monotonic() - started
            if ok and last_ok is None:
                self.first_beats += 1
            # A heartbeat counts when it was sent inside the window (not one queued before it).
            if self.measuring and started >= self.window_started:
                if ok:
                    self.heartbeats.append(took)
                    self.heartbeat_at.append(sent_at)
                else:
                    self.heartbeat_errors += 1
            if ok:
                if self.measuring and last_ok is not None:
                    gap = max(gap, time.monotonic() - last_ok)
                last_ok = time.monotonic()
            with _suppress_timeout():
                await asyncio.wait_for(self.stop.wait(), max(0.0, heartbeat_delay(self.heartbeat) - took))
        self.heartbeat_gaps.append(gap if last_ok is None else max(gap, time.monotonic() - last_ok))

    async def poll_loop(self, session: aiohttp.ClientSession, agent: dict[str, Any]) -> None:
        headers = {"Authorization": f"Agent {agent['token']}"}
        await asyncio.sleep(random.uniform(0, 1.0))
        while not self.stop.is_set():
            try:
                async with session.get(
                    self.url + f"work?wait={self.poll:g}",
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=self.poll + 30),
                ) as r:
                    body = await r.json() if r.status == 200 else None
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, TimeoutError):
                if self.measuring:
                    self.poll_errors += 1
                await asyncio.sleep(1.0)
                continue
            self.polls += 1
            if status == 200 and body and body.get("job"):
                job_id = body["job"]["id"]
                self.jobs[job_id] = time.time()
                await self.report(session, headers, job_id)
            elif status != 204:
                if self.measuring:
                    self.poll_errors += 1
                await asyncio.sleep(1.0)

    async def report(self, session: aiohttp.ClientSession, headers: dict[str, str], job_id: str) -> None:
        try:
            async with session.post(self.url + f"jobs/{job_id}/started", headers=headers) as r:
                await r.read()
                ok = r.status == 200
            async with session.post(
                self.url + f"jobs/{job_id}/finished",
                json={"outcome": "succeeded", "exit_code": 0},
                headers=headers,
            ) as r:
                await r.read()
                ok = ok and r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if not ok:
            self.job_errors += 1


class _suppress_timeout:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, *_: Any) -> bool:
        return kind is TimeoutError


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with open(args.agents) as fh:
        agents = json.load(fh)
    fleet = Fleet(args.url, agents, args.heartbeat, args.poll)
    connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector) as session:
        todo = [a for a in agents if not a.get("token")]
        enrolling = asyncio.Semaphore(32)

        async def enroll(agent: dict[str, Any]) -> None:
            async with enrolling:
                await fleet.enroll(session, agent)

        t0 = time.monotonic()
        await asyncio.gather(*(enroll(a) for a in todo))
        print(f"ENROLLED {len(todo)} in {time.monotonic() - t0:.1f}s", flush=True)
        # The measuring client's own pauses count as the server's latency: keep the collector's
        # full passes off the long-lived state (agents, session, connections).
        gc.collect()
        gc.freeze()
        tasks = [asyncio.create_task(fleet.beat_loop(session, a)) for a in agents]
        tasks += [asyncio.create_task(fleet.poll_loop(session, a)) for a in agents]
        # Every agent's first heartbeat is its handshake (warming -> ready); the window opens
        # once all of them were answered and one more quiet interval has passed.
        while fleet.first_beats < len(agents) and time.monotonic() - t0 < 300:
            await asyncio.sleep(0.2)
        print(f"HANDSHAKEN {fleet.first_beats} in {time.monotonic() - t0:.1f}s", flush=True)
        await asyncio.sleep(args.heartbeat + 1.0)
        # Every agent's tasks and connection exist now: freeze them too, and keep the collector
        # off for the window (a full pass over 10,000 tasks pauses this loop for up to a second,
        # which every answer in flight would carry as the server's latency).
        gc.collect()
        gc.freeze()
        gc.disable()
        tasks.append(asyncio.create_task(fleet.watch_loop()))
        fleet.window_started = time.monotonic()
        fleet.measuring = True
        print("READY", flush=True)
        await asyncio.sleep(args.window)
        fleet.measuring = False
        gc.enable()
        fleet.stop.set()
        await asyncio.wait(tasks, timeout=5)
        for task in tasks:
            task.cancel()
    return {
        "agents": [{"instance": a["instance"], "token": a["token"]} for a in agents],
        "heartbeats": fleet.heartbeats,
        "heartbeat_at": fleet.heartbeat_at,
        "heartbeat_errors": fleet.heartbeat_errors,
        "max_heartbeat_gap": max(fleet.heartbeat_gaps, default=0.0),
        "poll_errors": fleet.poll_errors,
        "polls": fleet.polls,
        "jobs": fleet.jobs,
        "job_errors": fleet.job_errors,
        "stalls": fleet.stalls,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet_agents")
    parser.add_argument("--url", required=True)
    parser.add_argument("--agents", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--heartbeat", type=float, default=10.0)
    parser.add_argument("--poll", type=float, default=20.0)
    parser.add_argument("--window", type=float, default=20.0)
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(main_async(args))
    else:
        result = uvloop.run(main_async(args))
    with open(args.out, "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
