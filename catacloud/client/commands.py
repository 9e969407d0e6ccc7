"""``catacloud jobs|configs|pools|instances|artifacts|auth …``: the client commands on the REST API.

Every command takes ``--url``, ``--profile`` and ``--json``, before or after the subcommand
(see :mod:`catacloud.client.config` for where the URL and token come from). Objects are named
as the console shows them: a name, a whole id, or its first hex digits (``bd3d252e``) when
they are unique, like git and docker. Tables and progress are for people; ``--json`` prints
the API's answer for scripts. Exit status: 0 done, 1 the API refused or could not be reached
(the ``{code, detail}`` is shown on stderr), 2 bad usage; ``--wait`` / ``--follow`` end with
the job's own: 0 succeeded, its exit code when it failed with one, else 1.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import os
import re
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from catacloud.client.api import Api, ApiError
from catacloud.client.config import (
    DEFAULT_URL,
    ClientConfig,
    ConfigError,
    normalize_url,
    print_warnings,
    remove_login,
    resolve,
    save_login,
)
from catacloud.client.output import age, between, duration, print_json, short, size, table
from catacloud.client.usage import add_global_flags

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "timed_out"})
# A job's states, in the order a job goes through them (the API's JobStatus).
JOB_STATUSES = (
    "queued",
    "acquiring_resources",
    "waiting_for_machine",
    "assigned",
    "running",
    "succeeded",
    "failed",
    "cancelled",
    "timed_out",
)
# A machine's states (the API's InstanceStatus).
INSTANCE_STATUSES = (
    "pending",
    "provisioning",
    "warming",
    "ready",
    "claimed",
    "terminating",
    "terminated",
    "failed",
    "lost",
)
# The 401s Catacloud answers (ErrorCode): another server's 401 is not about our token.
TOKEN_REFUSED = frozenset({"not_authenticated", "authentication_failed"})
MIN_PREFIX = 4  # hex digits of a short id, like git's shortest abbreviation
POLL_SECONDS = 1.0
RETRIES_WHILE_WAITING = 10  # consecutive transient errors tolerated by --wait / -f


class UsageError(Exception):
    pass


# ---- registration -------------------------------------------------------------------------------


class _Commands:
    """Where a group's commands are registered: every one takes the global flags too."""

    def __init__(self, subparsers: Any) -> None:
        self.subparsers = subparsers
        self.common = argparse.ArgumentParser(add_help=False)
        add_global_flags(self.common, top=False)

    def group(self, name: str, help: str) -> Any:
        parser = self.subparsers.add_parser(name, help=help, description=help)
        return parser.add_subparsers(dest=f"{name}_cmd", required=True, metavar="COMMAND")

    def command(self, sub: Any, name: str, func: Callable, help: str, **kw: Any) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, parents=[self.common], help=help, description=help, **kw)
        parser.set_defaults(func=lambda args: run(func, args), _parser=parser)
        return parser


def _status_filter(parser: argparse.ArgumentParser, statuses: tuple[str, ...]) -> None:
    """The ``--status`` option of a listing: repeatable, one of ``statuses`` each time."""
    parser.add_argument(
        "--status",
        action="append",
        default=[],
        choices=statuses,
        metavar="STATUS",
        help="only these statuses (repeatable): " + ", ".join(statuses),
    )


def add_client_commands(subparsers: Any) -> None:
    """Register ``jobs``, ``configs``, ``pools``, ``instances``, ``artifacts`` and ``auth`` on an
    ``add_subparsers()`` object (whose parser carries the global flags too)."""
    at = _Commands(subparsers)
    for register in (_jobs, _configs, _pools, _instances, _artifacts, _auth):
        register(at)


def _jobs(at: _Commands) -> None:
    jobs = at.group("jobs", "submit, follow, list and cancel jobs (client of the REST API)")
    p = at.command(jobs, "submit", cmd_jobs_submit, "submit a job of a configuration (by name or id)")
    p.add_argument("--config", required=True, metavar="NAME", help="job configuration name or id")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="env for this run (repeatable)")
    p.add_argument("--wait", action="store_true", help="wait for the job to end, showing its progress")
    p.add_argument("--follow", "-f", action="store_true", help="like --wait, printing its output as it comes")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="stop waiting after this (exit 1)")

    p = at.command(jobs, "logs", cmd_jobs_logs, "print a job's output (-f: follow it until the job ends)")
    p.add_argument("job", metavar="JOB", help="job id (or its first digits)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new output until the job ends")
    p.add_argument("--attempt", type=int, help="which attempt (default: the current one)")

    p = at.command(jobs, "cancel", cmd_jobs_cancel, "cancel a job (in any live state)")
    p.add_argument("job", metavar="JOB", help="job id (or its first digits)")

    p = at.command(jobs, "ls", cmd_jobs_ls, "list jobs, newest first")
    _status_filter(p, JOB_STATUSES)
    p.add_argument("--config", metavar="NAME", help="only jobs of this configuration")
    p.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")

    p = at.command(jobs, "show", cmd_jobs_show, "one job: status, attempts, timings, cost, then its events")
    p.add_argument("job", metavar="JOB", help="job id (or its first digits)")
    p.add_argument(
        "--timing", action="store_true", help="where its start time went: each stage, and its trace id"
    )


def _configs(at: _Commands) -> None:
    configs = at.group("configs", "list, create and delete job configurations")
    at.command(configs, "ls", cmd_configs_ls, "list job configurations")
    p = at.command(configs, "create", cmd_configs_create, "create a job configuration (admin)")
    p.add_argument("name", metavar="NAME", help="its name, e.g. unit-tests")
    p.add_argument("--machine-type", required=True, metavar="TYPE", help="machine type name or id")
    p.add_argument("--command", required=True, help="what the job runs, under /bin/sh -c")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="env of every run (repeatable)")
    p.add_argument("--timeout", type=int, metavar="SECONDS", help="the job is killed after this")
    p.add_argument("--priority", type=int, help="higher runs first (default 0)")
    p.add_argument("--max-attempts", type=int, help="attempts on machine loss (default 3)")
    p.add_argument("--reuse", choices=["reuse", "ephemeral"], help="keep the machine for the next job or not")
    p.add_argument(
        "--resource",
        action="append",
        default=[],
        metavar="TYPE",
        help="a resource type it needs (repeatable)",
    )
    p = at.command(configs, "delete", cmd_configs_delete, "delete a job configuration no job uses (admin)")
    p.add_argument("config", metavar="CONFIG", help="its name or id")


def _pools(at: _Commands) -> None:
    pools = at.group("pools", "list, create, drain and delete warm pools; acquire and release their machines")
    at.command(pools, "ls", cmd_pools_ls, "list pools with their members by state")
    p = at.command(pools, "create", cmd_pools_create, "create a warm pool (admin)")
    p.add_argument("name", metavar="NAME", help="its name, e.g. ci")
    p.add_argument("--machine-type", required=True, metavar="TYPE", help="machine type name or id")
    p.add_argument("--size", type=int, required=True, help="machines to keep warm (target_size)")
    p.add_argument("--min", type=int, dest="min_size", help="min_size (default 0)")
    p.add_argument("--max", type=int, dest="max_size", help="max_size (default: --size)")
    p.add_argument("--warmup-grace", type=int, metavar="SECONDS", help="a member warming longer is replaced")
    p.add_argument("--description", help="what it is for")
    p = at.command(pools, "acquire", cmd_pools_acquire, "take a ready machine from a pool (never waits)")
    p.add_argument("pool", metavar="POOL", help="pool name or id")
    p.add_argument("--by", default="", help="who holds it (acquired_by), e.g. runner-7")
    p.add_argument("--for", dest="purpose", default="", help="what for (acquired_for), e.g. 'build 1234'")
    p.add_argument("--lease", type=int, metavar="SECONDS", help="the claim ends by itself after this")
    p = at.command(pools, "release", cmd_pools_release, "hand back an acquired machine (it is terminated)")
    p.add_argument("instance", metavar="INSTANCE", help="instance id (or its first digits)")
    p.add_argument("--claim", metavar="CLAIM_ID", help="release only if this claim still holds it")
    p = at.command(
        pools, "drain", cmd_pools_drain, "stop keeping machines: no new member, no acquire (admin)"
    )
    p.add_argument("pool", metavar="POOL", help="pool name or id")
    p.add_argument(
        "--terminate-members",
        action="store_true",
        help="destroy its members now (else the unclaimed ones are released and end with their paid period)",
    )
    p = at.command(pools, "delete", cmd_pools_delete, "delete a drained pool (admin)")
    p.add_argument("pool", metavar="POOL", help="pool name or id")


def _instances(at: _Commands) -> None:
    instances = at.group("instances", "list, show and terminate machines")
    p = at.command(instances, "ls", cmd_instances_ls, "list machines, newest first")
    _status_filter(p, INSTANCE_STATUSES)
    p.add_argument("--pool", metavar="POOL", help="only members of this pool (name or id)")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    p = at.command(
        instances, "show", cmd_instances_show, "one machine: status, pool, provider, address, cost"
    )
    p.add_argument("instance", metavar="INSTANCE", help="instance id (or its first digits)")
    p = at.command(
        instances, "terminate", cmd_instances_terminate, "destroy a machine at its provider (admin)"
    )
    p.add_argument("instance", metavar="INSTANCE", help="instance id (or its first digits)")


def _artifacts(at: _Commands) -> None:
    artifacts = at.group("artifacts", "list and download the files a job kept")
    p = at.command(artifacts, "ls", cmd_artifacts_ls, "list a job's artifacts")
    p.add_argument("job", metavar="JOB", help="job id (or its first digits)")
    p = at.command(artifacts, "get", cmd_artifacts_get, "download one artifact (its sha256 is checked)")
    p.add_argument("job", metavar="JOB", help="job id (or its first digits)")
    p.add_argument("name", metavar="NAME", help="artifact name, e.g. reports/junit.xml")
    p.add_argument(
        "--output", "-o", metavar="PATH", help="file or directory (- for stdout; default ./BASENAME)"
    )


def _auth(at: _Commands) -> None:
    auth = at.group("auth", "store and check the token for a server (like gh auth)")
    p = auth.add_parser(
        "login",
        parents=[at.common],
        help="check a token and store it for a URL in the config file",
        description="Check a token against the server and store it, with the URL, as a profile of "
        "the config file (mode 0600). The token is read from standard input (a prompt on a "
        "terminal), never from the command line.",
    )
    p.set_defaults(func=cmd_auth_login, _parser=p)
    p = auth.add_parser("status", parents=[at.common], help="which server and token the client uses, checked")
    p.set_defaults(func=lambda args: run(cmd_auth_status, args), _parser=p)
    p = auth.add_parser(
        "logout",
        parents=[at.common],
        help="remove a stored token from the config file",
        description="Remove the profile holding the token for a URL (--url, else CATACLOUD_URL, else "
        "the default profile's), or the profile --profile names, from the config file.",
    )
    p.set_defaults(func=cmd_auth_logout, _parser=p)


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
        show_error(exc, args, url=config.url)
        return 1
    except (KeyError, TypeError, AttributeError):
        # A JSON answer without what every Catacloud answer has: another server at this URL.
        print(
            f"error: {config.url} answered with something this client does not understand; "
            "is it a Catacloud server? (check --url, CATACLOUD_URL or the profile's url)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `catacloud jobs ls | head -3`: the reader has gone, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def show_error(exc: ApiError, args: argparse.Namespace, *, url: str) -> None:
    if args.json:
        print_json(exc.as_dict(), out=sys.stderr)
        return
    where = f"HTTP {exc.status}" if exc.status else "no answer"
    print(f"error: {exc.detail} ({exc.code}, {where})", file=sys.stderr)
    for name, messages in sorted(exc.fields.items()):
        text = "; ".join(messages) if isinstance(messages, list) else str(messages)
        if f"{name}: {text}" != exc.detail:  # one message, not the same one twice
            print(f"  {name}: {text}", file=sys.stderr)
    if exc.status == 401 and exc.code in TOKEN_REFUSED:
        print(
            "  (check CATACLOUD_TOKEN or the profile's token; `catacloud auth login` stores one)",
            file=sys.stderr,
        )
    elif exc.status == 401:
        print(
            f"  ({url} answered 401 without Catacloud's error format: is it a Catacloud server? "
            "check --url, CATACLOUD_URL or the profile's url)",
            file=sys.stderr,
        )
    elif exc.code in ("http_error", "bad_response"):
        print(
            "  (is this a Catacloud server? check --url, CATACLOUD_URL or the profile's url)", file=sys.stderr
        )


def _uuid(value: str, what: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise UsageError(f"{what} must be an id (a UUID), got {value!r}") from None


def resolve_id(api: Api, kind: str, path: str, ref: str, *, by_name: bool = False) -> str:
    """The id of the object ``ref`` names: a whole id, a name (``by_name``), or the first hex
    digits of an id when only one object's id starts with them (git's and docker's short ids)."""
    ref = ref.strip()
    try:
        return str(uuid.UUID(ref))
    except ValueError:
        pass
    if by_name:
        found = api.get(path, name=ref)["results"]
        if found:
            return str(found[0]["id"])
    digits = ref.replace("-", "").lower()
    if len(digits) < MIN_PREFIX or not re.fullmatch(r"[0-9a-f]+", digits):
        if by_name:
            raise ApiError(404, "not_found", f"no {kind} named {ref!r}")
        raise UsageError(
            f"{kind} {ref!r} is not an id: give its id, or at least its first {MIN_PREFIX} hex digits"
        )
    found = api.get(path, id_prefix=ref, limit=10)["results"]
    if not found:
        what = f"no {kind} named {ref!r} or" if by_name else f"no {kind}"
        raise ApiError(404, "not_found", f"{what} with an id starting {ref}")
    if len(found) > 1:
        ids = ", ".join(sorted(short(r["id"]) for r in found)[:3]) + ("…" if len(found) > 3 else "")
        raise UsageError(f"{ref} is the start of several {kind} ids ({ids}): give more of it")
    return str(found[0]["id"])


def _job_id(api: Api, ref: str) -> str:
    return resolve_id(api, "job", "jobs/", ref)


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
    # A submit whose answer is lost (the server restarting, a timeout) is sent again with the same
    # Idempotency-Key: the server answers the job the first one queued, never a second one.
    key = {"Idempotency-Key": str(uuid.uuid4())}
    job = _retrying(lambda: api.post("jobs/", body, headers=key))
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
        self.api, self.job_id, self.out = api, job_id, out  # stderr chunks go to stderr
        self.attempt = attempt
        self.after = -1
        self.pinned = attempt is not None

    def _fetch(self) -> bool:
        page = _retrying(
            lambda: self.api.get(f"jobs/{self.job_id}/logs/", after=self.after, attempt=self.attempt)
        )
        for chunk in page["chunks"]:
            stream = sys.stderr if chunk.get("stream") == "stderr" else self.out
            if stream is not self.out:
                self.out.flush()  # keep the order the job wrote them in
            stream.write(chunk["data"])
            stream.flush()
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
    job_id = _job_id(api, args.job)
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
    job_id = _job_id(api, args.job)
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
                short(j["id"]),
                j["config_name"],
                j["status"],
                f"{j['attempt']}/{j['max_attempts']}",
                j["exit_code"],
                duration(_waited(j)),
                duration(between(j["started_at"], j["finished_at"])) if j["started_at"] else None,
                age(j["created_at"]),
                _reason(j),
            ]
            for j in rows
        ],
    )
    return 0


def cmd_jobs_show(api: Api, args: argparse.Namespace) -> int:
    """The job, then what happened to it (like ``kubectl describe``'s events)."""
    job = api.get(f"jobs/{_job_id(api, args.job)}/")
    if args.timing:
        return _show_timing(api.get(f"jobs/{job['id']}/timing/"), args)
    events = api.get("events/", job_id=job["id"], limit=100)["results"][::-1]  # oldest first
    if args.json:
        print_json({**job, "events": events})
        return 0
    print_job_summary(job)
    print("\nevents:")
    start = job["created_at"]
    table(
        ["  AT", "KIND", "BY", "REASON"],
        [
            [f"  +{duration(between(start, e['created_at']))}", e["kind"], e["actor"], e["reason"]]
            for e in events
        ],
    )
    return 0


def _show_timing(timing: dict, args: argparse.Namespace) -> int:
    """``jobs show --timing``: submit -> running of the latest attempt, stage by stage."""
    if args.json:
        print_json(timing)
        return 0
    total = timing.get("submit_to_running_ms")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    print(f"job {timing['job']} (attempt {timing['attempt']}, {timing['status']})")
    print(f"submit -> running: {ms(total)}")
    if timing.get("trace_id"):
        print(f"trace: {timing['trace_id']}")
    print()
    table(
        ["STAGE", "TIME", "SHARE", "WHAT"],
        [
            [
                s["name"],
                ms(s["ms"]),
                f"{100 * s['ms'] / total:.0f}%" if total and s["ms"] is not None else "",
                s["what"],
            ]
            for s in timing["stages"]
        ],
    )
    return 0


def _reason(job: dict) -> str | None:
    """Why a job waits, or why it ended the way it did; a success has none (an earlier
    requeue's cause is history, shown as such)."""
    if job["status"] not in TERMINAL:
        return job.get("pending_reason") or None
    return job.get("failure_reason") or None


def _requeues(job: dict) -> str | None:
    requeues = job["attempt"] - 1
    if requeues <= 0:
        return None
    last = f" (last: {job['requeue_reason']})" if job.get("requeue_reason") else ""
    return f"{requeues}{last}"


def _waited(job: dict) -> float | None:
    """From (the latest) queueing to the start (or the end, for a job that never started)."""
    return between(job["queued_at"] or job["created_at"], job["started_at"] or job["finished_at"])


def _github_rows(labels: dict) -> list[tuple[str, Any]]:
    """A GitHub Actions runner job: the workflow job it ran (or was started for); a GitLab CI
    runner job: the CI job of its pipeline."""
    if "repository" not in labels:
        return []
    if labels.get("forge") == "gitlab":
        where = f"{labels['repository']} {labels.get('workflow', '')} / {labels.get('job_name', '')}"
        return [("gitlab", where), ("pipeline", labels.get("pipeline_id"))]
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
        ("requeued", _requeues(job)),
        ("instance", job.get("instance")),
        ("image", job.get("image")),
        ("digest", job.get("image_digest")),
        ("waited", duration(_waited(job))),
        ("ran", duration(between(job["started_at"], job["finished_at"])) if job["started_at"] else None),
        ("reason", _reason(job)),
        ("code", job.get("failure_code")),
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
                short(p["id"]),
                p["status"],
                p.get("machine_type_name") or p["machine_type"],
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


def cmd_pools_acquire(api: Api, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"acquired_by": args.by, "acquired_for": args.purpose}
    if args.lease:
        body["lease_seconds"] = args.lease
    claim = api.post(f"pools/{resolve_id(api, 'pool', 'pools/', args.pool, by_name=True)}/acquire/", body)
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
    answer = api.post(f"instances/{resolve_id(api, 'instance', 'instances/', args.instance)}/release/", body)
    if args.json:
        print_json(answer)
    else:
        print(f"instance {answer['id']} released ({answer['status']})")
    return 0


def cmd_pools_create(api: Api, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name, "machine_type": args.machine_type, "target_size": args.size}
    for key, value in (
        ("min_size", args.min_size),
        ("max_size", args.max_size if args.max_size is not None else max(args.size, args.min_size or 0)),
        ("warmup_grace_seconds", args.warmup_grace),
        ("description", args.description),
    ):
        if value is not None:
            body[key] = value
    pool = api.post("pools/", body)
    if args.json:
        print_json(pool)
        return 0
    print(
        f"pool {pool['name']} {short(pool['id'])} created: {pool['status']}, "
        f"{pool['target_size']} × {pool.get('machine_type_name') or args.machine_type} "
        f"(min {pool['min_size']}, max {pool['max_size']})"
    )
    print(f"watch it: catacloud pools ls; take one: catacloud pools acquire {pool['name']}", file=sys.stderr)
    return 0


def _pool(api: Api, ref: str) -> dict:
    return dict(api.get(f"pools/{resolve_id(api, 'pool', 'pools/', ref, by_name=True)}/"))


def cmd_pools_drain(api: Api, args: argparse.Namespace) -> int:
    pool = _pool(api, args.pool)
    answer = api.post(f"pools/{pool['id']}/drain/", {"terminate_members": args.terminate_members})
    if args.json:
        print_json(answer)
    elif args.terminate_members:
        n = answer["terminated_count"]
        print(f"pool {pool['name']} drained: {n} member{'' if n == 1 else 's'} terminated")
    else:
        released = "its unclaimed members are released (they end with their paid period)"
        print(f"pool {pool['name']} drained: {released}")
    if not args.json:
        print(f"delete it: catacloud pools delete {pool['name']}", file=sys.stderr)
    return 0


def cmd_pools_delete(api: Api, args: argparse.Namespace) -> int:
    pool = _pool(api, args.pool)
    api.delete(f"pools/{pool['id']}/")
    if args.json:
        print_json({"id": pool["id"], "name": pool["name"], "deleted": True})
    else:
        print(f"pool {pool['name']} {short(pool['id'])} deleted")
    return 0


# ---- instances ----------------------------------------------------------------------------------


def _instance_id(api: Api, ref: str) -> str:
    return resolve_id(api, "instance", "instances/", ref)


def cmd_instances_ls(api: Api, args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"ordering": "-created_at"}
    if args.status:
        params["status"] = args.status
    if args.pool:
        params["pool"] = resolve_id(api, "pool", "pools/", args.pool, by_name=True)
    rows = api.pages("instances/", limit=max(1, args.limit), **params)
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no instances", file=sys.stderr)
        return 0
    pools = (
        {p["id"]: p["name"] for p in api.pages("pools/", limit=1000)} if any(r["pool"] for r in rows) else {}
    )
    table(
        ["ID", "STATUS", "MACHINE TYPE", "POOL", "PROVIDER", "ADDRESS", "CLAIMED FOR", "AGE", "COST"],
        [
            [
                short(i["id"]),
                i["status"],
                i["machine_type"],
                pools.get(i["pool"], short(i["pool"])) if i["pool"] else None,
                i["provider"],
                i.get("public_ip") or i.get("private_ip"),
                i.get("claimed_for"),
                age(i["created_at"]),
                i.get("cost"),
            ]
            for i in rows
        ],
    )
    return 0


def cmd_instances_show(api: Api, args: argparse.Namespace) -> int:
    inst = api.get(f"instances/{_instance_id(api, args.instance)}/")
    if args.json:
        print_json(inst)
        return 0
    cost = inst.get("cost_detail") or {}
    rows = [
        ("instance", inst["id"]),
        ("status", inst["status"]),
        ("type", inst["machine_type"]),
        ("pool", inst.get("pool")),
        ("provider", f"{inst['provider']} {inst.get('provider_id') or ''}".strip()),
        ("address", inst.get("public_ip") or inst.get("private_ip")),
        ("claimed", " ".join(x for x in (inst.get("claimed_by"), inst.get("claimed_for")) if x) or None),
        ("lease", inst.get("lease_expires_at") and f"until {inst['lease_expires_at']}"),
        ("age", age(inst["created_at"])),
        ("reason", inst.get("failure_reason") or inst.get("end_cause")),
        ("cost", f"{cost['cost']} {cost['currency']}" if cost.get("cost") is not None else inst.get("cost")),
    ]
    for key, value in rows:
        if value not in (None, ""):
            print(f"{key:<9}{value}")
    return 0


def cmd_instances_terminate(api: Api, args: argparse.Namespace) -> int:
    answer = api.post(f"instances/{_instance_id(api, args.instance)}/terminate/")
    if args.json:
        print_json(answer)
    else:
        print(f"instance {answer['id']} {answer['status']}")
    return 0


# ---- job configurations -------------------------------------------------------------------------


def cmd_configs_ls(api: Api, args: argparse.Namespace) -> int:
    rows = api.pages("job-configs/", limit=1000)
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no job configurations (catacloud configs create NAME …)", file=sys.stderr)
        return 0
    table(
        ["NAME", "ID", "MACHINE TYPE", "REUSE", "TIMEOUT", "PRIORITY", "ATTEMPTS", "COMMAND"],
        [
            [
                c["name"],
                short(c["id"]),
                c.get("machine_type_name") or c["machine_type"],
                c["reuse"],
                duration(c["timeout_seconds"]),
                c["priority"],
                c["max_attempts"],
                c["command"] if len(c["command"]) <= 40 else c["command"][:39] + "…",
            ]
            for c in rows
        ],
    )
    return 0


def cmd_configs_create(api: Api, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name, "machine_type": args.machine_type, "command": args.command}
    env = _parse_env(args.env)
    for key, value in (
        ("env", env or None),
        ("timeout_seconds", args.timeout),
        ("priority", args.priority),
        ("max_attempts", args.max_attempts),
        ("reuse", args.reuse),
        ("resources", args.resource or None),
    ):
        if value is not None:
            body[key] = value
    config = api.post("job-configs/", body)
    if args.json:
        print_json(config)
        return 0
    print(
        f"job configuration {config['name']} {short(config['id'])} created "
        f"(machine type {config.get('machine_type_name') or args.machine_type})"
    )
    print(f"run it: catacloud jobs submit --config {config['name']} --follow", file=sys.stderr)
    return 0


def cmd_configs_delete(api: Api, args: argparse.Namespace) -> int:
    config = api.get(
        f"job-configs/{resolve_id(api, 'job configuration', 'job-configs/', args.config, by_name=True)}/"
    )
    api.delete(f"job-configs/{config['id']}/")
    if args.json:
        print_json({"id": config["id"], "name": config["name"], "deleted": True})
    else:
        print(f"job configuration {config['name']} {short(config['id'])} deleted")
    return 0


# ---- auth ---------------------------------------------------------------------------------------


def _check_token(api: Api) -> dict:
    """Ask the server something every role may read: a wrong token or URL fails here."""
    page = api.get("machine-types/", limit=100)
    return {"machine_types": [m["name"] for m in page["results"]]}


def cmd_auth_login(args: argparse.Namespace) -> int:
    """Like ``gh auth login --with-token``: read a token, check it against the server, store it
    with the URL as a profile (``--profile``, default ``default``) of the config file."""
    url = normalize_url(args.url or os.environ.get("CATACLOUD_URL") or DEFAULT_URL)
    profile = args.profile or "default"
    if sys.stdin.isatty():
        token = getpass.getpass(f"Token for {url} (input hidden): ")
    else:
        token = sys.stdin.readline()
    token = token.strip()
    if not token:
        print("catacloud: no token given (pipe one in, or paste it at the prompt)", file=sys.stderr)
        return 2
    api = Api(ClientConfig(url=url, token=token, profile=profile, source="auth login"))
    try:
        checked = _check_token(api)
    except ApiError as exc:
        show_error(exc, args, url=url)
        print("catacloud: the token was not stored", file=sys.stderr)
        return 1
    except (KeyError, TypeError, AttributeError):
        print(f"error: {url} is not a Catacloud server (its answer has no machine types)", file=sys.stderr)
        return 1
    path = save_login(env=os.environ, url=url, token=token, profile=profile)
    if args.json:
        print_json({"url": url, "profile": profile, "config": str(path), **checked})
    else:
        types = ", ".join(checked["machine_types"]) or "none"
        print(f"logged in to {url}: token checked (machine types: {types})")
        print(f"stored as profile {profile!r} in {path} (mode 0600)")
    return 0


def cmd_auth_logout(args: argparse.Namespace) -> int:
    """Like ``gh auth logout``: forget the stored token of a server (the profile holding it)."""
    try:
        path, profile, url = remove_login(env=os.environ, url=args.url, profile=args.profile)
    except ConfigError as exc:
        print(f"catacloud: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print_json({"url": url, "profile": profile, "config": str(path), "removed": True})
    else:
        print(f"logged out of {url}: profile {profile!r} removed from {path}")
    if os.environ.get("CATACLOUD_TOKEN") or os.environ.get("CATACLOUD_TOKEN_FILE"):
        print("catacloud: CATACLOUD_TOKEN (or CATACLOUD_TOKEN_FILE) is still set here", file=sys.stderr)
    return 0


def cmd_auth_status(api: Api, args: argparse.Namespace) -> int:
    checked = _check_token(api)
    config = api.config
    if args.json:
        print_json({"url": config.url, "profile": config.profile, "source": config.source, **checked})
    else:
        print(f"{config.url}: token from {config.source} works")
        print(f"machine types: {', '.join(checked['machine_types']) or 'none'}")
    return 0


# ---- artifacts ----------------------------------------------------------------------------------


def cmd_artifacts_ls(api: Api, args: argparse.Namespace) -> int:
    rows = api.get(f"jobs/{_job_id(api, args.job)}/artifacts/")
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
    job_id = _job_id(api, args.job)
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
