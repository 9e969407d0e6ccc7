"""Job outputs and checkpoints: files that outlive the machine (real agent, fake Agent API)."""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import stat
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from catacloud.agent.client import Job
from catacloud.agent.files import (
    checkpoint_command,
    extract_archive,
    fingerprint,
    list_outputs,
    url_quote_name,
)
from tests.agent.fake_server import FakeAgentAPI, FakeIMDS
from tests.agent.harness import PY, AgentProcess, assert_no_secrets, outcome, values


def make_tar(files: dict[str, bytes], extra: Callable[[tarfile.TarFile], None] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
        if extra is not None:
            extra(tar)
    return buffer.getvalue()


def tar_files(data: bytes) -> dict[str, bytes]:
    """The regular files of a tar.gz, by member name."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        found = {}
        for member in tar.getmembers():
            assert not member.name.startswith("/") and ".." not in member.name.split("/")
            if member.isfile():
                extracted = tar.extractfile(member)
                assert extracted is not None
                found[member.name] = extracted.read()
        return found


def add_unsafe_members(tar: tarfile.TarFile) -> None:
    """``../evil.txt``, an absolute path (extracted relative to the directory, as ``tar`` does),
    a link out of the directory, a device."""
    for name in ("../evil.txt", "/tmp/catacloud-abs-evil-" + secrets.token_hex(4)):
        info = tarfile.TarInfo(name)
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    link = tarfile.TarInfo("escape")
    link.type, link.linkname = tarfile.SYMTYPE, "../../.."
    tar.addfile(link)
    device = tarfile.TarInfo("null")
    device.type, device.devmajor, device.devminor = tarfile.CHRTYPE, 1, 3
    tar.addfile(device)


# -- outputs ------------------------------------------------------------------------------------


def test_outputs_arrive_byte_for_byte_after_finished_then_uploads_done_releases_the_machine(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], work_dir: Path
) -> None:
    agent = start_agent()
    job = api.assign(
        'echo "out=$CATACLOUD_OUTPUT_DIR"; echo "ckpt=$CATACLOUD_CHECKPOINT_DIR";'
        ' mkdir -p "$CATACLOUD_OUTPUT_DIR/reports";'
        ' printf \'<testsuite tests="1"/>\\n\' > "$CATACLOUD_OUTPUT_DIR/reports/junit.xml";'
        ' head -c 3145728 /dev/urandom > "$CATACLOUD_OUTPUT_DIR/model.bin";'
        ' ln -s /etc/hostname "$CATACLOUD_OUTPUT_DIR/link"',  # symbolic links are not outputs
        job_id="outs",
    )

    done = api.wait_uploads_done(job)

    finished, finished_at = api.finished[job]
    assert outcome(finished) == {
        "exit_code": 0,
        "outcome": "succeeded",
        "reason": "exit code 0",
        "uploads_pending": 2,
        "code": "",  # no failure code: it succeeded
    }
    assert done == {"failed": []}
    output_dir, checkpoint_dir = work_dir / "outs-1" / "output", work_dir / "outs-1" / "checkpoint"
    assert values(api.output(job), "out") == [str(output_dir)]
    assert values(api.output(job), "ckpt") == [str(checkpoint_dir)]
    for folder in (output_dir, checkpoint_dir):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    expected = {
        "reports/junit.xml": (output_dir / "reports" / "junit.xml").read_bytes(),
        "model.bin": (output_dir / "model.bin").read_bytes(),
    }
    assert len(expected["model.bin"]) == 3 * 1024 * 1024
    assert api.artifacts[job] == expected
    puts = [r for r in api.requests if r.method == "PUT"]
    assert sorted(r.path for r in puts) == sorted(f"jobs/{job}/artifacts/{name}" for name in expected)
    for put in puts:
        assert put.headers["X-Checksum-Sha256"] == hashlib.sha256(put.body).hexdigest()
        assert put.headers["Content-Type"] == "application/octet-stream"
        assert int(put.headers["Content-Length"]) == len(put.body)
        assert put.headers["Authorization"] == f"Agent {api.agent_token}"
        assert put.at > finished_at, "the exit report never waits for uploads"
    done_at = api.uploads_done[job][1]
    assert done_at > max(put.at for put in puts)
    polls = [r.at for r in api.calls("GET", "work")]
    assert not [at for at in polls if finished_at < at < done_at], "no new work before uploads-done"
    api.wait_for(lambda: [at for at in api.calls("GET", "work") if at.at > done_at], what="polling again")
    assert_no_secrets(api, agent)


def test_a_short_jobs_output_comes_with_its_exit_report_unless_the_server_is_older(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], work_dir: Path
) -> None:
    start_agent()
    job = api.assign("echo one; echo two >&2; printf three", job_id="short")
    finished = api.wait_finished(job)
    assert sorted(c["seq"] for c in finished["output"]) == list(range(len(finished["output"])))
    assert (api.output(job, "stdout"), api.output(job, "stderr")) == ("one\nthree", "two\n")
    assert not api.calls("POST", f"jobs/{job}/logs"), "one request: the output and the end"
    # A job that runs a while ships its output as it comes; what is left goes with the report.
    longer = api.assign("echo early; until [ -e go ]; do sleep 0.05; done; echo late", job_id="longer")
    api.wait_output(longer, "early")  # shipped while it runs
    (work_dir / "longer-1" / "go").touch()
    finished = api.wait_finished(longer)
    assert api.output(longer) == "early\nlate\n"
    assert [c["data"] for c in finished["output"]] == ["late\n"]
    assert len(api.calls("POST", f"jobs/{longer}/logs")) == 1

    # A control plane that does not take output with the report gets it all in logs posts first.
    api.older = True
    older = api.assign("echo one; echo two >&2", job_id="older")
    assert api.wait_finished(older)["output"] == []
    assert (api.output(older, "stdout"), api.output(older, "stderr")) == ("one\n", "two\n")
    assert api.calls("POST", f"jobs/{older}/logs")


def test_a_job_without_outputs_posts_no_uploads_done_unless_the_server_awaits_it(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    start_agent()
    job = api.assign("echo nothing to keep", job_id="bare")
    finished = api.wait_done(job)  # its exit report, then the agent polls for the next job
    assert (finished["outcome"], finished["uploads_pending"]) == ("succeeded", 0)
    assert not api.calls("POST", f"jobs/{job}/uploads-done"), "finished released the machine"

    # A control plane from before the answer's awaits_uploads holds the machine until it.
    api.older = True
    older = api.assign("echo nothing to keep", job_id="older")
    assert api.wait_uploads_done(older) == {"failed": []}
    assert api.finished[older][0]["uploads_pending"] == 0


def test_a_503_or_a_checksum_mismatch_is_retried_and_the_file_arrives_once(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    start_agent()
    api.fail_next["jobs/flaky/artifacts/a.txt"] = 1
    api.answers["jobs/flaky/artifacts/b.txt"] = [(400, {"code": "checksum_mismatch"})]
    job = api.assign(
        'echo A > "$CATACLOUD_OUTPUT_DIR/a.txt"; echo B > "$CATACLOUD_OUTPUT_DIR/b.txt"', job_id="flaky"
    )

    assert api.wait_uploads_done(job) == {"failed": []}
    assert len(api.calls("PUT", "jobs/flaky/artifacts/a.txt")) == 2
    assert len(api.calls("PUT", "jobs/flaky/artifacts/b.txt")) == 2
    assert api.artifact_puts[job] == ["a.txt", "b.txt"], "each file stored once"
    assert api.artifacts[job] == {"a.txt": b"A\n", "b.txt": b"B\n"}


def test_failed_and_cancelled_jobs_upload_their_outputs_and_report_what_did_not_make_it(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    start_agent()
    broken = api.assign(
        'echo partial > "$CATACLOUD_OUTPUT_DIR/odd name #1%.txt";'
        ' truncate -s 5368709121 "$CATACLOUD_OUTPUT_DIR/huge.bin";'  # sparse: 5 GiB + 1 byte
        " exit 3",
        job_id="broken",
    )

    done = api.wait_uploads_done(broken)
    finished = api.finished[broken][0]
    assert (finished["outcome"], finished["exit_code"], finished["uploads_pending"]) == ("failed", 3, 2)
    assert api.artifacts[broken] == {"odd name #1%.txt": b"partial\n"}
    assert [
        put.raw_path.rsplit("/", 1)[1] for put in api.calls("PUT", "jobs/broken/artifacts/odd name #1%.txt")
    ] == ["odd%20name%20%231%25.txt"]
    assert [failure["name"] for failure in done["failed"]] == ["huge.bin"]
    assert "5 GiB" in done["failed"][0]["error"]
    assert not api.calls("PUT", "jobs/broken/artifacts/huge.bin"), "too large: never sent"

    # A 409 means the control plane takes no more outputs: the agent stops at once.
    api.answers["jobs/taken/artifacts/1.txt"] = [(409, {"code": "job_not_running"})]
    taken = api.assign(
        'for i in 1 2 3; do echo $i > "$CATACLOUD_OUTPUT_DIR/$i.txt"; done; echo ready; exec sleep 100',
        job_id="taken",
    )
    api.wait_output(taken, "ready")
    api.cancel(taken)
    done = api.wait_uploads_done(taken)
    finished = api.finished[taken][0]
    assert (finished["outcome"], finished["uploads_pending"]) == ("cancelled", 3)
    assert [r.path for r in api.requests if r.method == "PUT"][-1] == "jobs/taken/artifacts/1.txt"
    assert [failure["name"] for failure in done["failed"]] == ["1.txt", "2.txt", "3.txt"]


# -- checkpoints --------------------------------------------------------------------------------


def test_the_checkpoint_is_restored_safely_before_the_command_runs(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], work_dir: Path
) -> None:
    agent = start_agent()
    weights = os.urandom(100_000)
    api.served_checkpoints["resumed"] = make_tar(
        {"state/step.txt": b"41\n", "weights.bin": weights}, extra=add_unsafe_members
    )
    api.fail_next["jobs/resumed/checkpoint"] = 1  # the first GET fails: retried
    resumed = api.assign(
        'cd "$CATACLOUD_CHECKPOINT_DIR" && find . | sort | sed "s/^/seen=/";'
        ' echo "step=$(cat state/step.txt)"; echo "attempt=$CATACLOUD_ATTEMPT";'
        ' echo "weights=$(sha256sum < weights.bin | cut -c1-64)";'
        " echo evil=$(ls -A .. | grep -c evil)",  # the job's folder goes once it is reported
        job_id="resumed",
        attempt=2,
        checkpoint={"available": True, "interval_seconds": None},
    )
    fresh = api.assign(
        'ls -A "$CATACLOUD_CHECKPOINT_DIR" | wc -l | sed "s/ //g; s/^/count=/"',
        job_id="fresh",
        checkpoint={"available": True, "interval_seconds": None},
    )
    legacy = api.assign("echo old server", job_id="legacy")  # no "checkpoint" key at all

    assert api.wait_finished(resumed)["outcome"] == "succeeded"
    output = api.output(resumed)
    assert values(output, "step") == ["41"]
    assert values(output, "attempt") == ["2"]
    seen = [name for name in values(output, "seen") if not name.startswith("./tmp")]
    assert sorted(seen) == [".", "./state", "./state/step.txt", "./weights.bin"]
    assert values(output, "weights") == [hashlib.sha256(weights).hexdigest()]
    assert values(output, "evil") == ["0"], "../evil.txt was not extracted"
    assert not list(work_dir.rglob("evil.txt"))
    assert not list(Path("/tmp").glob("catacloud-abs-evil-*")), "the absolute path stayed inside"
    gets = api.calls("GET", "jobs/resumed/checkpoint")
    assert len(gets) == 2
    assert gets[-1].at < min(at for _, at in api.logs[resumed].values())
    assert "unsafe entries skipped" in agent.log()

    assert api.wait_finished(fresh)["outcome"] == "succeeded"
    assert values(api.output(fresh), "count") == ["0"], "404: nothing to restore"
    assert api.wait_finished(legacy)["outcome"] == "succeeded"
    assert not api.calls("GET", "jobs/legacy/checkpoint")
    assert not [r for r in api.requests if r.method == "PUT"], "a restored checkpoint is not re-sent"


def test_catacloud_checkpoint_inside_a_job_uploads_the_directory(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    start_agent()
    api.answers["jobs/ckpt/checkpoint"] = [None, (409, {"code": "job_not_running"})]
    job = api.assign(
        'C="$CATACLOUD_CHECKPOINT_DIR"; mkdir -p "$C/sub"; echo 7 > "$C/sub/step.txt";'
        ' head -c 200000 /dev/urandom > "$C/state.bin";'
        ' echo "sha=$(sha256sum < "$C/state.bin" | cut -c1-64)";'
        ' "$PY" -m catacloud.agent checkpoint; echo "ok=$?";'
        ' CATACLOUD_JOB_TOKEN=wrong "$PY" -m catacloud.agent checkpoint; echo "wrong=$?";'
        ' "$PY" -m catacloud.agent checkpoint; echo "refused=$?"',
        job_id="ckpt",
        env={"PY": PY},
        checkpoint={"available": False, "interval_seconds": None},
    )

    assert api.wait_finished(job, timeout=20)["outcome"] == "succeeded"
    output = api.output(job)
    assert (values(output, "ok"), values(output, "wrong"), values(output, "refused")) == (["0"], ["1"], ["1"])
    assert "checkpoint saved:" in api.output(job, "stdout")
    errors = api.output(job, "stderr")
    assert "CATACLOUD_JOB_TOKEN is missing, wrong" in errors
    assert "no longer this machine's" in errors
    puts = api.calls("PUT", "jobs/ckpt/checkpoint")
    assert len(puts) == 2
    assert puts[0].headers["Content-Type"] == "application/gzip"
    assert puts[0].headers["X-Checksum-Sha256"] == hashlib.sha256(puts[0].body).hexdigest()
    assert [data for data, _ in api.checkpoints[job]] == [puts[0].body]
    saved = tar_files(puts[0].body)  # the job's folder is gone once it is reported: its hash
    assert sorted(saved) == ["state.bin", "sub/step.txt"] and saved["sub/step.txt"] == b"7\n"
    assert len(saved["state.bin"]) == 200000
    assert values(output, "sha") == [hashlib.sha256(saved["state.bin"]).hexdigest()]


def test_checkpoints_are_saved_periodically_only_when_the_directory_changed(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess]
) -> None:
    start_agent()
    job = api.assign(
        'C="$CATACLOUD_CHECKPOINT_DIR";'  # each step replaces the file at once (mv)
        ' echo 1 > t; mv t "$C/step"; sleep 2.5; echo 2 > t; mv t "$C/step"; sleep 2.5',
        checkpoint={"available": False, "interval_seconds": 1},
    )

    _, finished_at = api.wait_finished(job, timeout=15), api.finished[job][1]
    saved = api.checkpoints[job]
    assert [tar_files(data) for data, _ in saved] == [{"step": b"1\n"}, {"step": b"2\n"}]
    assert all(at < finished_at for _, at in saved)


def test_a_spot_notice_saves_the_checkpoint_before_reporting_the_interruption(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], imds: FakeIMDS
) -> None:
    start_agent("--imds-url", imds.url)
    api.fail_next["jobs/spot/checkpoint"] = 1  # slows the save down: a retry
    job = api.assign(
        'echo 3 > "$CATACLOUD_CHECKPOINT_DIR/epoch"; echo ready; exec sleep 100',
        job_id="spot",
        checkpoint={"available": False, "interval_seconds": None},
    )
    api.wait_output(job, "ready")

    imds.notice = '{"action": "terminate", "time": "2030-01-01T00:00:00Z"}'
    api.wait_for(lambda: api.interruptions, timeout=10, what="the interruption report")

    assert len(api.calls("PUT", "jobs/spot/checkpoint")) == 2
    [(data, saved_at)] = api.checkpoints[job]
    assert tar_files(data) == {"epoch": b"3\n"}
    assert saved_at < api.calls("POST", "interruption")[0].at
    time.sleep(0.5)
    assert job not in api.finished, "an interrupted job is requeued, not reported ended"


def test_a_spot_notice_gives_the_job_sigterm_to_write_its_checkpoint_first(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], imds: FakeIMDS
) -> None:
    agent = start_agent("--imds-url", imds.url)
    job = api.assign(
        "trap 'echo 7 > \"$CATACLOUD_CHECKPOINT_DIR/epoch\"; echo saved on TERM; exit 0' TERM\n"
        "echo ready; while true; do sleep 0.1; done",
        job_id="told",
        checkpoint={"available": False, "interval_seconds": None},
    )
    api.wait_output(job, "ready")

    imds.notice = '{"action": "stop", "time": "2030-01-01T00:00:00Z"}'
    api.wait_for(lambda: api.interruptions, timeout=10, what="the interruption report")

    assert job in api.checkpoints, agent.log()
    [(data, saved_at)] = api.checkpoints[job]
    assert tar_files(data) == {"epoch": b"7\n"}, "what the job wrote on SIGTERM is what is saved"
    assert saved_at < api.calls("POST", "interruption")[0].at
    assert "saved on TERM" in api.output(job)
    assert api.interruptions == [{"kind": "spot", "detail": imds.notice}]
    time.sleep(0.5)
    assert job not in api.finished


def test_a_program_under_a_shell_list_is_told_and_the_shell_is_not(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], imds: FakeIMDS
) -> None:
    """``cd dir && python train.py``: the shell has no trap and would die of SIGTERM, ending the
    sandbox (and the program) at once; only the program, which handles it, is told, takes its
    second to save, and the job ends when it exits."""
    handler = (
        "import os, signal, sys, time\n"
        "def saved(*_):\n"
        "    time.sleep(1); open(os.environ['CATACLOUD_CHECKPOINT_DIR'] + '/epoch', 'w').write('9')\n"
        "    print('saved on TERM', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, saved); print('ready', flush=True)\n"
        "while True: time.sleep(0.1)\n"
    )
    start_agent("--imds-url", imds.url)
    job = api.assign(
        'cd "$CATACLOUD_CHECKPOINT_DIR" && "$PY" -c "$HANDLER"; echo "after, status $?"',
        job_id="listed",
        env={"PY": PY, "HANDLER": handler},
        checkpoint={"available": False, "interval_seconds": None},
    )
    api.wait_output(job, "ready")
    imds.notice = '{"action": "terminate", "time": "2030-01-01T00:00:00Z"}'
    api.wait_for(lambda: api.interruptions, timeout=15, what="the interruption report")
    [(data, _)] = api.checkpoints[job]
    assert tar_files(data) == {"epoch": b"9"}
    assert "saved on TERM" in api.output(job) and "after, status 0" in api.output(job)
    assert job not in api.finished


def test_a_notice_while_the_outcome_is_being_reported_is_still_reported(
    api: FakeAgentAPI, start_agent: Callable[..., AgentProcess], imds: FakeIMDS
) -> None:
    start_agent("--imds-url", imds.url)
    api.fail_next["jobs/late/finished"] = 4  # the outcome's report is retried for a while
    job = api.assign("echo done", job_id="late", checkpoint={"available": False, "interval_seconds": None})
    api.wait_for(lambda: api.calls("POST", "jobs/late/finished"), timeout=10, what="the first outcome report")
    imds.notice = '{"action": "terminate", "time": "2030-01-01T00:00:00Z"}'
    api.wait_for(lambda: api.interruptions, timeout=15, what="the interruption report")
    assert api.wait_finished(job, timeout=10)["outcome"] == "succeeded"


# -- in-process units ---------------------------------------------------------------------------


def test_extraction_skips_unsafe_members(tmp_path: Path) -> None:
    archive = tmp_path / "checkpoint.tar.gz"
    archive.write_bytes(make_tar({"ok/file.txt": b"fine"}, extra=add_unsafe_members))
    target = tmp_path / "a" / "checkpoint"
    target.mkdir(parents=True)

    skipped = extract_archive(str(archive), str(target))

    assert (target / "ok" / "file.txt").read_bytes() == b"fine"
    assert sorted(p.name for p in target.iterdir()) == ["ok", "tmp"]
    assert [p.parent for p in target.glob("tmp/catacloud-abs-evil-*")] == [target / "tmp"]
    assert not (tmp_path / "a" / "evil.txt").exists()
    assert sorted(skipped) == ["../evil.txt", "escape", "null"]


def test_output_listing_naming_and_fingerprints(tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "x y.txt").write_text("1")
    (tmp_path / "top").write_text("2")
    (tmp_path / "link").symlink_to(tmp_path / "top")
    (tmp_path / "dirlink").symlink_to(tmp_path / "d")
    before = fingerprint(str(tmp_path))

    assert [o.name for o in list_outputs(str(tmp_path))] == ["d/e/x y.txt", "top"]
    assert url_quote_name("d/e/x y#?.txt") == "d/e/x%20y%23%3F.txt"
    assert fingerprint(str(tmp_path)) == before
    (tmp_path / "top").write_text("22")
    assert fingerprint(str(tmp_path)) != before
    assert Job.from_json({"id": "j", "command": "true"}).checkpoint.available is False
    job = Job.from_json(
        {"id": "j", "command": "x", "checkpoint": {"available": True, "interval_seconds": 30}}
    )
    assert (job.checkpoint.available, job.checkpoint.interval_seconds) == (True, 30)


def test_catacloud_checkpoint_outside_a_job_fails_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    assert checkpoint_command(environ={}) == 1
    assert "run this inside a Catacloud job" in capsys.readouterr().err
