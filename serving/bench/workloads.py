"""What a benchmark sends and when: request lengths, arrival times, prompt token ids.

Two sources of requests: ``random`` (lengths drawn around a given input and output
length, arrivals drawn from a gamma process) and ``trace`` (lengths and arrival times
replayed from a recorded trace: the Azure LLM inference CSV files or JSONL, whose rows may
carry the ``hash_ids`` of their prompt blocks: ``prefix_workloads.py`` builds prompts of
them, and the shared-prefix and multi-turn workloads).

Prompts are token ids, never text, so that a prompt has exactly the length asked for
whatever the tokenizer does to text; outputs are asked for with ``ignore_eos`` so that
they have exactly the length asked for too.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from datetime import datetime
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class WorkloadRequest:
    """One request to send: its lengths and, for a replayed trace, its arrival time in
    seconds from the start of the run (``None``: the arrival process decides) and its
    prompt's block ids (a hash-id trace). A turn of a conversation names the request it
    follows (``previous``): its prompt is that request's prompt and answer, then its own."""

    prompt_len: int
    output_len: int
    arrival_s: float | None = None
    hash_ids: tuple[int, ...] | None = None
    conversation: int | None = None
    turn: int | None = None
    previous: int | None = None


@dataclasses.dataclass(frozen=True)
class TraceRow:
    timestamp_s: float  # seconds, any origin
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None  # one per block of the prompt (Mooncake traces)


def random_requests(num_requests: int, input_len: int, output_len: int, range_ratio: float,
                    rng: np.random.Generator) -> list[WorkloadRequest]:
    """Lengths drawn uniformly from ``[L * (1 - r), L * (1 + r)]`` (integers, at least 1),
    as vLLM's random dataset draws them; ``range_ratio == 0`` gives exactly ``L``."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if num_requests < 1 or input_len < 1 or output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")

    def lengths(center: int) -> np.ndarray:
        low = max(1, math.floor(center * (1 - range_ratio)))
        high = max(low, math.ceil(center * (1 + range_ratio)))
        return rng.integers(low, high + 1, size=num_requests)

    prompt_lens, output_lens = lengths(input_len), lengths(output_len)
    return [WorkloadRequest(int(p), int(o)) for p, o in zip(prompt_lens, output_lens)]


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Send times (seconds from the start) of a gamma arrival process, as vLLM draws them.

    Gaps are gamma with ``shape = burstiness`` and ``scale = 1 / (rate * burstiness)``, so
    their mean is ``1 / rate`` whatever the burstiness and their coefficient of variation
    ``1 / sqrt(burstiness)`` (1 is Poisson; below 1 burstier). Like vLLM, the cumulative
    times are then rescaled so that the last request goes out at ``n / rate``: the offered
    rate is exact for every seed and only the shape of the arrivals is random. An infinite
    rate sends everything at once.
    """
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    return times * ((num_requests / request_rate) / times[-1])


def read_trace(path: str | Path) -> list[TraceRow]:
    """Rows of an Azure LLM inference CSV (``TIMESTAMP, ContextTokens, GeneratedTokens``)
    or of a JSONL trace (``timestamp`` in ms, ``input_length``, ``output_length``, and
    optionally ``hash_ids``, a list of non-negative ints), in time order."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--trace {path}: no such file")
    rows = _read_jsonl(path) if path.suffix in (".jsonl", ".json") else _read_azure_csv(path)
    if not rows:
        raise ValueError(f"--trace {path} holds no requests")
    return sorted(rows, key=lambda row: row.timestamp_s)


def _read_azure_csv(path: Path) -> list[TraceRow]:
    rows = []
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"--trace {path}: not an Azure trace CSV, missing columns {sorted(missing)}")
        for line, record in enumerate(reader, start=2):
            try:
                rows.append(TraceRow(_azure_seconds(record["TIMESTAMP"]),
                                     int(record["ContextTokens"]), int(record["GeneratedTokens"])))
            except ValueError as error:
                raise ValueError(f"--trace {path}, line {line}: {error}") from None
    return rows


def _azure_seconds(stamp: str) -> float:
    """``2023-11-16 18:17:03.9799600`` (100 ns digits, more than ``datetime`` parses) as
    POSIX seconds."""
    whole, _, fraction = stamp.strip().partition(".")
    seconds = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return seconds + (float("0." + fraction) if fraction else 0.0)


def _read_jsonl(path: Path) -> list[TraceRow]:
    rows = []
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            rows.append(TraceRow(float(item["timestamp"]) / 1000.0, int(item["input_length"]),
                                 int(item["output_length"]), _hash_ids(item.get("hash_ids"))))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"--trace {path}, line {line_number}: expected an object with timestamp (ms), "
                f"input_length, output_length and optionally hash_ids ({error!r})"
            ) from None
    return rows


def _hash_ids(value) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                              for i in value):
        raise ValueError(f"hash_ids must be a list of non-negative ints, got {str(value)[:80]}")
    return tuple(value)


def window_trace(rows: list[TraceRow], *, start_s: float = 0.0, duration_s: float | None = None,
                 time_scale: float = 1.0, max_requests: int | None = None) -> list[WorkloadRequest]:
    """The requests of ``rows`` that arrive in ``[start_s, start_s + duration_s)`` seconds
    after the trace's first request (trace time), with arrival times measured from the
    window's start and multiplied by ``time_scale`` (0.1 replays ten times faster).
    Requests asking for no output are asked for one token (a stream needs one)."""
    if time_scale <= 0:
        raise ValueError(f"--time-scale must be > 0, got {time_scale}")
    if start_s < 0 or (duration_s is not None and duration_s <= 0):
        raise ValueError("--start must be >= 0 and --duration > 0 (seconds of trace time)")
    origin = rows[0].timestamp_s + start_s
    end = math.inf if duration_s is None else origin + duration_s
    chosen = [row for row in rows if origin <= row.timestamp_s < end][:max_requests]
    if not chosen:
        raise ValueError(f"the trace has no requests in [{start_s}, {start_s + (duration_s or math.inf)}) s")
    return [
        WorkloadRequest(max(1, row.prompt_len), max(1, row.output_len), (row.timestamp_s - origin) * time_scale,
                        row.hash_ids)
        for row in chosen
    ]


def clip_lengths(requests: list[WorkloadRequest], max_input_len: int | None,
                 max_output_len: int | None) -> list[WorkloadRequest]:
    """``requests`` with lengths clipped to the given maxima (a trace's 7k-token prompts on
    a model served with a 512-token context); ``None`` leaves a length alone."""
    for name, value in (("--max-input-len", max_input_len), ("--max-output-len", max_output_len)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return [dataclasses.replace(r, prompt_len=min(r.prompt_len, max_input_len or r.prompt_len),
                                output_len=min(r.output_len, max_output_len or r.output_len)) for r in requests]


def allowed_token_ids(vocab_size: int, special_ids=()) -> np.ndarray:
    """Token ids a random prompt may use: the vocabulary minus the special tokens (a stray
    end-of-text or chat marker in the middle of a prompt changes what a model attends to)."""
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(special_ids), dtype=np.int64))
    if allowed.size == 0:
        raise ValueError(f"no token ids left for prompts: vocabulary {vocab_size}, all special")
    return allowed


def tokenizer_token_ids(tokenizer_dir: str | Path) -> np.ndarray:
    """:func:`allowed_token_ids` of the ``tokenizer.json`` in ``tokenizer_dir``."""
    import tokenizers

    file = Path(tokenizer_dir) / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"--tokenizer {tokenizer_dir} has no tokenizer.json; give --vocab-size instead")
    backend = tokenizers.Tokenizer.from_file(str(file))
    special = [i for i, token in backend.get_added_tokens_decoder().items() if token.special]
    return allowed_token_ids(backend.get_vocab_size(with_added_tokens=True), special)


def prompt_token_ids(requests: list[WorkloadRequest], allowed_ids: np.ndarray,
                     rng: np.random.Generator) -> list[list[int]]:
    """One prompt of exactly ``prompt_len`` ids per request, drawn uniformly from
    ``allowed_ids`` (seeded by ``rng``, so a run is repeatable)."""
    return [allowed_ids[rng.integers(0, allowed_ids.size, size=r.prompt_len)].tolist() for r in requests]
