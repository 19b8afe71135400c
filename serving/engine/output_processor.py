"""One request's output as its steps deliver it: text deltas, stop strings, the finish reason.

``LLM.generate`` and the engine service both call :meth:`OutputProcessor.update` after each
step that gave the request a token. The text comes from the incremental detokenizer
(``detokenizer.py``: multi-byte characters held back until whole, text that could begin a
stop string held back until the next tokens decide it); a stop string ends the output
before it, and the caller, told so by the finish reason, aborts the request to free its
pages at once. Offline (``stream=False``) a request without stop strings is decoded once, at
its end, instead: nobody reads its text before then.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from shiftjax.serving.engine.detokenizer import IncrementalDetokenizer
from shiftjax.serving.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # kept light: the service's protocol imports the finish reasons from here
    from shiftjax.serving.engine.scheduler import Request

# The finish reasons the engine gives, as the OpenAI API and vLLM spell them.
FINISH_STOP = "stop"  # end-of-sequence token, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens reached


@dataclasses.dataclass(frozen=True)
class OutputDelta:
    """What one step added to a request's output; ``finish_reason`` is set on the last."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


class OutputProcessor:
    """Turns one request's new output token ids into text and says when and why it ends.

    ``tokenizer`` needs only ``decode(ids, skip_special_tokens=...)``. A stop string that
    matches wins over the engine's own end in the same step (``max_tokens``, a stop token),
    even one that matches only in the text held back until the end: the reason is ``"stop"``
    and the stop reason the string. For a stop token id the stop
    reason is that id; for the model's end-of-sequence token it is None, as in vLLM.
    """

    def __init__(self, tokenizer, params: SamplingParams, *, stream: bool = True):
        self.params = params
        self._decode = tokenizer.decode
        self._detokenizer = IncrementalDetokenizer(tokenizer, params.stop) if stream or params.stop else None
        self.sent = 0  # output tokens already taken
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def update(self, request: Request) -> OutputDelta:
        """The tokens ``request`` has gained since the last call, their text, and, when they
        end it (a stop string, or the engine finished it), the finish and stop reasons
        (the text then includes whatever the detokenizer still held). Nothing after the end."""
        if self.finish_reason is not None:
            return OutputDelta((), "")
        new_ids = request.output_ids[self.sent:]
        detokenizer = self._detokenizer
        if detokenizer is None:
            text = ""
        elif detokenizer.stop and len(new_ids) > 1:
            # a step's several tokens (a verified draft) go in one by one: the output ends with
            # the token that completes a stop string, as it does without speculation
            text = ""
            for i, token in enumerate(new_ids):
                text += detokenizer.push([token])
                if detokenizer.stopped is not None:
                    new_ids = new_ids[:i + 1]
                    break
        else:
            text = detokenizer.push(new_ids)
        self.sent += len(new_ids)
        if request.finished and (detokenizer is None or detokenizer.stopped is None):
            # the end: what the detokenizer held (in which a stop string may yet match)
            text += self._decode(request.output_ids) if detokenizer is None else detokenizer.finish()
        if detokenizer is not None and detokenizer.stopped is not None:
            self.finish_reason, self.stop_reason = FINISH_STOP, detokenizer.stopped
        elif request.finished:
            self.finish_reason = request.finish_reason
            output = request.output_ids
            # the id of a stop_token_ids match; None for the model's own EOS (as vLLM)
            self.stop_reason = (output[-1] if self.finish_reason == FINISH_STOP and output
                                and output[-1] in self.params.stop_token_ids else None)
        return OutputDelta(tuple(new_ids), text, self.finish_reason, self.stop_reason)
