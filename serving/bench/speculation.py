"""What speculative decoding did during one ``bench serve`` run: the server's counters read
just before the run (after the warm-up) and just after it, and their difference.

The counters are the server's since it started, summed over its ``--dp`` replicas: over
gRPC, ``ServerInfo.speculative``; over the OpenAI API, the ``spec_decode_*`` counters of the
HTTP port's ``/metrics`` (serving/server/metrics.py), where a server speculates when its
per-position counter has samples (one per draft position). Requests another client sends
meanwhile are counted too: benchmark a server nobody else uses.
"""

from __future__ import annotations

import dataclasses

from shiftjax.serving.engine.speculative import SpecDecodeCounters

METRIC_PREFIX = "shiftjax_spec_decode_"


@dataclasses.dataclass(frozen=True)
class SpeculationReading:
    """The server's speculative decoding at one moment: whether it speculates, and its counters."""

    speculates: bool
    counters: SpecDecodeCounters


def reading_from_server_info(reply) -> SpeculationReading | None:
    """``reply`` (a ``ServerInfoResponse``)'s ``speculative``; None from a server without it."""
    if not reply.HasField("speculative"):
        return None
    info = reply.speculative
    return SpeculationReading(info.enabled, SpecDecodeCounters(
        num_drafts=info.num_drafts, num_draft_tokens=info.num_draft_tokens,
        num_accepted_tokens=info.num_accepted_tokens, accepted_per_position=tuple(info.accepted_per_position),
        draft_seconds=info.draft_seconds))


def reading_from_metrics(text: str) -> SpeculationReading | None:
    """The ``spec_decode_*`` counters of a Prometheus scrape; None when it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    totals, per_position = {}, {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(METRIC_PREFIX) or not sample.name.endswith("_total"):
                continue  # the _created samples
            name = sample.name[len(METRIC_PREFIX):-len("_total")]
            if name == "num_accepted_tokens_per_pos":
                per_position[int(sample.labels["position"])] = int(sample.value)
            else:
                totals[name] = sample.value
    if "num_drafts" not in totals:
        return None
    positions = tuple(per_position.get(i, 0) for i in range(max(per_position, default=-1) + 1))
    counters = SpecDecodeCounters(
        num_drafts=int(totals["num_drafts"]), num_draft_tokens=int(totals.get("num_draft_tokens", 0)),
        num_accepted_tokens=int(totals.get("num_accepted_tokens", 0)), accepted_per_position=positions,
        draft_seconds=float(totals.get("draft_seconds", 0.0)))
    return SpeculationReading(bool(positions) or counters.num_drafts > 0, counters)


def counted_between(before: SpecDecodeCounters, after: SpecDecodeCounters) -> SpecDecodeCounters:
    """What was counted from ``before`` to ``after``."""
    width = max(len(before.accepted_per_position), len(after.accepted_per_position))

    def at(values, i):
        return values[i] if i < len(values) else 0

    return SpecDecodeCounters(
        num_drafts=after.num_drafts - before.num_drafts,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
        accepted_per_position=tuple(at(after.accepted_per_position, i) - at(before.accepted_per_position, i)
                                    for i in range(width)),
        draft_seconds=after.draft_seconds - before.draft_seconds)


def run_speculation(before: SpeculationReading | None, after: SpeculationReading | None) -> dict | None:
    """The run's speculative decoding for its summary: drafts, draft tokens and accepted
    tokens, accepted per draft position, the acceptance rate and mean accepted length
    (``SpecDecodeCounters`` says what each is) and the drafting's host seconds; None when
    either reading is missing or the server does not speculate."""
    if before is None or after is None or not after.speculates:
        return None
    run = counted_between(before.counters, after.counters)
    return {"acceptance_rate": run.acceptance_rate, "mean_accepted_length": run.mean_accepted_length,
            "num_drafts": run.num_drafts, "num_draft_tokens": run.num_draft_tokens,
            "num_accepted_tokens": run.num_accepted_tokens, "accepted_per_position": list(run.accepted_per_position),
            "draft_seconds": run.draft_seconds}
