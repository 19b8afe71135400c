"""The shift policy: which compiled mode runs a step of a given bucket."""

from __future__ import annotations

import dataclasses

POLICIES = ("tp", "sp", "auto", "alternate")


@dataclasses.dataclass
class ShiftPolicy:
    """``tp``/``sp``: always that mode. ``auto``: the mode whose executable measured faster
    for the bucket, or, when ``threshold`` is set, SP from ``threshold`` tokens up (Arctic
    Inference's rule, default 512 there). ``alternate``: switch every step, which shows
    that the cache does not care."""

    policy: str
    modes: tuple[str, ...]
    run_seconds: dict
    threshold: int | None = None
    _last: str = "sp"

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"mode must be one of {POLICIES}, got {self.policy!r}")
        if self.policy in ("sp", "alternate") and "sp" not in self.modes:
            raise ValueError(f"mode {self.policy!r} needs sp > 1 (SP mode equals TP mode when sp == 1)")

    def choose(self, num_tokens: int, num_seqs: int) -> str:
        if len(self.modes) == 1:
            return self.modes[0]
        if self.policy in ("tp", "sp"):
            return self.policy
        if self.policy == "alternate":
            self._last = "tp" if self._last == "sp" else "sp"
            return self._last
        if self.threshold is not None:
            return "sp" if num_tokens >= self.threshold else "tp"
        tp = self.run_seconds.get(("tp", num_tokens, num_seqs), float("inf"))
        sp = self.run_seconds.get(("sp", num_tokens, num_seqs), float("inf"))
        return "sp" if sp < tp else "tp"
