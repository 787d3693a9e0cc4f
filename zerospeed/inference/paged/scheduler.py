"""Continuous batching over the paged KV cache: which sequences run this step, and on which slots.

Pure bookkeeping on token lists and block tables (no tensors), so every policy decision is unit-tested.

Note [one step]: each running sequence computes its tokens not yet in the cache — its whole prompt the
first time (prefill), then the one token sampled last step (decode) — and yields one new token. Prefills
and decodes share a step: a request admitted between two steps starts producing tokens right away while
the others keep decoding (continuous batching), bounded by `max_batch_tokens` tokens per step.

Note [preemption]: before a step every running sequence must have a slot for its next token. When the
free list runs dry, the most recently admitted sequence is preempted: its blocks are freed and it goes
back to the front of the queue with its tokens so far, recomputed as a longer prompt when it is
readmitted (vLLM's recompute policy: for greedy decoding the output is unchanged, and no swap space is
needed). A sequence that cannot fit even alone is refused when it is added.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from zerospeed.inference.paged.blocks import BlockAllocator, blocks_needed, grow, slots


@dataclass
class Sequence:
    """One request: its tokens (prompt, then generated), how many are in the cache, its block table."""

    request_id: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    eos_token_id: int | None = None
    computed: int = 0
    table: list[int] = field(default_factory=list)
    finished: bool = False

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def done(self) -> bool:
        hit_eos = self.eos_token_id is not None and len(self.generated) > 0 and self.generated[-1] == self.eos_token_id
        return hit_eos or len(self.generated) >= self.max_new_tokens


@dataclass(frozen=True)
class Work:
    """One sequence's share of a step: positions [start, stop) to compute, their cache slots, and the slots
    of its whole context [0, stop) that attention reads."""

    seq: Sequence
    start: int
    stop: int
    new_slots: list[int]
    context_slots: list[int]


class Scheduler:
    def __init__(
        self, allocator: BlockAllocator, block_size: int, *, max_batch_tokens: int = 4096, max_running: int = 256
    ):
        self.allocator, self.block_size = allocator, block_size
        self.max_batch_tokens, self.max_running = max_batch_tokens, max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        total = seq.prompt_len + seq.max_new_tokens
        if blocks_needed(total, self.block_size) > self.allocator.num_blocks:
            raise ValueError(
                f"request {seq.request_id}: {total} tokens need {blocks_needed(total, self.block_size)} "
                f"blocks of {self.block_size}, the cache has {self.allocator.num_blocks}; "
                "raise num_blocks"
            )
        if seq.prompt_len > self.max_batch_tokens:
            raise ValueError(
                f"request {seq.request_id}: a prompt of {seq.prompt_len} tokens exceeds max_batch_tokens "
                f"= {self.max_batch_tokens}"
            )
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _free(self, seq: Sequence) -> None:
        self.allocator.release(seq.table)
        seq.table, seq.computed = [], 0

    def _make_room_for_decodes(self) -> None:
        """Note [preemption]: every running sequence gets the blocks its next token needs."""
        for seq in list(self.running):
            while seq in self.running and blocks_needed(len(seq.tokens), self.block_size) > len(seq.table):
                if self.allocator.num_free:
                    grow(seq.table, len(seq.tokens), self.block_size, self.allocator)
                    continue
                victim = self.running.pop()  # the most recently admitted
                self._free(victim)
                self.waiting.appendleft(victim)
                self.preemptions += 1

    def _admit(self, budget: int) -> int:
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            need = blocks_needed(len(seq.tokens), self.block_size)
            if len(seq.tokens) > budget or need > self.allocator.num_free:
                break  # first come, first served: no overtaking
            self.waiting.popleft()
            grow(seq.table, len(seq.tokens), self.block_size, self.allocator)
            self.running.append(seq)
            budget -= len(seq.tokens)
        return budget

    def schedule(self) -> list[Work]:
        """The work of the next step (Note [one step])."""
        self._make_room_for_decodes()
        budget = self.max_batch_tokens - sum(len(s.tokens) - s.computed for s in self.running)
        self._admit(budget)
        bs = self.block_size
        return [
            Work(
                s,
                s.computed,
                len(s.tokens),
                slots(s.table, s.computed, len(s.tokens), bs),
                slots(s.table, 0, len(s.tokens), bs),
            )
            for s in self.running
        ]

    def complete(self, work: list[Work], new_tokens: list[int]) -> list[Sequence]:
        """Record the step's sampled tokens; finished sequences free their blocks. Returns those finished."""
        finished = []
        for w, token in zip(work, new_tokens, strict=True):
            w.seq.computed = w.stop
            w.seq.tokens.append(token)
            if w.seq.done():
                w.seq.finished = True
                self.running.remove(w.seq)
                self._free(w.seq)
                finished.append(w.seq)
        return finished

    def kv_usage(self) -> tuple[int, int]:
        """(slots holding a cached token, slots allocated) right now."""
        used = sum(s.computed for s in self.running)
        return used, sum(len(s.table) for s in self.running) * self.block_size
