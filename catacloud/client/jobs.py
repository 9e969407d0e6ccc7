"""``catacloud jobs …``: submit a job (by its configuration), wait for it or follow its output,
list (and watch) jobs, show one with its events, read its logs, cancel it. The waiting here is
what ``catacloud run`` does too."""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from typing import Any

from catacloud.client.api import Api
from catacloud.client.base import (
    POLL_SECONDS,
    Commands,
    Deadline,
    UsageError,
    parse_env,
    parse_secret_env,
    resolve_id,
    retrying,
    show_list,
    status_filter,
    watch_flags,
    watch_rows,
)
from catacloud.client.output import age, between, duration, fields, print_json, short, table

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
# A one-off job's command (catacloud run): the variable its configuration's command runs.
RUN_COMMAND_ENV = "CC_RUN_COMMAND"


def register(at: Commands) -> None:
    jobs = at.group("jobs", "submit, follow, list and cancel jobs (client of the REST API)")
    p = at.command(jobs, "submit", cmd_jobs_submit, "submit a job of a configuration (by name or id)")
    p.add_argument("config_ref", nargs="?", metavar="CONFIG", help="job configuration name or id")
    p.add_argument("--config", metavar="NAME", help="the same as CONFIG (the configuration's name or id)")
    run_flags(p)

    p = at.command(jobs, "logs", cmd_jobs_logs, "print a job's output (-f: follow it until the job ends)")
    p.add_argument("job", metavar="JOB", help="job id (or its first digits)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new output until the job ends")
    p.add_argument("--attempt", type=int, help="which attempt (default: the current one)")
    timeout_flag(p)

    p = at.command(jobs, "cancel", cmd_jobs_cancel, "cancel a job (in any live state)")
    p.add_argument("job", metavar="JOB", help="job id (or its first digits)")

    p = at.command(jobs, "ls", cmd_jobs_ls, "list jobs, newest first")
    status_filter(p, JOB_STATUSES)
    p.add_argument("--config", metavar="NAME", help="only jobs of this configuration")
    p.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    watch_flags(p, "job")

    p = at.command(jobs, "show", cmd_jobs_show, "one job: status, attempts, timings, cost, then its events")
    p.add_argument("job", metavar="JOB", help="job id (or its first digits)")
    p.add_argument(
        "--timing", action="store_true", help="where its start time went: each stage, and its trace id"
    )


def run_flags(p: argparse.ArgumentParser) -> None:
    """What a submission may add to its configuration (``jobs submit``, ``run``), and how to wait."""
    submission_flags(p)
    p.add_argument("--wait", action="store_true", help="wait for the job to end, showing its progress")
    p.add_argument("--follow", "-f", action="store_true", help="like --wait, printing its output as it comes")
    timeout_flag(p)


def submission_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="env for this run (repeatable)")
    secret_env_flag(p, "for this run, besides the configuration's")
    p.add_argument(
        "--image", metavar="REF", help="run in this container image instead of the configuration's"
    )


def timeout_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout", type=float, metavar="SECONDS", help="stop waiting after this (exit 1; the job goes on)"
    )


def secret_env_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--secret-env",
        action="append",
        default=[],
        metavar="NAME[=@FILE]",
        help=f"a secret env value {what}: NAME's value in this shell, or a file's content (@- for "
        "stdin); stored encrypted, never shown, never a command-line value (repeatable)",
    )


def find_job(api: Api, ref: str) -> str:
    """The id of the job ``ref`` names (a whole id or its first hex digits)."""
    return resolve_id(api, "job", "jobs/", ref)


# ---- submit and wait ----------------------------------------------------------------------------


def submission(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """The body of ``POST /jobs/`` for ``config`` with the run flags' env, secret env and image."""
    body: dict[str, Any] = {"config": config}
    env, secret_env = parse_env(args.env), parse_secret_env(args.secret_env)
    for key, value in (("env", env), ("secret_env", secret_env), ("image", args.image)):
        if value:
            body[key] = value
    return body


def cmd_jobs_submit(api: Api, args: argparse.Namespace) -> int:
    if args.config_ref and args.config and args.config_ref != args.config:
        raise UsageError(f"two configurations named: {args.config_ref} and --config {args.config}")
    config = args.config_ref or args.config
    if not config:
        raise UsageError(
            "name a configuration: catacloud jobs submit CONFIG (catacloud configs ls lists them)"
        )
    return submit_and_wait(api, submission(config, args), args)


def submit_and_wait(api: Api, body: dict[str, Any], args: argparse.Namespace) -> int:
    """Submit, then (with ``--wait`` or ``--follow``) wait for the job to end."""
    # A submit whose answer is lost (the server restarting, a timeout) is sent again with the same
    # Idempotency-Key: the server answers the job the first one queued, never a second one.
    key = {"Idempotency-Key": str(uuid.uuid4())}
    job = retrying(lambda: api.post("jobs/", body, headers=key))
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
    deadline = Deadline(timeout)
    job = retrying(lambda: api.get(f"jobs/{job_id}/"))
    while True:
        if logs:
            progress.clear()
            logs.poll(job)
        progress.show(job)
        if job["status"] in TERMINAL:
            break
        if deadline.passed():
            progress.done()
            return gave_up(job, deadline)
        deadline.sleep(POLL_SECONDS)
        job = retrying(lambda: api.get(f"jobs/{job_id}/"))
    if logs:
        progress.clear()
        logs.poll(job, final=True)
    progress.done()
    if args.json:
        print_json(job)
    else:
        print_job_summary(job, out=sys.stderr if follow else sys.stdout)
    return job_exit_status(job)


def gave_up(job: dict, deadline: Deadline) -> int:
    """``--timeout`` passed before the job ended: say so; the job goes on (exit 1)."""
    print(
        f"catacloud: job {job['id']} still {job['status']} after {deadline.seconds:g}s; stopped waiting "
        f"(it goes on: catacloud jobs logs -f {short(job['id'])})",
        file=sys.stderr,
    )
    return 1


def job_exit_status(job: dict) -> int:
    if job["status"] == "succeeded":
        return 0
    code = job.get("exit_code")
    if isinstance(code, int) and 0 < code < 256:
        return code
    return 1


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
        page = retrying(
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
    job_id = find_job(api, args.job)
    job = api.get(f"jobs/{job_id}/")
    logs = LogFollower(api, job_id, out=sys.stdout, attempt=args.attempt)
    logs.poll(job)
    if not args.follow:
        return 0
    deadline = Deadline(args.timeout)
    while job["status"] not in TERMINAL:
        if deadline.passed():
            return gave_up(job, deadline)
        deadline.sleep(POLL_SECONDS)
        job = retrying(lambda: api.get(f"jobs/{job_id}/"))
        logs.poll(job)
    logs.poll(job, final=True)
    print(f"job {job_id} {job['status']}" + _exit_text(job), file=sys.stderr)
    return 0


def _exit_text(job: dict) -> str:
    return f" (exit code {job['exit_code']})" if job.get("exit_code") is not None else ""


def cmd_jobs_cancel(api: Api, args: argparse.Namespace) -> int:
    job_id = find_job(api, args.job)
    job = api.post(f"jobs/{job_id}/cancel/")
    if args.json:
        print_json(job)
    elif job["status"] in TERMINAL:
        print(f"job {job_id} {job['status']}")
    else:
        print(f"job {job_id}: cancel requested ({job['status']}; the agent stops it)")
    return 0


JOB_COLUMNS = ("ID", "CONFIG", "STATUS", "ATTEMPT", "EXIT", "WAITED", "RAN", "AGE", "REASON")


def _job_cells(j: dict) -> list[Any]:
    return [
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


def cmd_jobs_ls(api: Api, args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"ordering": "-created_at"}
    if args.status:
        params["status"] = args.status
    if args.config:
        params["config_name"] = args.config

    def fetch() -> list[dict]:
        return list(retrying(lambda: api.pages("jobs/", limit=max(1, args.limit), **params)))

    if args.watch:
        return watch_rows(fetch, JOB_COLUMNS, _job_cells, args, empty="no jobs yet; watching")
    return show_list(args, fetch(), JOB_COLUMNS, _job_cells, empty="no jobs")


def cmd_jobs_show(api: Api, args: argparse.Namespace) -> int:
    """The job, then what happened to it (like ``kubectl describe``'s events)."""
    job = api.get(f"jobs/{find_job(api, args.job)}/")
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
    launch = timing.get("launch")
    if launch:
        print(f"\nthen {launch['name']}: {ms(launch['ms'])} ({launch['what']})")
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
        ("command", (job.get("env") or {}).get(RUN_COMMAND_ENV)),  # a one-off (catacloud run)
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
    fields(rows, out=out)
