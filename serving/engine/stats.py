"""What the engine has done and holds, as one immutable snapshot: the only view of the
engine's counters, queue and page pool that the service, metrics and ServerInfo read."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepCounters:
    """Steps, tokens and mode switches, counted as steps finish (mutated by the engine alone)."""

    modes: tuple[str, ...]
    steps: int = 0
    switches: int = 0
    tokens: int = 0
    last_mode: str | None = None
    steps_by_mode: dict[str, int] = dataclasses.field(default_factory=dict)
    tokens_by_mode: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.steps_by_mode = self.steps_by_mode or dict.fromkeys(self.modes, 0)
        self.tokens_by_mode = self.tokens_by_mode or dict.fromkeys(self.modes, 0)

    def count(self, mode: str, tokens: int) -> bool:
        """Counts one finished step; whether it switched mode."""
        switched = self.last_mode not in (None, mode)
        self.switches += switched
        self.steps += 1
        self.tokens += tokens
        self.steps_by_mode[mode] += 1
        self.tokens_by_mode[mode] += tokens
        self.last_mode = mode
        return switched


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state when asked (never cached), copied so that a reader on another
    thread sees numbers that belong together."""

    running: int
    waiting: int
    num_pages: int  # usable pages (page 0, the scratch page, excluded)
    free_pages: int
    preemptions: int
    steps: int
    switches: int
    tokens: int
    steps_by_mode: dict[str, int]
    tokens_by_mode: dict[str, int]
