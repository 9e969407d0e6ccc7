"""``catacloud jobs|pools|artifacts …``: the client commands on the REST API.

Every command takes ``--url``, ``--profile`` and ``--json`` (see :mod:`catacloud.client.config`
for where the URL and token come from). Tables and progress are for people; ``--json`` prints
the API's answer for scripts. Exit status: 0 done, 1 the API refused or could not be reached
(the ``{code, detail}`` is shown on stderr), 2 bad usage; ``--wait`` / ``--follow`` end with
the job's own: 0 succeeded, its exit code when it failed with one, else 1.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from catacloud.client.api import Api, ApiError
from catacloud.client.config import ConfigError, print_warnings, resolve
from catacloud.client.output import age, between, duration, print_json, size, table

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "timed_out"})
POLL_SECONDS = 1.0
RETRIES_WHILE_WAITING = 10  # consecutive transient errors tolerated by --wait / -f


class UsageError(Exception):
    pass


# ---- registration -------------------------------------------------------------------------------


def add_client_commands(subparsers: Any) -> None:
    """Register ``jobs``, ``pools`` and ``artifacts`` on an ``add_subparsers()`` object."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="API base URL (default: CATACLOUD_URL, else the profile's)")
    common.add_argument("--profile", help="profile of the config file (default: CATACLOUD_PROFILE)")
    common.add_argument("--json", action="store_true", help="print the API's JSON (for scripts)")

    def group(name: str, help: str) -> Any:
        parser = subparsers.add_parser(name, help=help, description=help)
        return parser.add_subparsers(dest=f"{name}_cmd", required=True, metavar="COMMAND")

    def command(sub: Any, name: str, func: Callable, help: str, **kw: Any) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, parents=[common], help=help, description=help, **kw)
        parser.set_defaults(func=lambda args: run(func, args))
        return parser

    jobs = group("jobs", "submit, follow, list and cancel jobs (client of the REST API)")
    p = command(jobs, "submit", cmd_jobs_submit, "submit a job of a configuration (by name or id)")
    p.add_argument("--config", required=True, metavar="NAME", help="job configuration name or id")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="env for this run (repeatable)")
    p.add_argument("--wait", action="store_true", help="wait for the job to end, showing its progress")
    p.add_argument("--follow", "-f", action="store_true", help="like --wait, printing its output as it comes")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="stop waiting after this (exit 1)")

    p = command(jobs, "logs", cmd_jobs_logs, "print a job's output (-f: follow it until the job ends)")
    p.add_argument("job", metavar="JOB", help="job id")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new output until the job ends")
    p.add_argument("--attempt", type=int, help="which attempt (default: the current one)")

    p = command(jobs, "cancel", cmd_jobs_cancel, "cancel a job (in any live state)")
    p.add_argument("job", metavar="JOB", help="job id")

    p = command(jobs, "ls", cmd_jobs_ls, "list jobs, newest first")
    p.add_argument("--status", action="append", default=[], help="only these statuses (repeatable)")
    p.add_argument("--config", metavar="NAME", help="only jobs of this configuration")
    p.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")

    p = command(jobs, "show", cmd_jobs_show, "one job: status, attempts, timings, cost")
    p.add_argument("job", metavar="JOB", help="job id")

    pools = group("pools", "list warm pools, acquire and release their machines")
    command(pools, "ls", cmd_pools_ls, "list pools with their members by state")
    p = command(pools, "acquire", cmd_pools_acquire, "take a ready machine from a pool (never waits)")
    p.add_argument("pool", metavar="POOL", help="pool name or id")
    p.add_argument("--by", default="", help="who holds it (acquired_by), e.g. runner-7")
    p.add_argument("--for", dest="purpose", default="", help="what for (acquired_for), e.g. 'build 1234'")
    p.add_argument("--lease", type=int, metavar="SECONDS", help="the claim ends by itself after this")
    p = command(pools, "release", cmd_pools_release, "hand back an acquired machine (it is terminated)")
    p.add_argument("instance", metavar="INSTANCE", help="instance id")
    p.add_argument("--claim", metavar="CLAIM_ID", help="release only if this claim still holds it")

    artifacts = group("artifacts", "list and download the files a job kept")
    p = command(artifacts, "ls", cmd_artifacts_ls, "list a job's artifacts")
    p.add_argument("job", metavar="JOB", help="job id")
    p = command(artifacts, "get", cmd_artifacts_get, "download one artifact (its sha256 is checked)")
    p.add_argument("job", metavar="JOB", help="job id")
    p.add_argument("name", metavar="NAME", help="artifact name, e.g. reports/junit.xml")
    p.add_argument(
        "--output", "-o", metavar="PATH", help="file or directory (- for stdout; default ./BASENAME)"
    )


def run(func: Callable[[Api, argparse.Namespace], int], args: argparse.Namespace) -> int:
    warnings: list[str] = []
    try:
        config = resolve(url=args.url, profile=args.profile, warn=warnings)
    except ConfigError as exc:
        print_warnings(warnings)
        print(f"catacloud: {exc}", file=sys.stderr)
        return 2
    print_warnings(warnings)
    try:
        return func(Api(config), args)
    except UsageError as exc:
        print(f"catacloud: {exc}", file=sys.stderr)
        return 2
    except ApiError as exc:
        show_error(exc, args)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `catacloud jobs ls | head -3`: the reader has gone, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def show_error(exc: ApiError, args: argparse.Namespace) -> None:
    if args.json:
        print_json(exc.as_dict(), out=sys.stderr)
        return
    where = f"HTTP {exc.status}" if exc.status else "no answer"
    print(f"error: {exc.detail} ({exc.code}, {where})", file=sys.stderr)
    for name, messages in sorted(exc.fields.items()):
        text = "; ".join(messages) if isinstance(messages, list) else str(messages)
        print(f"  {name}: {text}", file=sys.stderr)
    if exc.status == 401:
        print("  (check CATACLOUD_TOKEN or the profile's token)", file=sys.stderr)


def _uuid(value: str, what: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise UsageError(f"{what} must be an id (a UUID), got {value!r}") from None


# ---- jobs ---------------------------------------------------------------------------------------


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise UsageError(f"--env takes NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def cmd_jobs_submit(api: Api, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"config": args.config}
    env = _parse_env(args.env)
    if env:
        body["env"] = env
    job = api.post("jobs/", body)
    if not (args.wait or args.follow):
        if args.json:
            print_json(job)
        else:
            print(f"job {job['id']} {job['status']} (config {job['config_name']})")
        return 0
    print(f"job {job['id']} submitted (config {job['config_name']})", file=sys.stderr)
    return wait_for_job(api, job["id"], args, follow=args.follow, timeout=args.timeout)


def wait_for_job(
    api: Api, job_id: str, args: argparse.Namespace, *, follow: bool, timeout: float | None = None
) -> int:
    """Poll the job until it ends, showing its progress on stderr (and with ``follow`` its
    output on stdout; on stderr under --json, whose stdout is the final job)."""
    progress = Progress()
    logs = LogFollower(api, job_id, out=sys.stderr if args.json else sys.stdout) if follow else None
    deadline = time.monotonic() + timeout if timeout else None
    job = _retrying(lambda: api.get(f"jobs/{job_id}/"))
    while True:
        if logs:
            progress.clear()
            logs.poll(job)
        progress.show(job)
        if job["status"] in TERMINAL:
            break
        if deadline and time.monotonic() > deadline:
            progress.done()
            print(f"catacloud: still {job['status']} after {timeout:g}s; stopped waiting", file=sys.stderr)
            return 1
        time.sleep(POLL_SECONDS)
        job = _retrying(lambda: api.get(f"jobs/{job_id}/"))
    if logs:
        progress.clear()
        logs.poll(job, final=True)
    progress.done()
    if args.json:
        print_json(job)
    else:
        print_job_summary(job, out=sys.stderr if follow else sys.stdout)
    return job_exit_status(job)


def job_exit_status(job: dict) -> int:
    if job["status"] == "succeeded":
        return 0
    code = job.get("exit_code")
    if isinstance(code, int) and 0 < code < 256:
        return code
    return 1


def _retrying(call: Callable[[], Any]) -> Any:
    """While waiting, ride out a restarting server or a dropped connection."""
    for attempt in range(RETRIES_WHILE_WAITING):
        try:
            return call()
        except ApiError as exc:
            if not exc.transient or attempt == RETRIES_WHILE_WAITING - 1:
                raise
            time.sleep(min(10.0, 0.5 * 2**attempt))
    raise AssertionError("unreachable")


class Progress:
    """One status line on stderr: rewritten in place on a terminal, a new line at each change
    otherwise (logs, CI)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()
        self.last = ""
        self.drawn = False

    def line(self, job: dict) -> str:
        parts = [job["status"]]
        if job.get("pending_reason") and job["status"] not in TERMINAL:
            parts.append(f"({job['pending_reason']})")
        if job.get("attempt", 1) > 1:
            parts.append(f"attempt {job['attempt']}/{job.get('max_attempts', '?')}")
        if job.get("requeue_reason") and job["status"] not in TERMINAL:
            parts.append(f"requeued: {job['requeue_reason']}")
        return " ".join(parts)

    def show(self, job: dict) -> None:
        text = self.line(job)
        if self.tty:
            waited = duration(time.monotonic() - self.started)
            sys.stderr.write(f"\r\033[K… {text} · {waited}")
            sys.stderr.flush()
            self.drawn = True
        elif text != self.last:
            print(f"… {text}", file=sys.stderr, flush=True)
        self.last = text

    def clear(self) -> None:
        if self.tty and self.drawn:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.drawn = False

    def done(self) -> None:
        if self.tty and self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.drawn = False


class LogFollower:
    """Prints a job's output once, in order, across attempts (a requeued job starts a new
    attempt whose output is numbered from the start again)."""

    def __init__(self, api: Api, job_id: str, out: Any, attempt: int | None = None) -> None:
        self.api, self.job_id, self.out = api, job_id, out
        self.attempt = attempt
        self.after = -1
        self.pinned = attempt is not None

    def _fetch(self) -> bool:
        page = _retrying(
            lambda: self.api.get(f"jobs/{self.job_id}/logs/", after=self.after, attempt=self.attempt)
        )
        if page["text"]:
            self.out.write(page["text"])
            self.out.flush()
        self.after = page["next_after"]
        return bool(page["chunks"])

    def poll(self, job: dict, final: bool = False) -> None:
        if self.attempt is None:
            self.attempt = job["attempt"]
        while self._fetch():  # a page holds at most 5,000 chunks: read on while there are more
            pass
        while not self.pinned and job["attempt"] > self.attempt:
            self.attempt, self.after = self.attempt + 1, -1
            print(f"--- attempt {self.attempt} ---", file=sys.stderr, flush=True)
            while self._fetch():
                pass
        if final:
            while self._fetch():
                pass


def cmd_jobs_logs(api: Api, args: argparse.Namespace) -> int:
    job_id = _uuid(args.job, "JOB")
    job = api.get(f"jobs/{job_id}/")
    logs = LogFollower(api, job_id, out=sys.stdout, attempt=args.attempt)
    logs.poll(job)
    if not args.follow:
        return 0
    while job["status"] not in TERMINAL:
        time.sleep(POLL_SECONDS)
        job = _retrying(lambda: api.get(f"jobs/{job_id}/"))
        logs.poll(job)
    logs.poll(job, final=True)
    print(f"job {job_id} {job['status']}" + _exit_text(job), file=sys.stderr)
    return 0


def _exit_text(job: dict) -> str:
    return f" (exit code {job['exit_code']})" if job.get("exit_code") is not None else ""


def cmd_jobs_cancel(api: Api, args: argparse.Namespace) -> int:
    job_id = _uuid(args.job, "JOB")
    job = api.post(f"jobs/{job_id}/cancel/")
    if args.json:
        print_json(job)
    elif job["status"] in TERMINAL:
        print(f"job {job_id} {job['status']}")
    else:
        print(f"job {job_id}: cancel requested ({job['status']}; the agent stops it)")
    return 0


def cmd_jobs_ls(api: Api, args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"ordering": "-created_at"}
    if args.status:
        params["status"] = args.status
    if args.config:
        params["config_name"] = args.config
    rows = api.pages("jobs/", limit=max(1, args.limit), **params)
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no jobs", file=sys.stderr)
        return 0
    table(
        ["ID", "CONFIG", "STATUS", "ATTEMPT", "EXIT", "WAITED", "RAN", "AGE", "REASON"],
        [
            [
                j["id"],
                j["config_name"],
                j["status"],
                f"{j['attempt']}/{j['max_attempts']}",
                j["exit_code"],
                duration(_waited(j)),
                duration(between(j["started_at"], j["finished_at"])) if j["started_at"] else None,
                age(j["created_at"]),
                j["pending_reason"] or j["failure_reason"] or j["requeue_reason"],
            ]
            for j in rows
        ],
    )
    return 0


def cmd_jobs_show(api: Api, args: argparse.Namespace) -> int:
    job = api.get(f"jobs/{_uuid(args.job, 'JOB')}/")
    if args.json:
        print_json(job)
    else:
        print_job_summary(job)
    return 0


def _waited(job: dict) -> float | None:
    """From (the latest) queueing to the start (or the end, for a job that never started)."""
    return between(job["queued_at"] or job["created_at"], job["started_at"] or job["finished_at"])


def _github_rows(labels: dict) -> list[tuple[str, Any]]:
    """A GitHub Actions runner job: the workflow job it ran (or was started for)."""
    if "repository" not in labels:
        return []
    run = f"run {labels.get('run_id')}" + (
        f" attempt {labels['run_attempt']}" if labels.get("run_attempt") else ""
    )
    return [
        ("github", f"{labels['repository']} {labels.get('workflow', '')} / {labels.get('job_name', '')}"),
        ("run", run),
    ]


def print_job_summary(job: dict, out: Any = None) -> None:
    out = out or sys.stdout
    cost = job.get("cost") or {}
    rows = [
        ("job", job["id"]),
        ("config", job["config_name"]),
        ("status", job["status"] + _exit_text(job)),
        ("attempt", f"{job['attempt']}/{job['max_attempts']}"),
        ("instance", job.get("instance")),
        ("waited", duration(_waited(job))),
        ("ran", duration(between(job["started_at"], job["finished_at"])) if job["started_at"] else None),
        ("reason", job.get("failure_reason") or job.get("pending_reason") or job.get("requeue_reason")),
        ("cost", f"{cost['amount']} {cost['currency']}" if cost.get("amount") is not None else None),
        *_github_rows(job.get("labels") or {}),
    ]
    for key, value in rows:
        if value not in (None, ""):
            print(f"{key:<9}{value}", file=out)


# ---- pools --------------------------------------------------------------------------------------


def cmd_pools_ls(api: Api, args: argparse.Namespace) -> int:
    rows = api.pages("pools/", limit=1000)
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no pools", file=sys.stderr)
        return 0
    table(
        ["NAME", "ID", "STATUS", "MACHINE TYPE", "READY", "MEMBERS", "TARGET", "MIN", "MAX", "LIMIT"],
        [
            [
                p["name"],
                p["id"],
                p["status"],
                p["machine_type"],
                p["ready_count"],
                p["member_count"],
                p["target_size"],
                p["min_size"],
                p["max_size"],
                p.get("limit_reason"),
            ]
            for p in rows
        ],
    )
    return 0


def _pool_id(api: Api, ref: str) -> str:
    try:
        return str(uuid.UUID(ref))
    except ValueError:
        pass
    found = api.get("pools/", name=ref)["results"]
    if not found:
        raise ApiError(404, "not_found", f"no pool named {ref!r}")
    return found[0]["id"]


def cmd_pools_acquire(api: Api, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"acquired_by": args.by, "acquired_for": args.purpose}
    if args.lease:
        body["lease_seconds"] = args.lease
    claim = api.post(f"pools/{_pool_id(api, args.pool)}/acquire/", body)
    if args.json:
        print_json(claim)
        return 0
    inst = claim["instance"]
    for key, value in [
        ("instance", inst["id"]),
        ("claim", claim["claim_id"]),
        ("status", inst["status"]),
        ("type", inst["machine_type"]),
        ("provider", f"{inst['provider']} {inst.get('provider_id') or ''}".strip()),
        ("address", inst.get("public_ip")),
        ("lease", inst.get("lease_expires_at") and f"until {inst['lease_expires_at']}"),
    ]:
        if value:
            print(f"{key:<9}{value}")
    print(f"release: catacloud pools release {inst['id']}", file=sys.stderr)
    return 0


def cmd_pools_release(api: Api, args: argparse.Namespace) -> int:
    body = {"claim_id": _uuid(args.claim, "--claim")} if args.claim else {}
    answer = api.post(f"instances/{_uuid(args.instance, 'INSTANCE')}/release/", body)
    if args.json:
        print_json(answer)
    else:
        print(f"instance {answer['id']} released ({answer['status']})")
    return 0


# ---- artifacts ----------------------------------------------------------------------------------


def cmd_artifacts_ls(api: Api, args: argparse.Namespace) -> int:
    rows = api.get(f"jobs/{_uuid(args.job, 'JOB')}/artifacts/")
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no artifacts", file=sys.stderr)
        return 0
    table(
        ["NAME", "KIND", "SIZE", "STATUS", "ATTEMPT", "SHA256"],
        [[a["name"], a["kind"], size(a["size"]), a["status"], a["attempt"], a["sha256"][:16]] for a in rows],
    )
    return 0


def cmd_artifacts_get(api: Api, args: argparse.Namespace) -> int:
    job_id = _uuid(args.job, "JOB")
    response, chunks = api.download(f"jobs/{job_id}/artifacts/{args.name}")
    expected = response.headers.get("X-Checksum-Sha256")
    digest = hashlib.sha256()
    total = 0
    to_stdout = args.output == "-"
    target = None if to_stdout else Path(args.output or args.name.rsplit("/", 1)[-1])
    if target is not None and target.is_dir():
        target = target / args.name.rsplit("/", 1)[-1]
    partial = None if target is None else target.with_name(f".{target.name}.part")
    sink = sys.stdout.buffer if partial is None else partial.open("wb")
    try:
        for chunk in chunks:
            digest.update(chunk)
            sink.write(chunk)
            total += len(chunk)
    finally:
        if partial is not None:
            sink.close()
        response.close()
    if expected and digest.hexdigest() != expected:
        if partial is not None:
            partial.unlink(missing_ok=True)
        raise ApiError(0, "checksum_mismatch", f"{args.name}: the download does not match its sha256")
    if target is not None and partial is not None:
        os.replace(partial, target)
        if args.json:
            print_json({"name": args.name, "path": str(target), "size": total, "sha256": digest.hexdigest()})
        else:
            sha = digest.hexdigest()[:16]
            print(f"{args.name} → {target} ({size(total)}, sha256 {sha}…)", file=sys.stderr)
    return 0
