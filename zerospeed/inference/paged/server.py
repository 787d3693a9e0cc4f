"""`PagedServer`: a small serving loop over the paged KV cache with continuous batching.

    server = PagedServer(model, block_size=16, num_blocks=512)
    rid = server.add_request(prompt_ids, max_new_tokens=64)
    for event in server.stream():            # or: events = server.step(), one step at a time
        print(event.request_id, event.token, event.finished)

Requests can be added at any time; each `step()` admits waiting requests whose blocks fit, runs one
forward over every running sequence (prefills and decodes together: scheduler.py, Note [one step]),
samples one token per sequence and returns them; finished sequences free their blocks at once.
`kv_waste()` is the fraction of allocated KV memory not holding a cached token, averaged over steps.
`model` may be a tensor-parallel `InferenceEngine` (llama.py, Note [paged attention under tp]): every tp
rank builds the server, adds the same requests and steps it; each gets the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from zerospeed.inference.engine import InferenceEngine
from zerospeed.inference.paged.blocks import BlockAllocator
from zerospeed.inference.paged.llama import cache_for, check_supported, paged_forward
from zerospeed.inference.paged.scheduler import Scheduler, Sequence


@dataclass(frozen=True)
class TokenEvent:
    request_id: int
    token: int
    finished: bool


class PagedServer:
    def __init__(
        self,
        model: nn.Module,
        *,
        block_size: int = 16,
        num_blocks: int = 256,
        max_batch_tokens: int = 4096,
        max_running: int = 256,
        dtype: torch.dtype | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int = 0,
    ):
        if isinstance(model, InferenceEngine):  # init_inference's engine, e.g. AutoTP-sharded
            model = model.module
        check_supported(model)
        self.model = model.eval()
        self.block_size = block_size
        dtype = dtype or next(model.parameters()).dtype
        self.cache = cache_for(model, num_blocks, block_size, dtype)
        self.scheduler = Scheduler(
            BlockAllocator(num_blocks), block_size, max_batch_tokens=max_batch_tokens, max_running=max_running
        )
        self.do_sample, self.temperature, self.top_k = do_sample, temperature, top_k
        self.generator = torch.Generator(device=self.cache.keys[0].device).manual_seed(seed)
        self.sequences: dict[int, Sequence] = {}
        self._next_id = 0
        self._used = self._allocated = 0
        self.steps = 0

    def add_request(self, prompt_ids, max_new_tokens: int, eos_token_id: int | None = None) -> int:
        """Queue a prompt (a list or 1-D tensor of ids); returns its request id."""
        tokens = [int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
        if not tokens or max_new_tokens < 1:
            raise ValueError("add_request: needs a non-empty prompt and max_new_tokens >= 1")
        rid, self._next_id = self._next_id, self._next_id + 1
        seq = Sequence(rid, tokens, len(tokens), max_new_tokens, eos_token_id)
        self.scheduler.add(seq)
        self.sequences[rid] = seq
        return rid

    def _sample(self, logits_SV: torch.Tensor) -> list[int]:
        if not self.do_sample:
            return logits_SV.argmax(-1).tolist()
        logits = logits_SV.float() / self.temperature
        if self.top_k:
            cutoff = logits.topk(self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < cutoff, float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=self.generator)[:, 0].tolist()

    def step(self) -> list[TokenEvent]:
        """One forward over the running sequences; the tokens it produced."""
        work = self.scheduler.schedule()
        if not work:
            return []
        logits = paged_forward(
            self.model,
            self.cache,
            [w.seq.tokens[w.start : w.stop] for w in work],
            [w.start for w in work],
            [w.new_slots for w in work],
            [w.context_slots for w in work],
        )
        tokens = self._sample(logits)
        used, allocated = self.scheduler.kv_usage()
        used += sum(w.stop - w.start for w in work)  # the step just cached these
        self._used, self._allocated = self._used + used, self._allocated + allocated
        finished = {s.request_id for s in self.scheduler.complete(work, tokens)}
        self.steps += 1
        return [
            TokenEvent(w.seq.request_id, t, w.seq.request_id in finished) for w, t in zip(work, tokens, strict=True)
        ]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def stream(self) -> Iterator[TokenEvent]:
        """Step until every request (including ones added while streaming) has finished."""
        while self.has_unfinished():
            yield from self.step()

    def output(self, request_id: int) -> list[int]:
        """The tokens generated so far for a request."""
        return list(self.sequences[request_id].generated)

    def kv_waste(self) -> float:
        """Allocated-but-empty KV slots / allocated slots, summed over the steps so far."""
        return 0.0 if not self._allocated else 1.0 - self._used / self._allocated
