"""Simulated enrolled hosts for the `hosts` benchmark part: N hosts in one asyncio process speaking
the real host Agent API over HTTP (aiohttp), as ``catacloud host`` does: enroll with one
enrolment token (of N uses), then exchange back to back (a long poll while there is nothing to
do); a slot it is told to start is reported running at once (no sandbox is made: what is
measured is the control plane's side, request to order).

    python -m benchmarks.host_fleet --url URL --token TOKEN --hosts N --cpus C --window S --out FILE

Prints ``READY`` once every host has enrolled and made its first exchange, then for ``--window``
seconds records each start order's arrival (wall clock) and every exchange's errors, writes
``--out`` and exits. No Django here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import aiohttp

API = "/api/agent/v1/"


class Hosts:
    def __init__(self, url: str, token: str, n: int, cpus: int, wait: float) -> None:
        self.url = url.rstrip("/") + API
        self.token, self.n, self.cpus, self.wait = token, n, cpus, wait
        self.orders: dict[str, tuple[float, int]] = {}  # slot -> (arrived, host index)
        self.errors = 0
        self.exchanges = 0
        self.ready = 0
        self.stop = asyncio.Event()

    def capacity(self) -> dict[str, Any]:
        return {"cpus": self.cpus, "memory_mb": 65536, "disk_gb": 1000, "arch": "x86_64"}

    async def enroll(self, session: aiohttp.ClientSession, i: int) -> str:
        body = {"enrolment_token": self.token, "hostname": f"sim-{i}", "capacity": self.capacity()}
        async with session.post(self.url + "hosts/enroll", json=body) as response:
            response.raise_for_status()
            return str((await response.json())["host_token"])

    async def host(self, session: aiohttp.ClientSession, i: int) -> None:
        token = await self.enroll(session, i)
        headers = {"Authorization": f"Agent {token}"}
        running: list[str] = []
        first = True
        while not self.stop.is_set():
            body = {"running": running, "capacity": self.capacity()}
            try:
                async with session.post(
                    self.url + "hosts/exchange",
                    params={"wait": "0" if first else f"{self.wait:g}"},
                    json=body,
                    headers=headers,
                ) as response:
                    answer = await response.json()
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}")
            except Exception:
                self.errors += 1
                await asyncio.sleep(0.5)
                continue
            self.exchanges += 1
            if first:
                first = False
                self.ready += 1
            now = time.time()
            for start in answer.get("start", []):
                self.orders.setdefault(start["instance_id"], (now, i))
                running.append(start["instance_id"])
            stopped = set(answer.get("stop", []))
            running = [slot for slot in running if slot not in stopped]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    hosts = Hosts(args.url, args.token, args.hosts, args.cpus, args.wait)
    timeout = aiohttp.ClientTimeout(total=args.wait + 30)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks = [asyncio.create_task(hosts.host(session, i)) for i in range(args.hosts)]
        while hosts.ready < args.hosts:
            await asyncio.sleep(0.05)
        print("READY", flush=True)
        began = time.time()
        await asyncio.sleep(args.window)
        hosts.stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"began": began, "orders": hosts.orders, "errors": hosts.errors, "exchanges": hosts.exchanges}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_fleet")
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--hosts", type=int, default=100)
    parser.add_argument("--cpus", type=int, default=4)
    parser.add_argument("--wait", type=float, default=10.0)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = asyncio.run(main_async(args))
    with open(args.out, "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
