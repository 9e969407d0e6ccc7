"""The masker on its own (catacloud/agent/masking.py): what it holds back and for how long."""

from __future__ import annotations

from catacloud.agent.masking import MAX_HOLD_SECONDS, OutputMasker, mask_text

SECRET = "cfg-s3cret-value-1234"


class Out:
    def __init__(self) -> None:
        self.chunks: list[tuple[str, bytes]] = []
        self.closed: list[str] = []
        self.now = 0.0

    def text(self, stream: str | None = None) -> str:
        return b"".join(d for s, d in self.chunks if stream in (None, s)).decode()

    def masker(self, values: list[str]) -> OutputMasker:
        return OutputMasker(
            values, lambda s, d: self.chunks.append((s, d)), self.closed.append, clock=lambda: self.now
        )


def test_without_secrets_output_passes_at_once() -> None:
    out = Out()
    m = out.masker([])
    m.feed("stdout", b"cfg-s3")
    assert out.text() == "cfg-s3"


def test_a_value_split_over_both_streams_with_a_colour_inside_is_one_mask() -> None:
    out = Out()
    m = out.masker([SECRET])
    m.feed("stdout", b"key=" + SECRET[:6].encode() + b"\x1b[1m")
    m.feed("stderr", SECRET[6:].encode() + b"\n")
    assert SECRET[:6] not in out.text()  # the start waits: it may be a value's
    m.end("stdout")
    m.end("stderr")
    assert out.text("stdout") == "key=***" and out.text("stderr") == "***\n"
    assert out.closed == ["stdout", "stderr"]


def test_the_end_of_a_silent_stream_waits_only_while_the_job_writes_elsewhere() -> None:
    """A tail that could start a value is held; another stream's output keeps flowing after it
    only once the hold has lasted MAX_HOLD_SECONDS (best effort, never for ever)."""
    out = Out()
    m = out.masker([SECRET])
    m.feed("stdout", b"progress 50% cfg")
    m.feed("stderr", b"warning\n")
    assert "warning" not in out.text()  # order kept: it waits behind the held tail
    out.now = MAX_HOLD_SECONDS + 1
    m.feed("stderr", b"more\n")
    assert out.text() == "progress 50% cfgwarning\nmore\n"


def test_names_are_masked_in_every_form() -> None:
    assert mask_text(f"out/{SECRET.upper()}.txt", [SECRET]) == "out/***.txt"
    assert mask_text(f"{SECRET.encode().hex()}.bin", [SECRET]) == "***.bin"
    assert mask_text("report.txt", [SECRET, "ab"]) == "report.txt"  # a 2-character value is not masked
