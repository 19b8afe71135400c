"""Per-request generation parameters, validated where they are made."""

from __future__ import annotations

import dataclasses
import math

from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.structured_outputs import StructuredOutputs

MAX_TOP_LOGPROBS = 20  # alternatives per token, as the OpenAI API allows
MAX_STOP_STRINGS = 16


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy; ``top_k == 0``, ``top_p == 1`` and ``min_p == 0``
    disable those filters. ``logprobs`` returns each generated token's log-probability,
    ``top_logprobs`` (0 to 20) as many alternatives with it. ``stop`` strings end the
    output where they first appear, even across token boundaries, and are not returned.
    ``structured_outputs`` constrains the output to a schema, regex, choice or grammar
    (``structured_outputs.py``; the engine masks the logits of the tokens it forbids).
    ``disable_speculation`` keeps a request out of speculative decoding (``speculative.py``)
    on an engine that speculates; its tokens are the same either way.

    An invalid value raises :class:`InvalidRequest` naming the field.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    structured_outputs: StructuredOutputs | None = None
    disable_speculation: bool = False

    def __post_init__(self):
        def refuse(field, message):
            got = repr(getattr(self, field))  # cut: a client's 10,000 stop strings are not echoed back
            raise InvalidRequest(field, f"{message}, got {got if len(got) <= 80 else got[:80] + '...'}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            refuse("max_tokens", "must be a positive integer")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature < math.inf:
            refuse("temperature", "must be a finite number >= 0")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            refuse("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or not 0 <= self.top_k < 2**31:  # an int32 in the step's batch
            refuse("top_k", "must be an integer in [0, 2**31) (0 disables it)")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            refuse("min_p", "must be in [0, 1] (0 disables it)")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**31:
            refuse("seed", "must be an integer in [0, 2**31)")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            refuse("stop_token_ids", "must be a tuple of token ids >= 0")
        if (not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and s for s in self.stop)):
            refuse("stop", f"must be a tuple of at most {MAX_STOP_STRINGS} non-empty strings")
        if not isinstance(self.ignore_eos, bool):
            refuse("ignore_eos", "must be a bool")
        if not isinstance(self.logprobs, bool):
            refuse("logprobs", "must be a bool")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            refuse("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs and not self.logprobs:
            refuse("top_logprobs", "needs logprobs=True")
        if not isinstance(self.disable_speculation, bool):
            refuse("disable_speculation", "must be a bool")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            refuse("structured_outputs", "must be a StructuredOutputs or None")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
