"""Reading trace files: format detection, exact parsing, and errors that say where."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sim.trace import TraceError
from sim.trace_io import LengthSamples, TraceFormat, detect_format, load_lengths, load_trace

FIXTURES = Path(__file__).parent / "data"
BUNDLED = Path(__file__).parents[2] / "data" / "traces"
AZURE_CONV = BUNDLED / "AzureLLMInferenceTrace_conv.csv"
AZURE_CODE = BUNDLED / "AzureLLMInferenceTrace_code.csv"
SHAREGPT = BUNDLED / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
ARXIV = BUNDLED / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
GENERIC_HEADER = "timestamp_s,prompt_tokens,output_tokens"
LENGTHS_HEADER = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio"


def write(tmp_path: Path, name: str, *lines: str) -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- detection -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (AZURE_CONV, TraceFormat.AZURE_CSV),
        (AZURE_CODE, TraceFormat.AZURE_CSV),
        (SHAREGPT, TraceFormat.LENGTHS_CSV),
        (ARXIV, TraceFormat.LENGTHS_CSV),
        (FIXTURES / "mooncake_small.jsonl", TraceFormat.MOONCAKE_JSONL),
        (FIXTURES / "generic_small.csv", TraceFormat.GENERIC_CSV),
    ],
    ids=lambda value: value.name if isinstance(value, Path) else str(value),
)
def test_the_format_of_every_known_file_is_detected(path: Path, expected: TraceFormat) -> None:
    assert detect_format(path) is expected


def test_the_format_comes_from_the_content_not_the_extension(tmp_path: Path) -> None:
    misnamed = write(tmp_path, "requests.jsonl", AZURE_HEADER, "2023-11-16 18:15:46.6805900,3,4")
    assert detect_format(misnamed) is TraceFormat.AZURE_CSV
    assert len(load_trace(misnamed)) == 1


def test_an_unknown_format_names_the_file_and_lists_the_accepted_formats(tmp_path: Path) -> None:
    path = write(tmp_path, "mystery.csv", "time,in,out", "1,2,3")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    message = str(info.value)
    assert "mystery.csv" in message
    for header in (AZURE_HEADER, GENERIC_HEADER, "input_length", "num_prefill_tokens"):
        assert header in message


def test_a_json_line_without_the_mooncake_keys_is_an_unknown_format(tmp_path: Path) -> None:
    path = write(tmp_path, "other.jsonl", '{"ts": 1, "prompt": 2}')
    with pytest.raises(TraceError, match="unknown trace format"):
        detect_format(path)


@pytest.mark.parametrize("content", ["", "\n\n  \r\n"], ids=["no bytes", "blank lines"])
def test_an_empty_file_is_an_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.csv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(TraceError, match=r"empty\.csv: empty file"):
        load_trace(path)
    with pytest.raises(TraceError, match="empty file"):
        detect_format(path)


@pytest.mark.parametrize("header", [AZURE_HEADER, GENERIC_HEADER, LENGTHS_HEADER])
def test_a_header_without_requests_is_an_error(tmp_path: Path, header: str) -> None:
    path = write(tmp_path, "header_only.csv", header)
    with pytest.raises(TraceError, match=r"header_only\.csv: no requests"):
        load_lengths(path)


# --- the bundled traces --------------------------------------------------------------


@pytest.mark.parametrize(("path", "requests"), [(AZURE_CONV, 19_366), (AZURE_CODE, 8_819)])
def test_the_bundled_azure_traces_load_with_the_request_counts_of_their_sources(
    path: Path, requests: int
) -> None:
    trace = load_trace(path)
    assert len(trace) == requests
    assert trace.arrival_s[0] == 0.0
    assert np.all(np.diff(trace.arrival_s) >= 0)
    # Both files cover one hour (18:15-19:14 on 2023-11-16).
    assert 3000 < trace.duration_s < 3600
    assert trace.source == path.name


def test_the_bundled_azure_traces_have_no_zero_length_so_zero_stays_an_error() -> None:
    # The loader rejects a zero length instead of clamping it; that rule is only
    # safe while the real data has none, which this checks on the raw text.
    for path in (AZURE_CONV, AZURE_CODE):
        rows = path.read_text(encoding="utf-8").split("\n")[1:]
        for row in rows:
            if row.strip():
                _, context, generated = row.strip().split(",")
                assert int(context) >= 1 and int(generated) >= 1, (path.name, row)


def test_azure_arrival_times_are_exact_to_the_seventh_fractional_digit() -> None:
    trace = load_trace(AZURE_CONV)
    # The file's first two timestamps are 18:15:46.6805900 and 18:15:50.9951690.
    assert trace.arrival_s[1] == pytest.approx(4.3145790, abs=1e-9)


@pytest.mark.parametrize(("path", "rows"), [(SHAREGPT, 30_731), (ARXIV, 28_257)])
def test_length_only_files_give_their_first_two_columns(path: Path, rows: int) -> None:
    lengths = load_lengths(path)
    assert len(lengths) == rows
    first = path.read_text(encoding="utf-8").split("\n")[1].split(",")
    assert lengths.prompt_tokens[0] == int(first[0])
    assert lengths.output_tokens[0] == int(first[1])
    # num_total_tokens is the sum of the two columns read: a check on the pairing.
    total = np.loadtxt(path, delimiter=",", skiprows=1, usecols=2, dtype=np.int64)
    np.testing.assert_array_equal(lengths.prompt_tokens + lengths.output_tokens, total)


def test_a_length_only_file_is_not_a_trace_and_the_error_says_what_to_use() -> None:
    with pytest.raises(TraceError, match="load_lengths"):
        load_trace(SHAREGPT)


def test_the_lengths_of_a_trace_file_are_its_requests_lengths_in_file_order() -> None:
    lengths = load_lengths(AZURE_CODE)
    trace = load_trace(AZURE_CODE)
    assert isinstance(lengths, LengthSamples)
    # The bundled file is sorted, so file order is arrival order.
    np.testing.assert_array_equal(lengths.prompt_tokens, trace.prompt_tokens)
    np.testing.assert_array_equal(lengths.output_tokens, trace.output_tokens)


# --- the small fixtures: exact values ------------------------------------------------


def test_an_unsorted_azure_file_is_stably_sorted_across_midnight() -> None:
    # CRLF line endings and a blank line, as spreadsheet exports write them.
    trace = load_trace(FIXTURES / "azure_small.csv")
    np.testing.assert_allclose(trace.arrival_s, [0.0, 1.9999999, 1.9999999, 2.0000001], atol=1e-12)
    # The two requests logged at 23:59:59.9999999 keep their file order.
    np.testing.assert_array_equal(trace.prompt_tokens, [100, 200, 400, 300])
    np.testing.assert_array_equal(trace.output_tokens, [10, 20, 40, 30])


def test_azure_timestamps_with_a_utc_offset_are_converted_to_one_clock(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "offsets.csv",
        AZURE_HEADER,
        "2024-05-10 00:00:00.5+00:00,10,1",
        "2024-05-10 02:00:01.5+02:00,10,1",
        "2024-05-10T00:00:02Z,10,1",
    )
    np.testing.assert_allclose(load_trace(path).arrival_s, [0.0, 1.0, 1.5])


def test_mooncake_timestamps_are_milliseconds_and_extra_keys_are_ignored() -> None:
    trace = load_trace(FIXTURES / "mooncake_small.jsonl")
    np.testing.assert_allclose(trace.arrival_s, [0.0, 0.0, (30535 - 27482) / 1000])
    np.testing.assert_array_equal(trace.prompt_tokens, [6955, 8, 6472])
    np.testing.assert_array_equal(trace.output_tokens, [52, 1, 26])


def test_a_generic_csv_is_sorted_and_rebased_to_its_first_arrival() -> None:
    trace = load_trace(FIXTURES / "generic_small.csv")
    np.testing.assert_allclose(trace.arrival_s, [0.0, 1.25, 2.5])
    np.testing.assert_array_equal(trace.prompt_tokens, [512, 1024, 128])
    np.testing.assert_array_equal(trace.output_tokens, [64, 1, 16])


def test_a_fixture_length_only_file_keeps_its_row_pairs() -> None:
    lengths = load_lengths(FIXTURES / "lengths_small.csv")
    np.testing.assert_array_equal(lengths.prompt_tokens, [74, 290, 3772])
    np.testing.assert_array_equal(lengths.output_tokens, [918, 905, 54])
    assert lengths.source == "lengths_small.csv"


@pytest.mark.parametrize("speedup", [0.5, 2.0, 60.0])
def test_speedup_divides_every_arrival_time(speedup: float) -> None:
    plain = load_trace(FIXTURES / "generic_small.csv")
    fast = load_trace(FIXTURES / "generic_small.csv", speedup=speedup)
    np.testing.assert_allclose(fast.arrival_s, plain.arrival_s / speedup)
    np.testing.assert_array_equal(fast.prompt_tokens, plain.prompt_tokens)


@pytest.mark.parametrize("speedup", [0.0, -1.0, float("nan"), float("inf")])
def test_a_speedup_that_is_not_a_finite_positive_number_is_rejected(speedup: float) -> None:
    with pytest.raises(ValueError, match=r"^speedup:"):
        load_trace(FIXTURES / "generic_small.csv", speedup=speedup)


# --- malformed lines -----------------------------------------------------------------

AZURE_OK = "2023-11-16 18:15:46.6805900,374,44"
GENERIC_OK = "1.5,10,20"
MOONCAKE_OK = '{"timestamp": 0, "input_length": 5, "output_length": 6}'
LENGTHS_OK = "74,918,992,0.08"

MALFORMED = [
    # (name, header or None for JSONL, bad line, what the message must say after "file:3: ")
    ("azure_text_length", AZURE_HEADER, "2023-11-16 18:15:47.0,abc,5",
     "ContextTokens: expected an integer >= 1, got 'abc'"),
    ("azure_zero_output", AZURE_HEADER, "2023-11-16 18:15:47.0,5,0",
     "GeneratedTokens: expected an integer >= 1, got '0'"),
    ("azure_negative", AZURE_HEADER, "2023-11-16 18:15:47.0,-3,5",
     "ContextTokens: expected an integer >= 1, got '-3'"),
    ("azure_fraction", AZURE_HEADER, "2023-11-16 18:15:47.0,3.5,5",
     "ContextTokens: expected an integer >= 1, got '3.5'"),
    ("azure_columns", AZURE_HEADER, "2023-11-16 18:15:47.0,5", "expected 3 columns"),
    ("azure_extra_column", AZURE_HEADER, "2023-11-16 18:15:47.0,5,6,7", "expected 3 columns"),
    ("azure_bad_time", AZURE_HEADER, "yesterday,5,6", "TIMESTAMP: expected a time like"),
    ("azure_bad_date", AZURE_HEADER, "2023-02-30 18:15:47.0,5,6", "TIMESTAMP: no such date"),
    ("azure_bad_hour", AZURE_HEADER, "2023-11-16 24:15:47.0,5,6", "TIMESTAMP: no such time"),
    ("generic_text_time", GENERIC_HEADER, "soon,5,6",
     "timestamp_s: expected a finite number of seconds, got 'soon'"),
    ("generic_nan_time", GENERIC_HEADER, "nan,5,6", "timestamp_s: expected a finite number"),
    ("generic_zero_prompt", GENERIC_HEADER, "2.0,0,6", "prompt_tokens: expected an integer >= 1"),
    ("generic_empty_output", GENERIC_HEADER, "2.0,5,", "output_tokens: expected an integer >= 1"),
    ("lengths_zero", LENGTHS_HEADER, "0,5,5,0.0", "num_prefill_tokens: expected an integer >= 1"),
    ("lengths_columns", LENGTHS_HEADER, "5,5", "expected 4 columns"),
    ("mooncake_json", None, '{"timestamp": 1, "input_length": 5', "bad JSON"),
    ("mooncake_array", None, "[1, 2, 3]", "expected a JSON object, got list"),
    ("mooncake_missing", None, '{"timestamp": 1, "input_length": 5}',
     "missing key 'output_length'"),
    ("mooncake_zero", None, '{"timestamp": 1, "input_length": 0, "output_length": 6}',
     "input_length: expected an integer >= 1, got 0"),
    ("mooncake_float_length", None, '{"timestamp": 1, "input_length": 5, "output_length": 6.5}',
     "output_length: expected an integer >= 1, got 6.5"),
    ("mooncake_bool", None, '{"timestamp": 1, "input_length": true, "output_length": 6}',
     "input_length: expected an integer >= 1, got True"),
    ("mooncake_text_time", None, '{"timestamp": "1", "input_length": 5, "output_length": 6}',
     "timestamp: expected a number of milliseconds, got '1'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "header", "bad_line", "expected"), MALFORMED, ids=[case[0] for case in MALFORMED]
)
def test_a_malformed_line_names_the_file_the_line_and_what_is_wrong(
    tmp_path: Path, name: str, header: str | None, bad_line: str, expected: str
) -> None:
    # The bad line is the third of the file, between good ones: after a header and
    # one good line (for JSONL: after two good lines).
    if header is None:
        lines = [MOONCAKE_OK, MOONCAKE_OK, bad_line, MOONCAKE_OK]
    else:
        good = {AZURE_HEADER: AZURE_OK, GENERIC_HEADER: GENERIC_OK, LENGTHS_HEADER: LENGTHS_OK}
        lines = [header, good[header], bad_line, good[header]]
    path = write(tmp_path, f"{name}.txt", *lines)
    with pytest.raises(TraceError) as info:
        load_lengths(path)
    assert str(info.value).startswith(f"{path}:3: {expected}")


def test_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "gappy.csv", GENERIC_HEADER, "", GENERIC_OK, "", "", "x,1,1")
    with pytest.raises(TraceError, match=r"gappy\.csv:6: timestamp_s"):
        load_trace(path)


def test_text_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.csv"
    path.write_bytes(f"{GENERIC_HEADER}\n{GENERIC_OK}\n1.0,5,6 \xe9\n".encode("latin-1"))
    with pytest.raises(TraceError, match=r"latin1\.csv:3: not UTF-8"):
        load_trace(path)


def test_a_byte_order_mark_before_the_header_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "bom.csv"
    path.write_text(f"\ufeff{GENERIC_HEADER}\n{GENERIC_OK}\n", encoding="utf-8")
    assert detect_format(path) is TraceFormat.GENERIC_CSV
    assert len(load_trace(path)) == 1
