"""Secret masking for a job's output and for names it chooses (best effort; SECURITY.md).

A job's secret env values must not reach the people who read its log but may not read its env
(viewers, job-scoped tokens). The job itself has the values and can print them however it
likes: masking catches what a job prints by accident or by habit, not a job set on leaking.

What counts as the value, for each secret of at least ``MIN_MASKED`` characters:

- the value itself, **in any letter case**;
- its **reverse** (``rev``), its **hex** (``xxd -p``, ``od -tx1``), its **base64** (standard and
  URL alphabets, at each of the three alignments it can have inside a longer base64 text)
  and its **URL encoding** (``%40`` …), each also in any case;
- with **whitespace and terminal control sequences anywhere inside** (``fold -w 3``, spaced
  letters, a colour code in the middle, ``\\r``): matching ignores spaces, tabs, line breaks,
  other control characters and ANSI/VT escape sequences (CSI, OSC, two-byte escapes), and the
  whole stretch the value spans, escapes included, becomes ``***``;
- **across stdout and stderr**: both streams are masked as one sequence in the order the agent
  reads them (the order viewers read the log in), so a value written half to each is caught.

To catch a value written in pieces, the agent holds back the end of the output that could be
the start of one (at most the longest form, less one visible character, plus the whitespace
and escapes around it) until more output comes or the job's output ends. Forms derived from a
value (hex, base64, …) shorter than ``MIN_DERIVED`` characters are not looked for: they would
mask ordinary text.

No Django here: the agent (``catacloud/agent``) and the server (artifact names) both use it.
"""

from __future__ import annotations

import base64
import re
import threading
import time
from collections.abc import Callable, Iterable
from urllib.parse import quote, quote_plus

MASK = b"***"
MIN_MASKED = 3  # shorter values would mask ordinary output everywhere
MIN_DERIVED = 6  # a hex / base64 / reversed form shorter than this is not looked for
# Held back output beyond this (a flood of whitespace after the start of a value) is let go.
MAX_HOLD_BYTES = 64 * 1024
# ... and so is output held back longer than this while the job keeps writing (only the end of
# a stream that fell silent waits, until the job writes again or ends).
MAX_HOLD_SECONDS = 5.0

# What matching skips: ANSI/VT escape sequences (CSI with parameters, OSC up to BEL or ST,
# two-byte escapes) and every control or whitespace byte.
_SKIP = re.compile(
    rb"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves
    rb"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC: titles, hyperlinks
    rb"|\x1b[@-Z\\-_]"  # two-byte escapes
    rb"|[\x00-\x20\x7f]"  # control characters and whitespace
)
_SPACE = re.compile(rb"[\x00-\x20\x7f]")


def _b64_forms(raw: bytes) -> set[bytes]:
    """The base64 text that encodes ``raw`` wherever it sits in a longer input: for each of
    the three alignments, the characters that depend on ``raw`` alone."""
    forms = set()
    for shift in range(3):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            text = encode(b"\0" * shift + raw)
            start = -(-4 * shift // 3)  # ceil(4 * shift / 3)
            end = 4 * (shift + len(raw)) // 3
            forms.add(text[start:end])
    return forms


def secret_forms(values: Iterable[str]) -> list[bytes]:
    """Every form looked for, lower-cased and without whitespace, longest first."""
    forms: set[bytes] = set()
    for value in values:
        if len(value) < MIN_MASKED:
            continue
        raw = value.encode()
        plain = _SPACE.sub(b"", raw).lower()
        if len(plain) >= MIN_MASKED:
            forms.add(plain)
        derived = {raw[::-1], raw.hex().encode(), quote(value, safe="").encode(), quote_plus(value).encode()}
        derived |= _b64_forms(raw)
        forms |= {f.lower() for f in (_SPACE.sub(b"", d) for d in derived) if len(f) >= MIN_DERIVED}
    return sorted(forms, key=len, reverse=True)


class Redactor:
    """Finds and masks the secret forms in bytes (see the module's docstring)."""

    def __init__(self, values: Iterable[str]) -> None:
        self.forms = secret_forms(values)
        self.longest = len(self.forms[0]) if self.forms else 0

    def __bool__(self) -> bool:
        return bool(self.forms)

    @staticmethod
    def visible(data: bytes) -> tuple[bytes, list[int]]:
        """``data`` lower-cased without what matching skips, and where each byte came from."""
        kept: list[bytes] = []
        where: list[int] = []
        pos = 0
        for skip in _SKIP.finditer(data):
            if skip.start() > pos:
                kept.append(data[pos : skip.start()])
                where.extend(range(pos, skip.start()))
            pos = skip.end()
        if pos < len(data):
            kept.append(data[pos:])
            where.extend(range(pos, len(data)))
        return b"".join(kept).lower(), where

    def spans(self, data: bytes) -> tuple[list[tuple[int, int]], bytes, list[int]]:
        """Where the forms are in ``data``: merged ``(start, end)`` spans of ``data``; also the
        visible text and its map (for callers that hold back a tail)."""
        view, where = self.visible(data)
        found: list[tuple[int, int]] = []
        for form in self.forms:
            start = view.find(form)
            while start != -1:
                found.append((where[start], where[start + len(form) - 1] + 1))
                start = view.find(form, start + 1)
        found.sort()
        merged: list[tuple[int, int]] = []
        for start, end in found:
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged, view, where

    def mask(self, data: bytes) -> bytes:
        if not self.forms:
            return data
        spans, _, _ = self.spans(data)
        return _apply(data, spans, 0, len(data))


def _apply(data: bytes, spans: list[tuple[int, int]], lo: int, hi: int) -> bytes:
    """``data[lo:hi]`` with each span that starts in it replaced by MASK and every masked byte
    removed (a span that started earlier only removes)."""
    out: list[bytes] = []
    pos = lo
    for start, end in spans:
        if end <= lo or start >= hi:
            continue
        if start > pos:
            out.append(data[pos:start])
        if start >= lo:
            out.append(MASK)
        pos = max(pos, min(end, hi))
    if pos < hi:
        out.append(data[pos:hi])
    return b"".join(out)


def mask_text(text: str, values: Iterable[str]) -> str:
    """``text`` with the secret forms of ``values`` masked (names a job chose, messages)."""
    redactor = Redactor(values)
    if not redactor:
        return text
    return redactor.mask(text.encode()).decode(errors="replace")


class OutputMasker:
    """A job's streams masked as one sequence in the order they are read, and each stream on
    its own (the two pipes race: a value written to stdout in two pieces may reach the agent
    with a stderr line between them).

    ``feed(stream, data)`` and ``end(stream)`` come from each stream's reader thread; masked
    output goes to ``emit(stream, data)`` in the same order, and ``close(stream)`` is called for
    every stream once all of them ended (after the held back rest is emitted)."""

    def __init__(
        self,
        values: Iterable[str],
        emit: Callable[[str, bytes], None],
        close: Callable[[str], None],
        streams: Iterable[str] = ("stdout", "stderr"),
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redactor = Redactor(values)
        self.hold = max(0, self.redactor.longest - 1)
        self._emit, self._close, self._clock = emit, close, clock
        self._open = set(streams)
        self._ended: list[str] = []
        self._held: list[tuple[str, bytes, float]] = []  # raw pieces not emitted yet, in order
        self._lock = threading.Lock()

    def feed(self, stream: str, data: bytes) -> None:
        with self._lock:
            if not self.redactor:
                self._emit(stream, data)
                return
            self._held.append((stream, data, self._clock()))
            self._release(final=False)

    def end(self, stream: str) -> None:
        with self._lock:
            self._open.discard(stream)
            self._ended.append(stream)
            if self._open:
                return
            if self._held:
                self._release(final=True)
            for name in self._ended:
                self._close(name)

    def _release(self, *, final: bool) -> None:
        """Emit what no secret can still be completed into; keep the rest (caller holds the lock)."""
        data = b"".join(piece for _, piece, _ in self._held)
        drop = bytearray(len(data))
        matches: list[tuple[int, int]] = []  # (first, last) combined index of each match

        def mark(ranges: list[tuple[int, int]]) -> None:
            for lo, hi in ranges:
                drop[lo:hi] = b"\x01" * (hi - lo)
            matches.append((ranges[0][0], ranges[-1][1] - 1))

        spans, view, where = self.redactor.spans(data)
        for start, end in spans:
            mark([(start, end)])
        cut = len(data)
        if not final:
            cut = where[len(view) - self.hold] if len(view) > self.hold else 0
        # each stream on its own: local spans mapped onto the pieces they cover
        pos = 0
        layout: dict[str, list[tuple[int, int, int]]] = {}  # stream -> (local, combined, length)
        for stream, piece, _ in self._held:
            pieces = layout.setdefault(stream, [])
            local = pieces[-1][0] + pieces[-1][2] if pieces else 0
            pieces.append((local, pos, len(piece)))
            pos += len(piece)
        for stream, pieces in layout.items():
            own = b"".join(data[c : c + n] for _, c, n in pieces)
            own_spans, own_view, own_where = self.redactor.spans(own)
            for start, end in own_spans:
                mark(_to_combined(pieces, start, end))
            if not final and stream in self._open and len(own_view) > 0:
                held_from = own_where[len(own_view) - self.hold] if len(own_view) > self.hold else 0
                cut = min(cut, _to_combined(pieces, held_from, held_from + 1)[0][0])
        for first, last in sorted(matches):  # a complete match across the cut goes out whole
            if first < cut <= last:
                cut = last + 1
        oldest = self._held[0][2]
        if not final and (len(data) > MAX_HOLD_BYTES or self._clock() - oldest > MAX_HOLD_SECONDS):
            cut = len(data)  # best effort: do not hold output back for ever
        if cut == 0:
            return
        pos, kept = 0, []
        masking: dict[str, bool] = {}
        for stream, piece, at in self._held:
            lo, hi = pos, pos + len(piece)
            pos = hi
            if lo < cut:
                out, masking[stream] = _masked(data, drop, lo, min(hi, cut), masking.get(stream, False))
                if out:
                    self._emit(stream, out)
            if hi > cut:
                kept.append((stream, piece[max(0, cut - lo) :], at))
        self._held = kept


def _to_combined(pieces: list[tuple[int, int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """A stream's local range [start, end) as ranges of the combined data."""
    out = []
    for local, combined, length in pieces:
        lo, hi = max(start, local), min(end, local + length)
        if lo < hi:
            out.append((combined + lo - local, combined + hi - local))
    return out


def _masked(data: bytes, drop: bytearray, lo: int, hi: int, masking: bool) -> tuple[bytes, bool]:
    """``data[lo:hi]`` without its dropped bytes, MASK where a dropped run starts (``masking``:
    the stream's previous byte was dropped, so a run going on gets no second MASK)."""
    out: list[bytes] = []
    i = lo
    while i < hi:
        j = drop.find(1, i, hi)
        if j == -1:
            out.append(data[i:hi])
            return b"".join(out), False
        if j > i:
            out.append(data[i:j])
            masking = False
        if not masking:
            out.append(MASK)
            masking = True
        k = drop.find(0, j, hi)
        if k == -1:
            return b"".join(out), True
        i = k
    return b"".join(out), masking
