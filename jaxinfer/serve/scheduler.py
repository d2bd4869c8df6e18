"""The scheduling policy, in pure Python over requests and pages (no model, no device).

Each iteration (`Scheduler.schedule(steps)`) returns a `Plan`:
  1. pages for the running decodes: the engine decodes up to `steps` tokens per request in one
     scan, so each decoding request gets the pages those tokens land in. When pages run short,
     the scan gets fewer steps (down to one); when even one step does not fit, the newest
     running request is preempted: its pages are released and it goes back to the queue, to be
     recomputed (prompt + tokens so far) later. The oldest request always makes progress, so
     the engine never deadlocks.
  2. admission, first come first served: the oldest waiting request is admitted while a slot
     is free and the pages for its context are available (after the prefix cache's share); the
     first one that does not fit stops admission (no overtaking).
  3. prefill chunks: prefilling requests, oldest first, get chunks of their context until the
     iteration's budget of `prefill_chunk` tokens is spent: a long prompt delays the running
     decodes by at most one chunk per iteration.
The engine runs the chunks that fit one device call (`one_call`) beside a decode step of the
decoding requests, then a decode scan for the rest of `plan.steps`; a request whose context ends
in a chunk run there joins the decode (`join` grows its pages for the tokens it may sample), and
chunks left out wait for the next iteration. The engine reports back through `prefilled`,
`sampled` and `finish`.

A request's context is its prompt plus the tokens generated so far; `computed` counts the
context tokens whose keys/values are in its pages. Prefilling: computed < len(context).
Decoding: computed == len(context) - 1 (the last sampled token is the next input).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Optional

from jaxinfer.model.cache import pages_for
from jaxinfer.serve.pages import PagePool, prefix_hashes

WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"


@dataclasses.dataclass(eq=False, slots=True)
class Seq:
    """One request as the scheduler sees it."""

    rid: int  # arrival order: smaller is older
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0
    slot: Optional[int] = None
    state: str = WAITING
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache at the last admission
    recompute_from: Optional[int] = None  # prompt logprobs wanted from this position: no cache hits after it
    cache_salt: bytes = b""  # prefix-cache keys start from this (steered requests: their steering's key)
    prompt_keys: list[bytes] = dataclasses.field(default_factory=list)  # of its first full prompt pages (`_prompt_keys`)

    @property
    def remaining(self) -> int:
        """Tokens the request may still sample."""
        return self.max_new_tokens - len(self.generated)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated


@dataclasses.dataclass
class Chunk:
    seq: Seq
    start: int  # first context position of the chunk
    n: int  # tokens in the chunk
    last: bool  # the chunk ends the context: sample the next token after it


@dataclasses.dataclass
class Plan:
    prefill: list[Chunk]
    decode: list[Seq]
    preempted: list[Seq]
    admitted: list[Seq]
    steps: int = 1  # decode steps of this iteration's scan


class Scheduler:
    def __init__(self, pool: PagePool, n_slots: int, prefill_chunk: int, prefix_cache: bool = True):
        if n_slots < 1 or prefill_chunk < 1:
            raise ValueError(f"n_slots and prefill_chunk must be >= 1, got {n_slots}, {prefill_chunk}")
        self.pool, self.n_slots, self.prefill_chunk, self.prefix_cache = pool, n_slots, prefill_chunk, prefix_cache
        self.waiting: list[Seq] = []  # sorted by rid
        self.running: list[Seq] = []  # sorted by admitted_at
        self._free_slots = list(range(n_slots))
        self.preemptions = 0

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def add(self, seq: Seq) -> None:
        seq.state = WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.rid)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ---- one iteration ------------------------------------------------------------------------
    def schedule(self, steps: int = 1) -> Plan:
        """Plan one iteration whose decode scan runs up to `steps` steps (fewer if pages run short)."""
        decoding = [s for s in self.running if s.state == DECODE]
        steps, preempted = self._grow_decodes(decoding, steps)
        if preempted:
            decoding = [s for s in decoding if s.state == DECODE]
        admitted = self._admit()  # (admitted requests prefill first: none decodes yet)
        return Plan(prefill=self._chunks(), decode=decoding, preempted=preempted, admitted=admitted, steps=steps)

    def _lacking(self, decoding: list[Seq], steps: int) -> list[int]:
        """Pages each decoding request lacks for a scan of `steps` steps."""
        ps = self.page_size
        return [max(0, pages_for(s.computed + min(steps, max(s.remaining, 1)), ps)
                    - len(s.pages)) for s in decoding]

    def _grow_decodes(self, decoding: list[Seq], steps: int) -> tuple[int, list[Seq]]:
        """Pages for `steps` steps of the decoding requests (fewer steps if pages run short;
        preempting the newest requests if even one step does not fit). Returns (steps, preempted)."""
        lacking = self._lacking(decoding, steps)
        while steps > 1 and sum(lacking) > self.pool.available():
            steps //= 2
            lacking = self._lacking(decoding, steps)
        if sum(lacking) <= self.pool.available():  # (most iterations) every request gets its pages
            for seq, n in zip(decoding, lacking):
                if n:
                    seq.pages += self.pool.allocate(n)
            return steps, []
        preempted = []  # the oldest requests first, the newest preempted for them
        for seq in decoding:
            if seq.state != DECODE:  # preempted below while serving an older request
                continue
            while pages_for(seq.computed + min(steps, max(seq.remaining, 1)), self.page_size) > len(seq.pages):
                if self.pool.available() > 0:
                    seq.pages += self.pool.allocate(1)
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
        return steps, preempted

    def preempt(self, seq: Seq) -> None:
        """Release a running request's pages and queue it to be recomputed (prompt + tokens so far)."""
        self._preempt(seq)

    def _preempt(self, seq: Seq) -> None:
        self._release(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.add(seq)

    def _admit(self) -> list[Seq]:
        admitted, deferred = [], []
        if not (self.waiting and self._free_slots):
            return admitted
        coming = self._pages_coming() if self.prefix_cache else set()
        while self.waiting and self._free_slots:
            seq = self.waiting[0]
            ctx = seq.context
            cached, hashes = [], []
            if self.prefix_cache:  # full pages only, and never the last token (its logits are needed)
                usable = len(ctx) - 1 if seq.recompute_from is None else max(0, seq.recompute_from - 1)
                n = usable // self.page_size
                hashes = (self._prompt_keys(seq, n) if not seq.generated
                          else prefix_hashes(ctx, self.page_size, n, seq.cache_salt))
                cached = self.pool.match(hashes)
                if len(cached) < len(hashes) and hashes[len(cached)] in coming:
                    # its next prefix page is being computed by a request admitted earlier: wait
                    # for it (a step or two) instead of computing the same keys twice
                    deferred.append(self.waiting.pop(0))
                    continue
            need = pages_for(len(ctx), self.page_size) - len(cached)
            held_evictable = sum(self.pool.refcount[p] == 0 for p in cached)
            if need > self.pool.available() - held_evictable:
                break
            self.waiting.pop(0)
            self.pool.acquire(cached)
            seq.pages = list(cached) + self.pool.allocate(need)
            seq.computed = seq.cached_tokens = len(cached) * self.page_size
            seq.slot = self._free_slots.pop(0)
            seq.state = PREFILL
            self.running.append(seq)
            admitted.append(seq)
            coming |= set(hashes[len(cached):])  # what this one will compute, for the ones after it
        for seq in deferred:
            bisect.insort(self.waiting, seq, key=lambda s: s.rid)
        return admitted

    def _pages_coming(self) -> set[bytes]:
        """Prefix keys of the full prompt pages that requests still prefilling will compute."""
        out = set()
        for seq in self.running:
            if seq.state == PREFILL:
                n = (len(seq.prompt) - 1) // self.page_size
                done = seq.computed // self.page_size
                if done < n:
                    out.update(self._prompt_keys(seq, n)[done:])
        return out

    def _chunks(self) -> list[Chunk]:
        budget, out = self.prefill_chunk, []
        for seq in self.running:
            if budget == 0:
                break
            if seq.state != PREFILL:
                continue
            n = min(len(seq.context) - seq.computed, budget)
            budget -= n
            out.append(Chunk(seq=seq, start=seq.computed, n=n, last=seq.computed + n == len(seq.context)))
        return out

    def join(self, chunk: Chunk, steps: int) -> int:
        """Tokens (its first included) the request whose context ends in `chunk` may sample in
        this iteration: its first token in the chunk's call, then decode steps up to `steps` in
        all, as far as its pages (grown here from free pages, never by preempting) hold them."""
        seq = chunk.seq
        want = min(steps, max(seq.remaining, 1))
        end = len(seq.context)  # the first token is sampled after position end - 1; later ones are written
        short = pages_for(end + want - 1, self.page_size) - len(seq.pages)
        if short > 0:
            seq.pages += self.pool.allocate(min(short, self.pool.available()))
        return max(1, min(want, len(seq.pages) * self.page_size - end + 1))

    # ---- reports from the engine --------------------------------------------------------------
    def prefilled(self, chunk: Chunk) -> None:
        """The chunk's keys/values are written: count them and offer full prompt pages to the cache."""
        seq = chunk.seq
        seq.computed = chunk.start + chunk.n
        if self.prefix_cache:
            # Only prompt pages: their keys/values came from a prefill, as a later request's would.
            full = min(seq.computed, len(seq.prompt)) // self.page_size
            for i, h in enumerate(self._prompt_keys(seq, full)):
                self.pool.register(h, seq.pages[i])

    def _prompt_keys(self, seq: Seq, n: int) -> list[bytes]:
        """The prefix-cache keys of seq's first n full prompt pages (`prefix_hashes`), each
        computed once per request: the chain of keys goes on from the last one kept."""
        have = len(seq.prompt_keys)
        if have < n:
            ps = self.page_size
            seq.prompt_keys += prefix_hashes(seq.prompt[have * ps:], ps, n - have,
                                             seq.prompt_keys[-1] if have else seq.cache_salt)
        return seq.prompt_keys[:n]

    def sampled(self, seq: Seq, token: int) -> None:
        """A new token was sampled for seq (after its last prefill chunk or a decode step)."""
        if seq.state == DECODE:
            seq.computed += 1  # the previous token's keys/values were written by the decode step
        seq.generated.append(token)
        seq.state = DECODE

    def sampled_many(self, seq: Seq, tokens: list[int]) -> None:
        """`sampled` for each of these tokens, in order."""
        if tokens:
            seq.computed += len(tokens) - (seq.state != DECODE)
            seq.generated += tokens
            seq.state = DECODE

    def finish(self, seq: Seq, poisoned: bool = False) -> None:
        """seq is done (stopped, at its length, cancelled or failed): free its slot and pages at
        once. `poisoned`: it failed for non-finite values, so its pages may hold inf or NaN: they
        leave the prefix cache and are scrubbed before anyone gets them again (`PagePool.poison`)."""
        if seq.state == WAITING:
            self.waiting.remove(seq)
        elif seq.state != DONE:
            if poisoned:
                self.pool.poison(seq.pages)
            self._release(seq)
        seq.state = DONE

    def _release(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.pool.release(seq.pages)
        seq.pages = []
        bisect.insort(self._free_slots, seq.slot)
        seq.slot = None


def one_call(chunks: list[Chunk], slots: int, buckets: list[int], wide: list[tuple[int, int]],
             fixed_rows: int, seconds: Optional[dict[tuple[int, int], float]] = None) -> list[Chunk]:
    """The chunks one device call runs; the others wait for a later iteration.

    A call is [1, C] for the oldest chunk (C the smallest of `buckets` that holds it), or [R, C]
    (a shape of `wide`) for up to R chunks of at most C tokens each, whichever prefills the most
    prompt tokens per unit of the call's cost: its measured `seconds` per (R, C) shape when given
    for every shape, else its token rows, counting the call's decode rows (`slots`) and its fixed
    cost in rows (`fixed_rows`). The oldest chunk alone may be cut to its `first_piece` (300
    tokens as 256 now and 44 in the next call, not one 512-row call), the rest waiting for the
    next iteration.

    Measured seconds decide better than rows where they are known: `fixed_rows` is a line fitted
    through every shape's time, and on a busy CPU its intercept wanders (22 to 75 rows between
    warmups here). At 49 it sent two short chunks to an [8, 16] call (265 ms) rather than one to
    a [1, 16] call (80 ms), and the other in the next iteration's.
    """
    fixed = fixed_rows + slots
    shapes = [(1, c) for c in buckets] + list(wide)
    if seconds is not None and all(s in seconds for s in shapes):
        cost = lambda R, C: seconds[R, C]  # noqa: E731
    else:
        cost = lambda R, C: fixed + R * C  # noqa: E731
    best = [chunks[0]]
    best_rate = chunks[0].n / cost(1, next(c for c in buckets if c >= chunks[0].n))
    for R, C in wide:
        fit = [c for c in chunks if c.n <= C][:R]
        rate = sum(c.n for c in fit) / cost(R, C)
        if len(fit) > 1 and rate > best_rate:
            best, best_rate = fit, rate
    if len(best) == 1:
        n = first_piece(best[0].n, buckets, fixed)
        if n < best[0].n:
            best = [dataclasses.replace(best[0], n=n, last=False)]
    return best


def first_piece(n: int, buckets: list[int], fixed: int) -> int:
    """The tokens a [1, C] call should prefill of a chunk of n: all n (C the smallest bucket that
    holds them, padded), or a smaller bucket's worth, the rest in later calls, whichever prefills
    the n tokens in the fewest token rows, each call costing `fixed` rows more than its C.

    Buckets are powers of two, so a prompt can be padded to nearly twice its rows (257 tokens in a
    512-row call). Cutting adds a call, so it can only pay where the padding it saves exceeds
    `fixed`; ties keep the single call, whose first token comes sooner (measured on the serving
    load test's workload: docs/notes/probes.md, chunk_cut).
    """
    up = sorted(buckets)
    if n > up[-1] or up[bisect.bisect_left(up, n)] - n <= fixed:
        return n
    # cost[m]: (rows, calls) to prefill m tokens; first[m]: its first call's tokens. Among equal
    # costs the fewest calls, then the largest first piece.
    cost, first = [(0, 0)] * (n + 1), [0] * (n + 1)
    for m in range(1, n + 1):
        cost[m], first[m] = (fixed + up[bisect.bisect_left(up, m)], 1), m
        for b in reversed(up[:bisect.bisect_left(up, m)]):  # the buckets below m, largest first
            rows, calls = cost[m - b]
            if (fixed + b + rows, calls + 1) < cost[m]:
                cost[m], first[m] = (fixed + b + rows, calls + 1), b
    return first[n]


MAX_CALL_ROWS = 1 << 16  # the fixed cost `call_rows` reports when no measured shape costs more than another


def call_rows(samples: list[tuple[int, float]]) -> int:
    """A device call's fixed cost in token rows (`one_call`'s `fixed_rows`), from (token rows,
    seconds) of calls of different shapes: the least-squares line seconds = a + b x rows gives
    a / b. Where every shape costs the same (a GPU reading a small model's weights: the fixed cost
    dominates each), the line is flat and the cost is MAX_CALL_ROWS: the most tokens per call wins."""
    rows = [r for r, _ in samples]
    if len(set(rows)) < 2:
        raise ValueError(f"call_rows needs calls of at least two sizes, got rows {rows}")
    mx, my = sum(rows) / len(samples), sum(t for _, t in samples) / len(samples)
    slope = sum((r - mx) * (t - my) for r, t in samples) / sum((r - mx) ** 2 for r in rows)
    if slope * MAX_CALL_ROWS <= my - slope * mx:  # flat, falling, or a fixed cost beyond MAX_CALL_ROWS
        return MAX_CALL_ROWS
    return max(0, round((my - slope * mx) / slope))
