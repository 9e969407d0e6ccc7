"""A CI runner takes exactly one job, end to end: the stand-in gitlab-runner (shell executor,
which gives a job's script the runner's whole environment, as the real one does) on a local
machine's sandbox, the fake GitLab (which, like GitLab, hands a job to whoever asks with a live
runner token), a real worker.

- A CI job that looks for its runner's ``glrt-`` token everywhere it can read (its environment,
  every process's environment, command line and open files in ``/proc``, the files of ``/run``,
  ``/tmp``, its work folder) finds none, so another pending job of its project is never handed
  to it: it runs on a runner of its own.
- The runner is deleted at GitLab while its job still runs, and that job goes on to succeed.
"""

from __future__ import annotations

import re

import pytest

from apps.jobs.choices import JOB_LIVE
from apps.jobs.models import Job, JobLogChunk
from tests.e2e.test_gitlab_ci import TAGS, GitLabStack, gitlab  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# The CI job's script: look for a runner token wherever this job can read, then (a test control of
# the fake) queue another job of this project with this runner's tags and ask GitLab for a job
# with every token found. It prints where it found tokens, never a token (the agent would mask it).
PROBE = r"""python3 - <<'EOF'
import glob, json, os, re, stat, urllib.error, urllib.request
pattern, found = re.compile(rb"glrt-[A-Za-z0-9_.-]{8,}"), {}
def scan(where, data):
    for token in pattern.findall(data):
        found.setdefault(token.decode(), where)
def read(path):
    try:
        if stat.S_ISREG(os.stat(path).st_mode):
            with open(path, "rb") as fh:
                scan(path, fh.read(1 << 22))
    except OSError:
        pass
scan("env", "\n".join(f"{k}={v}" for k, v in os.environ.items()).encode())
for path in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
    try:
        with open(path, "rb") as fh:
            scan(path, fh.read())
    except OSError:
        pass
for path in glob.glob("/proc/[0-9]*/fd/*"):
    read(path)
for top in {"/run", "/tmp", "/var/tmp", "/dev/shm", os.environ.get("CATACLOUD_WORK_DIR", "/tmp")}:
    for root, _, files in os.walk(top):
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                read(os.path.join(root, name))
print(f"runner tokens found: {len(found)} in {sorted(set(found.values()))}", flush=True)
url = os.environ["CI_SERVER_URL"]
def post(path, body):
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
tags = json.loads(os.environ["CI_RUNNER_TAGS"])
status, other = post("/_fake/jobs", {"project": os.environ["CI_PROJECT_PATH"], "tags": tags, "name": "other"})
print(f"queued another job: {other['id']}", flush=True)
for token in found:
    status, job = post("/api/v4/jobs/request", {"token": token})
    print(f"asked for a job with the token found in {found[token]}: HTTP {status}", flush=True)
EOF"""


def _log(job_id: object) -> str:
    return "".join(JobLogChunk.objects.filter(job_id=job_id).values_list("data", flat=True))


def test_a_ci_job_finds_no_runner_token_and_takes_no_second_job(gitlab: GitLabStack) -> None:  # noqa: F811
    from apps.gitlab.models import GitLabRunner

    fake, stack = gitlab.fake, gitlab.stack
    first = fake.queue_job("acme/app", TAGS, [PROBE], name="probe")
    stack.wait(lambda: not fake.unfinished([first]), 120, "the probing CI job to finish")
    assert fake.job(first).status == "success"
    ours = GitLabRunner.objects.get(gitlab_runner_id=fake.job(first).runner_id)
    live = Job.objects.filter(pk=ours.job_id, status__in=JOB_LIVE)
    stack.wait(lambda: not live.exists(), 60, "its runner job to end (its output all in)")
    text = _log(ours.job_id)
    assert "runner tokens found: 0 in []" in text, re.findall(r"runner tokens found.*", text)
    other = int(re.findall(r"queued another job: (\d+)", text)[0])
    # the other job runs, on a runner of its own: never on the probing job's
    stack.wait(lambda: not fake.unfinished([other]), 120, "the other CI job to finish")
    assert fake.job(other).status == "success"
    assert fake.job(other).runner_id not in (None, fake.job(first).runner_id)
    assert not re.findall(r"asked for a job with the token found in .*: HTTP \d+", text)


def test_the_runner_is_deleted_at_gitlab_while_its_job_runs_and_the_job_succeeds(
    gitlab: GitLabStack,  # noqa: F811
) -> None:
    fake, stack = gitlab.fake, gitlab.stack
    job = fake.queue_job("acme/app", TAGS, ["sleep 15", "echo done"], name="long")
    stack.wait(lambda: fake.job(job).status == "running", 90, "the CI job to start")
    runner_id = fake.job(job).runner_id
    assert runner_id is not None
    stack.wait(lambda: runner_id not in fake.runners, 12, "its runner to be deleted at GitLab")
    assert fake.job(job).status == "running"  # GitLab lets the running job go on without it
    stack.wait(lambda: not fake.unfinished([job]), 60, "the CI job to finish")
    assert fake.job(job).status == "success"
