"""Reading trace files (DESIGN §4 "Trace files").

The format is detected from the file's first non-blank line, not its extension:

- Azure LLM inference CSV, header ``TIMESTAMP,ContextTokens,GeneratedTokens``, with
  wall-clock timestamps such as ``2023-11-16 18:15:46.6805900``;
- Mooncake JSONL, one object per line with ``timestamp`` (milliseconds),
  ``input_length`` and ``output_length`` (other keys are ignored);
- generic CSV, header ``timestamp_s,prompt_tokens,output_tokens``;
- length-only CSV (the ShareGPT and arXiv files of Sarathi-Serve and Vidur), header
  ``num_prefill_tokens,num_decode_tokens,...``: lengths without arrival times, so
  only ``load_lengths`` accepts it.

Rules common to every format: blank lines are skipped; every length is an integer
>= 1 (a zero length is malformed: none of the bundled traces has one, and a
request that reads or writes no token has no prefill or decode to model); arrival
times are re-based so that the earliest request arrives at 0 and requests are
stably sorted by arrival. Any malformed line raises ``TraceError`` naming the file,
the 1-based line number, the field and the offending value.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np

from sim.lengths import LengthSamples
from sim.trace import FloatArray, IntArray, Trace, TraceError

__all__ = [
    "LengthSamples",
    "TraceFormat",
    "detect_format",
    "load_lengths",
    "load_trace",
]


class TraceFormat(Enum):
    """The trace formats this module reads."""

    AZURE_CSV = "azure_csv"
    MOONCAKE_JSONL = "mooncake_jsonl"
    GENERIC_CSV = "generic_csv"
    LENGTHS_CSV = "lengths_csv"

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]

    @property
    def has_arrival_times(self) -> bool:
        return self is not TraceFormat.LENGTHS_CSV


_DESCRIPTIONS = {
    TraceFormat.AZURE_CSV: (
        "Azure LLM inference CSV (header TIMESTAMP,ContextTokens,GeneratedTokens)"
    ),
    TraceFormat.MOONCAKE_JSONL: (
        "Mooncake JSONL (one object per line with timestamp [ms], input_length, output_length)"
    ),
    TraceFormat.GENERIC_CSV: "generic CSV (header timestamp_s,prompt_tokens,output_tokens)",
    TraceFormat.LENGTHS_CSV: (
        "length-only CSV (header num_prefill_tokens,num_decode_tokens,...; load_lengths only)"
    ),
}

_AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_GENERIC_HEADER = ("timestamp_s", "prompt_tokens", "output_tokens")
# Only the first two columns of a length-only file are read; the rest
# (num_total_tokens, pd_ratio in the bundled files) are derived from them.
_LENGTHS_HEADER_PREFIX = ("num_prefill_tokens", "num_decode_tokens")
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")

# A wall-clock time as the Azure traces write it: a date, a space or "T", a time,
# any number of fractional digits (the 2023 files have 7, more than
# datetime.fromisoformat accepts before Python 3.11), and an optional UTC offset.
_AZURE_TIME = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?(Z|[+-]\d{2}:?\d{2})?",
    re.ASCII,
)

_NS_PER_S = 1_000_000_000


def _accepted_formats() -> str:
    return "; ".join(f.description for f in TraceFormat)


@dataclass(frozen=True, kw_only=True, eq=False)
class _Columns:
    """What a file holds, in file order. ``arrival_s`` is None for length-only files."""

    arrival_s: FloatArray | None
    prompt_tokens: IntArray
    output_tokens: IntArray


def detect_format(path: str | Path) -> TraceFormat:
    """The format of the trace file at ``path``, from its first non-blank line.

    Raises ``TraceError`` naming the file and listing the accepted formats when the
    file is empty or its first line matches none of them; ``OSError`` when the file
    cannot be read.
    """
    path = Path(path)
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _decode(raw, path, number).strip()
            if line:
                return _detect_line(line, path)
    raise TraceError(f"{path}: empty file; accepted formats: {_accepted_formats()}")


def load_trace(path: str | Path, *, speedup: float = 1.0) -> Trace:
    """Requests of the trace file at ``path``, sorted by arrival, the first at 0 s.

    ``speedup`` compresses time: every arrival time is divided by it (2.0 replays
    the trace twice as fast, at twice the rate). Raises ``TraceError`` for a
    malformed, empty, unknown or length-only file (the message names the file and
    line), ``ValueError`` for a ``speedup`` that is not a finite number > 0.
    """
    if not (isinstance(speedup, int | float) and math.isfinite(speedup) and speedup > 0):
        raise ValueError(f"speedup: expected a finite number > 0, got {speedup!r}")
    path = Path(path)
    fmt, columns = _read(path)
    if columns.arrival_s is None:
        raise TraceError(
            f"{path}: a {fmt.description} has no arrival times; read it with "
            "load_lengths() and give it arrivals with sim.workload.synthesize()"
        )
    # Stable, so that requests logged at the same instant keep their file order.
    order = np.argsort(columns.arrival_s, kind="stable")
    arrival_s = columns.arrival_s[order]
    arrival_s = (arrival_s - arrival_s[0]) / float(speedup)
    source = path.name if speedup == 1 else f"{path.name} (speedup x{speedup:g})"
    return Trace(
        arrival_s=arrival_s,
        prompt_tokens=columns.prompt_tokens[order],
        output_tokens=columns.output_tokens[order],
        source=source,
    )


def load_lengths(path: str | Path) -> LengthSamples:
    """The (prompt, output) lengths of every request in the file at ``path``.

    Accepts every trace format and the length-only CSVs; rows stay in file order.
    Raises ``TraceError`` as ``load_trace`` does (a time-stamped file's timestamps
    are checked too).
    """
    path = Path(path)
    _, columns = _read(path)
    return LengthSamples(
        prompt_tokens=columns.prompt_tokens,
        output_tokens=columns.output_tokens,
        source=path.name,
    )


# --- detection -----------------------------------------------------------------------


def _detect_line(line: str, path: Path) -> TraceFormat:
    if line.startswith("{"):
        try:
            first = json.loads(line)
        except json.JSONDecodeError:
            first = None
        if isinstance(first, dict) and all(key in first for key in _MOONCAKE_KEYS):
            return TraceFormat.MOONCAKE_JSONL
    else:
        header = tuple(name.strip() for name in line.split(","))
        if header == _AZURE_HEADER:
            return TraceFormat.AZURE_CSV
        if header == _GENERIC_HEADER:
            return TraceFormat.GENERIC_CSV
        if header[: len(_LENGTHS_HEADER_PREFIX)] == _LENGTHS_HEADER_PREFIX:
            return TraceFormat.LENGTHS_CSV
    shown = line if len(line) <= 80 else line[:77] + "..."
    raise TraceError(
        f"{path}:1: unknown trace format (first line {shown!r}); "
        f"accepted formats: {_accepted_formats()}"
    )


def _decode(raw: bytes, path: Path, number: int) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}:{number}: not UTF-8 text ({exc.reason})") from None
    # A byte-order mark is what some spreadsheet programs put before the header.
    return text.removeprefix("\ufeff") if number == 1 else text


# --- parsing -------------------------------------------------------------------------


def _read(path: Path) -> tuple[TraceFormat, _Columns]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        number = raw.count(b"\n", 0, exc.start) + 1
        raise TraceError(f"{path}:{number}: not UTF-8 text ({exc.reason})") from None
    # (line number, stripped text) of every non-blank line. Split on "\n" only (not
    # str.splitlines, which also splits on form feeds and Unicode separators) so
    # that numbers match what an editor shows; strip() removes the "\r" of CRLF.
    lines = [(i, s) for i, line in enumerate(text.split("\n"), start=1) if (s := line.strip())]
    if not lines:
        raise TraceError(f"{path}: empty file; accepted formats: {_accepted_formats()}")
    fmt = _detect_line(lines[0][1], path)
    if fmt is TraceFormat.MOONCAKE_JSONL:
        columns = _parse_mooncake(lines, path)
    else:
        columns = _parse_csv(fmt, lines[0][1], lines[1:], path)
    if len(columns.prompt_tokens) == 0:
        raise TraceError(f"{path}: no requests (a {fmt.description} with no data lines)")
    return fmt, columns


def _parse_csv(
    fmt: TraceFormat, header_line: str, rows: list[tuple[int, str]], path: Path
) -> _Columns:
    header = [name.strip() for name in header_line.split(",")]
    n_columns = len(header)
    prompt: list[int] = []
    output: list[int] = []
    stamps_ns: list[int] = []
    seconds: list[float] = []
    # One cache entry per calendar day: a trace spans few days, and date arithmetic
    # is the costly part of a wall-clock timestamp.
    day_ns: dict[str, int] = {}
    for number, line in rows:
        fields = line.split(",")
        if len(fields) != n_columns:
            raise TraceError(
                f"{path}:{number}: expected {n_columns} columns ({','.join(header)}), "
                f"got {len(fields)}"
            )
        where = f"{path}:{number}"
        if fmt is TraceFormat.LENGTHS_CSV:
            prompt.append(_positive_int(fields[0], header[0], where))
            output.append(_positive_int(fields[1], header[1], where))
            continue
        if fmt is TraceFormat.AZURE_CSV:
            stamps_ns.append(_wall_clock_ns(fields[0].strip(), header[0], where, day_ns))
        else:
            seconds.append(_finite_float(fields[0], header[0], where))
        prompt.append(_positive_int(fields[1], header[1], where))
        output.append(_positive_int(fields[2], header[2], where))
    arrival_s: FloatArray | None
    if fmt is TraceFormat.AZURE_CSV:
        # Subtract in integer nanoseconds before converting, so an hour-long trace
        # keeps nanosecond resolution (absolute epoch nanoseconds would not fit a
        # float64 mantissa).
        ns = np.array(stamps_ns, dtype=np.int64)
        arrival_s = (ns - ns.min()).astype(np.float64) / _NS_PER_S if len(ns) else None
    elif fmt is TraceFormat.GENERIC_CSV:
        arrival_s = np.array(seconds, dtype=np.float64)
    else:
        arrival_s = None
    return _Columns(
        arrival_s=arrival_s,
        prompt_tokens=np.array(prompt, dtype=np.int64),
        output_tokens=np.array(output, dtype=np.int64),
    )


def _parse_mooncake(lines: list[tuple[int, str]], path: Path) -> _Columns:
    stamps_ms: list[float] = []
    prompt: list[int] = []
    output: list[int] = []
    for number, line in lines:
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: bad JSON: {exc.msg} at column {exc.colno}") from None
        if not isinstance(record, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
        for key in _MOONCAKE_KEYS:
            if key not in record:
                raise TraceError(f"{where}: missing key {key!r}")
        stamp = record["timestamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, int | float):
            raise TraceError(
                f"{where}: timestamp: expected a number of milliseconds, got {stamp!r}"
            )
        if not math.isfinite(stamp):
            raise TraceError(f"{where}: timestamp: expected a finite number, got {stamp!r}")
        stamps_ms.append(float(stamp))
        for key, values in (("input_length", prompt), ("output_length", output)):
            length = record[key]
            if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                raise TraceError(f"{where}: {key}: expected an integer >= 1, got {length!r}")
            values.append(length)
    ms = np.array(stamps_ms, dtype=np.float64)
    return _Columns(
        arrival_s=(ms - ms.min()) / 1000.0,
        prompt_tokens=np.array(prompt, dtype=np.int64),
        output_tokens=np.array(output, dtype=np.int64),
    )


def _positive_int(text: str, field: str, where: str) -> int:
    value = text.strip()
    # isdigit() alone would accept non-ASCII digits such as "²", which int() rejects.
    if value.isascii() and value.isdigit():
        number = int(value)
        if number >= 1:
            return number
    raise TraceError(f"{where}: {field}: expected an integer >= 1, got {value!r}")


def _finite_float(text: str, field: str, where: str) -> float:
    value = text.strip()
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise TraceError(f"{where}: {field}: expected a finite number of seconds, got {value!r}")
    return number


def _wall_clock_ns(text: str, field: str, where: str, day_ns: dict[str, int]) -> int:
    """Nanoseconds since 1970-01-01 UTC of an Azure-style timestamp, exactly.

    Parsed by hand: datetime keeps only microseconds, and fromisoformat rejects
    the files' 7 fractional digits on some Python versions.
    """
    match = _AZURE_TIME.fullmatch(text)
    if match is None:
        raise TraceError(
            f"{where}: {field}: expected a time like '2023-11-16 18:15:46.6805900', got {text!r}"
        )
    day, hour, minute, second, fraction, offset = match.groups()
    if day not in day_ns:
        try:
            date = dt.date.fromisoformat(day)
        except ValueError:
            raise TraceError(f"{where}: {field}: no such date {day!r}") from None
        day_ns[day] = (date - dt.date(1970, 1, 1)).days * 86_400 * _NS_PER_S
    h, m, s = int(hour), int(minute), int(second)
    if h > 23 or m > 59 or s > 59:
        raise TraceError(f"{where}: {field}: no such time of day in {text!r}")
    # Digits past the ninth are below a nanosecond: dropped.
    fraction_ns = int((fraction or "")[:9].ljust(9, "0"))
    offset_s = 0
    if offset and offset != "Z":
        digits = offset[1:].replace(":", "")
        offset_minutes = int(digits[:2]) * 60 + int(digits[2:])
        offset_s = (1 if offset[0] == "+" else -1) * offset_minutes * 60
    return day_ns[day] + ((h * 60 + m) * 60 + s - offset_s) * _NS_PER_S + fraction_ns
