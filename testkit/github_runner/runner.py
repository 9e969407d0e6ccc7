"""A stand-in for GitHub's actions/runner, for the fake GitHub (testkit/github_fake.py).

Standard library only (it runs inside a job, which sees the venv's python3 and its own work
folder, not the project checkout). Like the real runner in just-in-time mode: it takes its
configuration from ``--jitconfig`` (or ``ACTIONS_RUNNER_INPUT_JITCONFIG``, then removed from its
environment as the real one does), connects, waits for one job, runs its steps as shell commands
in ``_work`` under the current folder, reports the result and exits 0. The configuration may ask
it to misbehave: ``crash`` (exit 134 right after taking a job), ``hang`` (take a job and never
report), ``never_connect`` (never go online).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any


def say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def call(
    config: dict[str, Any], method: str, path: str, body: Any = None, timeout: float = 40
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        config["url"] + path,
        data=data,
        method=method,
        headers={"Authorization": f"RunnerSecret {config['secret']}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None


def run_steps(job: dict[str, Any]) -> str:
    work = os.path.join(os.getcwd(), "_work", str(job["id"]))
    os.makedirs(work, exist_ok=True)
    if job.get("container") or job.get("services"):
        return run_in_containers(job, work)
    for number, step in enumerate(job.get("steps") or [], start=1):
        say(f"step {number}: {step}")
        code = subprocess.call(["/bin/sh", "-c", step], cwd=work)
        if code != 0:
            say(f"step {number} failed with exit code {code}")
            return "failure"
    return "success"


class DockerFailed(Exception):
    pass


def docker(*args: str) -> str:
    """One ``docker`` command, as the real runner runs them (src/Runner.Worker/Container/
    DockerCommandManager.cs: the docker CLI, never the API directly); its output, stripped."""
    done = subprocess.run(["docker", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise DockerFailed(f"docker {args[0]} failed with exit code {done.returncode}: {done.stderr.strip()}")
    return done.stdout.strip()


def run_in_containers(job: dict[str, Any], work: str) -> str:
    """A job with ``container:`` (and ``services:``), as actions/runner runs it
    (src/Runner.Worker/ContainerOperationProvider.cs): a network of the job's own
    (``docker network create github_network_<guid>``); each service pulled, created on it with its
    name as network alias, started; the job container pulled, created on it with the work folder
    mounted at ``/__w`` and ``tail -f /dev/null`` as its entrypoint, started; each step run in it
    with ``docker exec``; at the end every container removed (``docker rm --force``) and the
    network too. The real runner also runs services without a job container (reached through
    published ``ports:``); this stand-in does not."""
    if not job.get("container"):
        say("services without a job container need ports: mappings, which this stand-in does not do")
        return "failure"
    guid = secrets.token_hex(16)
    network, label = f"github_network_{guid}", f"catacloud-standin-{guid[:8]}"
    made: list[str] = []
    try:
        say("Create local container network")
        docker("network", "create", "--label", label, network)
        for name, image in (job.get("services") or {}).items():
            say(f"Starting service container {name} ({image})")
            docker("pull", image)
            made.append(
                docker(
                    "create",
                    "--name",
                    f"{name}_{guid[:6]}",
                    "--label",
                    label,
                    "--network",
                    network,
                    "--network-alias",
                    name,
                    image,
                )
            )
            docker("start", made[-1])
        image = job["container"]
        say(f"Starting job container ({image})")
        docker("pull", image)
        made.append(
            docker(
                "create",
                "--name",
                f"{guid}_job",
                "--label",
                label,
                "--workdir",
                "/__w",
                "--network",
                network,
                "-v",
                f"{work}:/__w",
                "--entrypoint",
                "tail",
                image,
                "-f",
                "/dev/null",
            )
        )
        docker("start", made[-1])
        for number, step in enumerate(job.get("steps") or [], start=1):
            say(f"step {number}: {step}")
            code = subprocess.call(
                ["docker", "exec", "-i", "--workdir", "/__w", made[-1], "sh", "-e", "-c", step]
            )
            if code != 0:
                say(f"step {number} failed with exit code {code}")
                return "failure"
        return "success"
    except DockerFailed as exc:
        say(f"##[error]{exc}")
        return "failure"
    finally:
        say("Stop and remove the containers, remove the network")
        for container in made:
            subprocess.run(["docker", "rm", "--force", container], capture_output=True)
        subprocess.run(["docker", "network", "rm", network], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run.sh")
    parser.add_argument("--jitconfig", default=os.environ.get("ACTIONS_RUNNER_INPUT_JITCONFIG", ""))
    args = parser.parse_args(argv)
    # Like the real runner (src/Runner.Listener/CommandSettings.cs): every ACTIONS_RUNNER_INPUT_*
    # is read, then removed from its environment, so the job's steps do not inherit it.
    for name in [n for n in os.environ if n.upper().startswith("ACTIONS_RUNNER_INPUT_")]:
        del os.environ[name]
    if not args.jitconfig:
        say("no --jitconfig given (nor ACTIONS_RUNNER_INPUT_JITCONFIG)")
        return 2
    config = json.loads(base64.b64decode(args.jitconfig))
    fault = config.get("fault")
    if fault == "never_connect":
        say("configured never to connect; waiting")
        while True:
            time.sleep(3600)
    for attempt in range(30):
        try:
            status, answer = call(config, "POST", f"/_runner/{config['runner_id']}/session", {})
        except OSError as exc:
            say(f"cannot reach GitHub ({exc}); retrying")
            time.sleep(min(5, 0.5 * (attempt + 1)))
            continue
        if status == 200:
            break
        if (answer or {}).get("errorKind") == "RunnerVersionTooOld":
            # Runner.Listener Program.cs: AccessDeniedException ErrorCode 1 -> 7 when
            # ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE is true, else 1 (terminated)
            say(f"An error occurred: {answer.get('message')}")
            deprecated = os.environ.get("ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE", "")
            return 7 if deprecated.lower() in ("1", "true") else 1
        say(f"session refused (HTTP {status}): the registration was removed")
        return 1
    else:
        return 1
    say(f"Connected to GitHub as {config['name']}; listening for jobs")
    while True:
        try:
            status, body = call(config, "GET", f"/_runner/{config['runner_id']}/job?wait=20")
        except OSError as exc:
            say(f"poll failed ({exc}); retrying")
            time.sleep(1)
            continue
        if status == 200 and body and body.get("job"):
            job = body["job"]
            break
        if status == 404:
            say("this runner was removed; exiting")
            return 0
    say(f"Running job: {job['name']} ({job['repository']})")
    if fault == "crash":
        say("crashing as configured")
        os._exit(134)  # run.sh: an unknown code, so it ends with 0 (a crash is silent there too)
    if fault == "hang":
        say("hanging as configured")
        while True:
            time.sleep(3600)
    conclusion = run_steps(job)
    for _ in range(10):
        try:
            status, _ = call(
                config,
                "POST",
                f"/_runner/{config['runner_id']}/jobs/{job['id']}/complete",
                {"conclusion": conclusion},
            )
            break
        except OSError:
            time.sleep(1)
    say(f"Job {job['name']} completed with result: {conclusion}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
