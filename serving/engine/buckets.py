"""The bucket ladder: the (tokens, sequences) shapes a step is compiled for, and a batch
padded to one. Everything is compiled at start, so a batch that fits no bucket is an
error, never a recompile."""

from __future__ import annotations

import dataclasses

from shiftjax.batch import PER_SEQUENCE_FIELDS, PER_TOKEN_FIELDS, StepBatch, empty_batch


class NoBucket(ValueError):
    """A batch larger than every compiled bucket."""


def _pads_decode(seqs: int, tokens: int) -> bool:
    """Whether a decode step of ``seqs`` sequences (one token each) in a ``tokens`` bucket
    multiplies padding rows that cost: more than twice its rows and above 16 (16 rows cost
    little more than 8; 64 rows 1.23-1.52x for the 8B TP shard's projections:
    benchmarks/README.md, "One GPU")."""
    return tokens > max(2 * seqs, 16)


@dataclasses.dataclass(frozen=True)
class BucketLadder:
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]

    def __post_init__(self):
        for name in ("token_buckets", "seq_buckets"):
            values = getattr(self, name)
            if not values or list(values) != sorted(set(values)) or values[0] <= 0:
                raise ValueError(f"{name} must be strictly increasing positive integers, got {values}")

    @classmethod
    def for_engine(cls, token_buckets: tuple[int, ...] | None, seq_buckets: tuple[int, ...] | None,
                   max_tokens: int, max_seqs: int, multiple: int = 1) -> BucketLadder:
        """The ladder an engine compiles: the buckets given, else :meth:`geometric` (with
        sequence buckets given alone, the geometric token buckets); token buckets given
        alone pair with one sequence bucket, ``max_seqs``."""
        if token_buckets is None:
            ladder = cls.geometric(max_tokens, max_seqs, multiple=multiple)
            return cls(ladder.token_buckets, tuple(seq_buckets)) if seq_buckets else ladder
        return cls(tuple(token_buckets), tuple(seq_buckets or (max_seqs,)))

    @classmethod
    def geometric(cls, max_tokens: int, max_seqs: int, *, min_tokens: int = 16, factor: int = 4,
                  multiple: int = 1):
        """Token buckets ``min_tokens * factor**i`` up to ``max_tokens`` (which is always one),
        rounded up to multiples of ``multiple`` (the SP degree); sequence buckets: the token
        buckets below ``max_seqs``, then ``max_seqs`` (also a token bucket where none lies
        within twice it). Each bucket pair is one executable per mode, compiled at start, so
        the ladder trades padding against start-up time.

        The sequence buckets are token buckets so that a decode step of a bucket's worth of
        sequences (one token each) runs in a step of as many tokens: 64 decoding sequences
        in a (256 tokens, 128 sequences) step took 1.31x the device time of a (64, 64) step
        (benchmarks/README.md, "One GPU"). Below 16 rows the GEMMs gain little."""
        def ladder(first, last):
            values, v = [], first
            while v < last:
                values.append(v)
                v *= factor
            return values + [last]

        def rounded(t):
            return -(-t // multiple) * multiple

        tokens = sorted({rounded(t) for t in ladder(min(min_tokens, max_tokens), max_tokens)})
        # (a sequence bucket above the largest token bucket would pair with no token bucket)
        last = min(max_seqs, tokens[-1])
        if _pads_decode(last, min(t for t in tokens if t >= last)):  # a full batch decodes unpadded
            tokens = sorted(set(tokens) | {rounded(last)})
        seqs = {t for t in tokens if t < max_seqs} | {last}
        return cls(tuple(tokens), tuple(sorted(seqs)))

    @property
    def result_rows(self) -> int:
        """Rows of every step's result: the largest sequence bucket, so that a step can
        read the one before it whatever their buckets."""
        return self.seq_buckets[-1]

    def max_seqs(self) -> int:
        """The most sequences a step can hold and still fit a bucket: the largest sequence
        bucket that the largest token bucket is compiled for (a step of n sequences has at
        least n tokens, so any smaller step finds a bucket on the way up)."""
        return max(b for b in self.seq_buckets if b <= self.token_buckets[-1])

    def padded_decode_steps(self) -> list[tuple[int, int]]:
        """``(sequences, tokens)`` for each sequence bucket whose decode step (one token a
        sequence) runs in a token bucket that pads it (``_pads_decode``). A ladder given by
        hand may have them; the geometric one has none."""
        steps = [(seqs, self.pick(seqs, seqs)[0]) for seqs in self.seq_buckets if seqs <= self.token_buckets[-1]]
        return [(seqs, tokens) for seqs, tokens in steps if _pads_decode(seqs, tokens)]

    def pairs(self):
        return [(t, b) for t in self.token_buckets for b in self.seq_buckets if b <= t]

    def pick(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        for t in self.token_buckets:
            if t >= num_tokens:
                for b in self.seq_buckets:
                    if num_seqs <= b <= t:
                        return t, b
        raise NoBucket(
            f"a step of {num_tokens} tokens and {num_seqs} sequences fits no compiled bucket "
            f"(tokens {self.token_buckets}, sequences {self.seq_buckets})"
        )


def pad_batch(batch: StepBatch, num_tokens: int, num_seqs: int) -> StepBatch:
    """``batch`` padded to a bucket: padding tokens write the scratch page, padding
    sequences are empty and sample nothing."""
    padded = empty_batch(num_tokens, num_seqs, batch.page_table.shape[1])
    n, b = batch.num_tokens, batch.num_seqs
    for name in PER_TOKEN_FIELDS:
        getattr(padded, name)[:n] = getattr(batch, name)
    for name in PER_SEQUENCE_FIELDS:
        getattr(padded, name)[:b] = getattr(batch, name)
    padded.page_table[:b] = batch.page_table
    padded.query_start[:b + 1] = batch.query_start
    padded.query_start[b + 1:] = batch.query_start[b]
    return padded
