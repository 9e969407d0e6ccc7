"""A stand-in for ``gitlab-runner run-single``, for the fake GitLab (testkit/gitlab_fake.py).

Standard library only (it runs inside a job, which sees the venv's python3 and its own work
folder, not the project checkout). Like the real runner's ``run-single`` (gitlab-runner
``commands/single.go``): it takes GitLab's URL and the runner's token from ``--url``/``--token``
(or ``CI_SERVER_URL``/``CI_SERVER_TOKEN``: ``common/config.go``'s env tags), or, with
``--config FILE --runner NAME`` (gitlab-runner 17.1 and later), the whole runner from that
``[[runners]]`` entry of a config.toml (url, token, executor, builds_dir, cache_dir,
``[runners.docker] image``; the command line's runner options are then ignored, as
``HandleArgs`` replaces them), its system id (runner manager) from ``.runner_system_id`` beside
the config. It never verifies the token (the real one does not): it asks for a job (``POST
/api/v4/jobs/request``, its system id with it) until ``--wait-timeout`` seconds pass (a 403 makes
it wait 300 s before asking again, as the real one), one job at a time, runs the job's
script lines in ``--builds-dir``, keeps the job alive with trace updates on an interval, reports success or
failure (``PUT /api/v4/jobs/:id``) and, after ``--max-builds`` jobs, exits 0. The fake may ask it
to misbehave: ``crash`` (exit 3 right after taking a job), ``hang`` (take a job and never
report), ``never_connect``.

The job's environment is what the real executor gives it (:func:`job_env`):

- ``shell``: the runner process's own environment, whole, plus the job's variables
  (``executors/shell/shell.go``: ``Env: os.Environ()``). Whatever the runner was started with
  (``CI_SERVER_TOKEN`` included) reaches the job's script.
- ``docker``: the job's variables only (``executors/docker/docker.go``: the container's ``Env``
  is ``prepareContainerEnvVariables()``, the build's variables), in a container of the job's
  image, through the Docker API at ``$DOCKER_HOST`` (:func:`run_in_container`).

The docker executor, as gitlab-runner's (``executors/docker``): the image is the job's
``image.name`` (GitLab's job payload, gitlabhq ``lib/api/entities/ci/job_request/image.rb``),
else the config's ``[runners.docker] image``, else the job fails with "no Docker image specified
to run the build in" (``executor_docker.go``, ``getImageName``); it is pulled (the default pull
policy, ``always``), a container is made of it with the job's variables and its build folder,
started, its output copied to the job's log (demultiplexed, as ``stdcopy.StdCopy``), waited
for, killed if the job is canceled, and removed; the job's ``services:`` start before it and are
removed with it (:func:`start_service`). One difference: gitlab-runner attaches to the
container and writes the script to its shell's stdin (``internal/exec/exec.go``); this stand-in
gives the container the script as its command, and reads its output with ``logs?follow``. The
build folder is the job's work folder, bound at the same path (the real runner's builds are in
a volume at ``builds_dir``).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from typing import Any

from docker_api import Docker, DockerError  # beside this file (the module docstring)

KEEPALIVE = 2.0  # seconds between trace updates while a job runs (the update interval)
NOT_HEALTHY_WAIT = 300.0  # common/consts.go NotHealthyCheckInterval


def say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def call(
    url: str,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 40,
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url.rstrip("/") + path,
        data=data,
        method=method,
        headers={
            "Content-Type": "application/json",
            "User-Agent": "gitlab-runner stand-in",
            **(headers or {}),
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, None


def alive(url: str, job: dict[str, Any]) -> bool:
    """A trace update (the job is alive); False when GitLab refuses it (the job was canceled)."""
    try:
        status, _ = call(
            url, "PATCH", f"/api/v4/jobs/{job['id']}/trace", {}, {"JOB-TOKEN": job["token"]}, timeout=10
        )
    except OSError:
        return True  # GitLab unreachable a moment: keep going
    return status != 403


def job_env(executor: str, variables: dict[str, str]) -> dict[str, str]:
    """The environment the real executor gives a job's script (the module docstring)."""
    if executor == "docker":
        return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", **variables}
    return {**os.environ, **variables}


def keep_alive(url: str, job: dict[str, Any], done: threading.Event, canceled: threading.Event) -> None:
    """From the job's start to its end, a trace update every KEEPALIVE seconds, whatever the
    script is doing (gitlab-runner ``network/trace.go``: ``clientJobTrace.watch`` sends
    ``incrementalUpdate`` on its update interval, its ``touchJob`` a state update when nothing
    was sent for ``forceSendInterval``); a refused one (the job was canceled) sets ``canceled``."""
    while not done.wait(KEEPALIVE):
        if not alive(url, job):
            canceled.set()
            return


def run_script(
    url: str, job: dict[str, Any], builds_dir: str, executor: str, docker: dict[str, str] | None = None
) -> str:
    """The job's script lines, in its build folder: success, failed or canceled."""
    variables = {v["key"]: v["value"] for v in job.get("variables") or []}
    project = job.get("job_info", {}).get("project_name", "project")
    work = os.path.join(builds_dir, project, str(job["id"]))
    os.makedirs(work, exist_ok=True)
    env = job_env(executor, variables)
    lines = [line for step in job.get("steps") or [] for line in step.get("script") or []]
    done, canceled = threading.Event(), threading.Event()
    threading.Thread(target=keep_alive, args=(url, job, done, canceled), daemon=True).start()
    try:
        if executor == "docker":
            return run_in_container(job, lines, work, variables, canceled, docker or {})
        for line in lines:
            say(f"$ {line}")
            # in a process group of its own, stopped whole (gitlab-runner ``helpers/process``:
            # ``job_unix.go`` sets Setpgid, ``killer_unix.go`` signals -pid, the whole group)
            proc = subprocess.Popen(["/bin/sh", "-c", line], cwd=work, env=env, process_group=0)
            while True:
                try:
                    code = proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    if canceled.is_set():
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                        say("the job was canceled")
                        return "canceled"
            if code != 0:
                say(f"ERROR: Job failed: exit status {code}")
                return "failed"
        return "success"
    finally:
        done.set()


def run_in_container(
    job: dict[str, Any],
    lines: list[str],
    work: str,
    variables: dict[str, str],
    canceled: threading.Event,
    docker_config: dict[str, str],
) -> str:
    """The docker executor (the module docstring): the script in a container of the job's image."""
    image = (job.get("image") or {}).get("name") or docker_config.get("image", "")
    network_mode = docker_config.get("network_mode", "")
    if not image:
        say("ERROR: Job failed (system failure): no Docker image specified to run the build in")
        return "failed"
    docker = Docker(os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"))
    script = "set -e\n" + "".join(f"echo {shlex.quote('$ ' + line)}\n{line}\n" for line in lines)
    container, services = "", []  # what to remove at the end, whatever happens
    try:
        for number, service in enumerate(job.get("services") or []):
            start_service(docker, job, number, service, variables, network_mode, services)
        say(f"Pulling docker image {image} ...")
        docker.pull(image)
        made = docker.call(
            "POST",
            f"/containers/create?name=runner-{job['id']}-build",
            {
                "Image": image,
                "Cmd": ["sh", "-c", script],
                "Env": [f"{k}={v}" for k, v in variables.items()],
                "WorkingDir": work,
                "Labels": {
                    "com.gitlab.gitlab-runner.job.id": str(job["id"]),
                    "com.gitlab.gitlab-runner.type": "build",
                },
                # [runners.docker] network_mode, as is (Docker's default bridge when empty)
                "HostConfig": {"Binds": [f"{work}:{work}"], "NetworkMode": network_mode},
            },
        )
        container = made["Id"]
        docker.call("POST", f"/containers/{container}/start")
        threading.Thread(target=kill_when, args=(docker, container, canceled), daemon=True).start()
        for piece in docker.output(container):
            sys.stdout.write(piece.decode(errors="replace"))
            sys.stdout.flush()
        code = docker.call("POST", f"/containers/{container}/wait")["StatusCode"]
    except (DockerError, OSError, KeyError, ValueError, http.client.HTTPException) as exc:
        say(f"ERROR: Job failed (system failure): {exc}")
        return "failed"
    finally:
        for made_here in [container, *services]:
            if made_here:
                with contextlib.suppress(DockerError, OSError):
                    docker.call("DELETE", f"/containers/{made_here}?force=1&v=1")
    if canceled.is_set():
        say("the job was canceled")
        return "canceled"
    if code != 0:
        say(f"ERROR: Job failed: exit code {code}")
        return "failed"
    return "success"


def start_service(
    docker: Docker,
    job: dict[str, Any],
    number: int,
    service: dict[str, Any],
    variables: dict[str, str],
    network_mode: str,
    made: list[str],
) -> None:
    """One of the job's ``services:``, started before the build container (gitlab-runner's
    ``executors/docker`` ``createService``): its image pulled, its container made with the job's
    variables and its own, its ``command``/``entrypoint``, the runner's network mode (with
    ``host``, the build reaches it on localhost), and started. gitlab-runner then waits for its
    exposed ports with a helper container (up to ``wait_for_services_timeout``, 30 s); this
    stand-in waits until the engine says it runs, and the job's script retries its first call.
    Its id goes to ``made`` once it exists (removed at the job's end, started or not)."""
    name = service["name"]
    say(f"Starting service {name} ...")
    docker.pull(name)
    own = {v["key"]: v["value"] for v in service.get("variables") or []}
    config: dict[str, Any] = {
        "Image": name,
        "Env": [f"{k}={v}" for k, v in {**variables, **own}.items()],
        "Labels": {
            "com.gitlab.gitlab-runner.job.id": str(job["id"]),
            "com.gitlab.gitlab-runner.type": "service",
        },
        "HostConfig": {"NetworkMode": network_mode},
    }
    if service.get("command"):
        config["Cmd"] = list(service["command"])
    if service.get("entrypoint"):
        config["Entrypoint"] = list(service["entrypoint"])
    container = str(
        docker.call("POST", f"/containers/create?name=runner-{job['id']}-service-{number}", config)["Id"]
    )
    made.append(container)
    docker.call("POST", f"/containers/{container}/start")
    say("Waiting for services to be up and running ...")
    deadline = time.monotonic() + 30
    while not docker.call("GET", f"/containers/{container}/json")["State"]["Running"]:
        if time.monotonic() > deadline:
            raise DockerError(f"service {name} did not start within 30 s")
        time.sleep(0.2)


def kill_when(docker: Docker, container: str, canceled: threading.Event) -> None:
    """A canceled job's container is killed (its output then ends)."""
    canceled.wait()
    with contextlib.suppress(DockerError, OSError):
        docker.call("POST", f"/containers/{container}/kill")


def run_single(args: argparse.Namespace) -> int:
    url, token = args.url, args.token
    if not url or not token:
        say("run-single needs --url and --token (or CI_SERVER_URL and CI_SERVER_TOKEN)")
        return 2
    if args.executor not in ("shell", "docker"):
        say(f"this stand-in runs the shell and docker executors only (not {args.executor})")
        return 2
    # run-single never verifies its token (commands/single.go: Execute asks for jobs at once)
    say(f"Runtime platform arch=amd64 os=linux; executor={args.executor} max-builds={args.max_builds}")
    say(f"Starting runner for {url} with system id {args.system_id}")
    builds = 0
    deadline = time.monotonic() + args.wait_timeout
    while builds < args.max_builds:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            say(f"no job received within {args.wait_timeout}s (--wait-timeout); exiting")
            return 0
        request = {"token": token, "system_id": args.system_id, "wait": min(20.0, remaining)}
        try:
            status, job = call(url, "POST", "/api/v4/jobs/request", request)
        except OSError as exc:
            say(f"Checking for jobs... failed ({exc}); retrying")
            time.sleep(1)
            continue
        if status == 403:
            # network/gitlab.go RequestJob: forbidden is "not healthy"; single.go then waits
            # NotHealthyCheckInterval (300 s, common/consts.go) before asking again, and exits
            # once --wait-timeout has passed without a job
            say("ERROR: Checking for jobs... forbidden")
            time.sleep(max(0.0, min(NOT_HEALTHY_WAIT, deadline - time.monotonic())))
            continue
        if status != 201 or not job:
            continue
        builds += 1
        repo = job["git_info"]["repo_url"]
        say(f"Checking for jobs... received job={job['id']} repo_url={repo}")
        say(f"Running job {job['job_info']['name']} ({job['job_info']['project_name']})")
        if job.get("fault") == "crash":
            say("crashing as configured")
            os._exit(3)
        if job.get("fault") == "hang":
            say("hanging as configured")
            while True:
                time.sleep(3600)
        docker = {"image": args.docker_image, "network_mode": args.network_mode}  # [runners.docker]
        result = run_script(url, job, args.builds_dir, args.executor, docker)
        if result != "canceled":
            body = {"token": job["token"], "state": result}
            if result == "failed":
                body["failure_reason"] = "script_failure"
            for _ in range(10):
                try:
                    call(url, "PUT", f"/api/v4/jobs/{job['id']}", body)
                    break
                except OSError:
                    time.sleep(1)
        say(f"Job {'succeeded' if result == 'success' else result} (job={job['id']})")
        deadline = time.monotonic() + args.wait_timeout
    return 0


def from_config(args: argparse.Namespace) -> bool:
    """``--config FILE --runner NAME``: the runner's settings from that entry of the file, in
    place of the command line's (``RunSingleCommand.HandleArgs``). Read once, at start."""
    try:
        with open(args.config, "rb") as fh:  # a file, or a pipe (/dev/stdin, a FIFO)
            config = tomllib.loads(fh.read().decode())
    except (OSError, ValueError) as exc:
        say(f"FATAL: Error loading config: {exc}")
        return False
    found = [r for r in config.get("runners") or [] if r.get("name") == args.runner]
    if not found:
        say(f"FATAL: Error loading runner by name: could not find a runner with the name '{args.runner}'")
        return False
    runner = found[0]
    args.url, args.token = runner.get("url", ""), runner.get("token", "")
    args.executor = runner.get("executor", "")
    args.builds_dir = runner.get("builds_dir") or os.path.join(os.getcwd(), "builds")
    args.cache_dir = runner.get("cache_dir") or os.path.join(os.getcwd(), "cache")
    args.docker_image = (runner.get("docker") or {}).get("image", "")
    args.network_mode = (runner.get("docker") or {}).get("network_mode", "")
    args.system_id = system_id_beside(args.config) or args.system_id
    return True


def system_id_beside(config: str) -> str:
    """The runner manager's system id from ``.runner_system_id`` beside the config file, when it
    holds one of the form ``s_`` or ``r_`` and 12 letters or digits (commands/internal/configfile
    system_id_state.go; otherwise gitlab-runner makes one up)."""
    try:
        with open(os.path.join(os.path.dirname(config) or ".", ".runner_system_id")) as fh:
            value = fh.read().strip()
    except OSError:
        return ""
    return value if re.fullmatch(r"[sr]_[0-9a-zA-Z]{12}", value) else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gitlab-runner")
    sub = parser.add_subparsers(dest="command", required=True)
    single = sub.add_parser("run-single", help="run one runner for a number of jobs, then exit")
    single.add_argument("--url", default=os.environ.get("CI_SERVER_URL", ""))
    single.add_argument("--token", default=os.environ.get("CI_SERVER_TOKEN", ""))
    single.add_argument("--executor", default=os.environ.get("RUNNER_EXECUTOR", "shell"))
    single.add_argument("--max-builds", type=int, default=0)
    single.add_argument("--wait-timeout", type=float, default=0)
    single.add_argument("--builds-dir", default=os.path.join(os.getcwd(), "builds"))
    single.add_argument("--cache-dir", default=os.path.join(os.getcwd(), "cache"))
    single.add_argument("--docker-image", default="")
    single.add_argument("--docker-network-mode", dest="network_mode", default="")
    single.add_argument("--name", default="")
    single.add_argument("-c", "--config", default=os.environ.get("CONFIG_FILE", ""))
    single.add_argument("-r", "--runner", default="", help="the runner of --config to run")
    args = parser.parse_args(argv)
    args.system_id = "s_" + secrets.token_hex(6)  # GenerateUniqueSystemID when none is kept
    if args.runner and not from_config(args):
        return 2
    if args.max_builds <= 0:
        args.max_builds = 1 << 30
    if args.wait_timeout <= 0:
        args.wait_timeout = float("inf")
    return run_single(args)


if __name__ == "__main__":
    sys.exit(main())
