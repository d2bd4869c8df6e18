"""The serving engine's host side without a model: page allocator, prefix cache, scheduler policy."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from jaxinfer.serve.pages import OutOfPages, PagePool, prefix_hashes
from jaxinfer.serve.scheduler import MAX_CALL_ROWS, DECODE, DONE, PREFILL, Chunk, Scheduler, Seq, call_rows, first_piece, one_call


def test_allocate_release_and_trash_page():
    pool = PagePool(5, 4)
    pages = pool.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and pool.in_use == 4 and pool.available() == 0
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    pool.release(pages[:2])
    assert pool.in_use == 2 and pool.available() == 2
    with pytest.raises(ValueError, match="not held"):
        pool.release(pages[:1])
    pool.check([pages[2:]])


def test_prefix_hashes_key_the_whole_prefix():
    a = prefix_hashes([1, 2, 3, 4, 5, 6], 2, 3)
    b = prefix_hashes([9, 2, 3, 4, 5, 6], 2, 3)
    assert a[0] != b[0] and a[2] != b[2]  # same last page, different prefix: different key
    assert prefix_hashes([1, 2, 3, 4, 7], 2, 2) == a[:2]
    with pytest.raises(ValueError, match="not full"):
        prefix_hashes([1, 2, 3], 2, 2)


def test_prompt_keys_are_prefix_hashes_computed_once_per_request():
    """The scheduler keeps a request's prompt keys and extends them page by page (the chain goes
    on from the last key): they equal prefix_hashes of the whole prompt, salt included."""
    sched = Scheduler(PagePool(8, 4), n_slots=1, prefill_chunk=8)
    for salt in (b"", b"steered"):
        seq = Seq(rid=0, prompt=list(range(3, 40)), max_new_tokens=1, cache_salt=salt)
        for n in (0, 2, 1, 5, 9, 3):
            assert sched._prompt_keys(seq, n) == prefix_hashes(seq.prompt, 4, n, salt)
        assert len(seq.prompt_keys) == 9


def test_prefix_cache_share_refcount_and_lru_eviction():
    pool = PagePool(4, 2)
    h = prefix_hashes([1, 2, 3, 4, 5, 6], 2, 3)
    a = pool.allocate(2)
    pool.register(h[0], a[0])
    pool.register(h[1], a[1])
    assert pool.match(h) == a  # the third page was never cached
    pool.acquire(a)  # a second request shares both pages
    assert pool.refcount[a[0]] == 2 and pool.hit_pages == 2
    pool.release(a)
    pool.release(a)
    assert pool.in_use == 0 and pool.cached == 2  # unreferenced but kept
    pool.check([])
    pool.acquire(pool.match(h[:1]))  # touch page 0: page 1 is now least recently used
    pool.release([a[0]])
    got = pool.allocate(2)  # one free page, then evicts the LRU cached page (a[1])
    assert a[1] in got and a[0] not in got and pool.evictions == 1
    assert pool.match(h) == [a[0]]
    pool.check([got])


def test_poisoned_pages_leave_the_prefix_cache_and_are_free_only_once_scrubbed():
    """Pages of a request failed for inf/NaN: never matched again, not free (nor available) until
    every holder released them and the device zeroed them; a rebuilt pool frees them at once."""
    pool = PagePool(5, 2)
    h = prefix_hashes([1, 2, 3, 4], 2, 2)
    a = pool.allocate(2)
    pool.register(h[0], a[0])
    pool.acquire([a[0]])  # a second request shares the first page
    pool.poison(a)
    assert pool.match(h) == [] and not pool.scrub_wanted()
    pool.release(a)  # the shared page is still held
    assert pool.take_to_scrub() == [a[1]] and pool.available() == 2 and pool.in_use == 1
    pool.check([[a[0]]])
    pool.release([a[0]])
    assert sorted(pool.take_to_scrub()) == sorted(a) and pool.available() == 2 and pool.in_use == 0
    pool.check([])
    pool.scrubbed([a[1]])
    assert pool.take_to_scrub() == [a[0]] and pool.available() == 3
    pool.forget()  # a new pool holds zeros
    assert not pool.scrub_wanted() and pool.available() == 4
    pool.check([])
    b = pool.allocate(1)
    pool.poison(b)
    pool.forget()  # held pages are no longer poisoned: released into the free list
    pool.release(b)
    assert not pool.scrub_wanted() and pool.available() == 4
    with pytest.raises(ValueError, match="not held"):
        pool.poison(b)


def _drive(sched: Scheduler, seqs, rng: random.Random, cancel_p: float, max_steps: int = 5000):
    """Run the scheduler as the engine does (an iteration runs some of the plan's chunks, those
    that end their context join with `join`'s budget, decodes take up to `steps` tokens), with
    random tokens; check invariants every step."""
    pending = list(seqs)
    live = []
    for _ in range(max_steps):
        while pending and rng.random() < 0.5:  # random arrivals
            s = pending.pop(0)
            sched.add(s)
            live.append(s)
        for s in list(live):  # random cancellations, in any state
            if s.state != DONE and rng.random() < cancel_p:
                sched.finish(s, poisoned=rng.random() < 0.5)  # cancelled, or failed for inf/NaN
        if rng.random() < 0.5:  # the engine zeroes the poisoned pages no one holds (a step or more later)
            sched.pool.scrubbed(sched.pool.take_to_scrub())
        steps = rng.choice([1, 2, 4])
        plan = sched.schedule(steps)
        slots = [s.slot for s in sched.running]
        assert len(set(slots)) == len(slots) and all(0 <= x < sched.n_slots for x in slots)
        assert sum(c.n for c in plan.prefill) <= sched.prefill_chunk
        chunks = plan.prefill[:rng.randint(1, len(plan.prefill))] if plan.prefill else []  # the runner's pick
        for c in chunks:
            assert c.seq.state == PREFILL and c.n > 0
            assert len(c.seq.pages) * sched.page_size >= c.start + c.n  # its pages cover the chunk
            budget = sched.join(c, plan.steps) if c.last else 0
            sched.prefilled(c)
            if c.last:
                assert 1 <= budget <= max(1, min(plan.steps, c.seq.remaining))
                # the first token is sampled, the rest written: pages cover positions < len(ctx) + budget - 1
                assert len(c.seq.pages) * sched.page_size >= len(c.seq.context) + budget - 1
                for _ in range(min(budget, c.seq.remaining)):
                    sched.sampled(c.seq, rng.randrange(4))
        for s in plan.decode:
            assert s.state == DECODE
            n = min(plan.steps, s.remaining)
            assert len(s.pages) * sched.page_size >= s.computed + n  # every token written fits
            for _ in range(n):
                sched.sampled(s, rng.randrange(4))
        for s in list(sched.running):
            if s.state == DECODE and len(s.generated) >= s.max_new_tokens:
                sched.finish(s)
        sched.pool.check([s.pages for s in sched.running])
        assert all(not s.pages for s in sched.waiting)
        if not pending and sched.idle():
            break
    assert not pending and sched.idle(), "requests left unfinished"
    assert sched.pool.in_use == 0  # no leak: every page is free or cached when idle
    for s in seqs:
        assert s.state == DONE
        assert len(s.generated) <= s.max_new_tokens


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n_pages=st.integers(4, 24), page_size=st.sampled_from([1, 2, 4]),
       n_slots=st.integers(1, 5), chunk=st.integers(1, 9), prefix=st.booleans(),
       cancel_p=st.sampled_from([0.0, 0.02]))
def test_scheduler_fuzz_invariants(seed, n_pages, page_size, n_slots, chunk, prefix, cancel_p):
    """Random arrivals, lengths, shared prefixes and cancellations (some as failures whose pages
    are poisoned) on a small pool: no page owned twice, no leak, every request finishes or is
    cancelled (preemption keeps the oldest going)."""
    rng = random.Random(seed)
    sched = Scheduler(PagePool(n_pages, page_size), n_slots, chunk, prefix_cache=prefix)
    capacity = (n_pages - 1) * page_size
    shared = [rng.randrange(4) for _ in range(capacity)]
    seqs = []
    for rid in range(rng.randint(1, 12)):
        total = rng.randint(2, capacity)
        n_prompt = rng.randint(1, total - 1)
        prompt = shared[:n_prompt] if rng.random() < 0.5 else [rng.randrange(4) for _ in range(n_prompt)]
        seqs.append(Seq(rid=rid, prompt=prompt, max_new_tokens=total - n_prompt))
    _drive(sched, seqs, rng, cancel_p)


def test_preemption_takes_the_newest_and_recomputes_its_context():
    sched = Scheduler(PagePool(5, 2), n_slots=2, prefill_chunk=8, prefix_cache=False)
    a, b = Seq(rid=0, prompt=[1, 2, 3], max_new_tokens=5), Seq(rid=1, prompt=[4, 5, 6], max_new_tokens=5)
    sched.add(a), sched.add(b)
    plan = sched.schedule()
    assert plan.admitted == [a, b] and [c.seq for c in plan.prefill] == [a, b]
    for c in plan.prefill:
        sched.prefilled(c), sched.sampled(c.seq, 7)
    # 4 pages held; a's next token (position 3) fits its second page; step until someone needs a 5th
    preempted = []
    while not preempted:
        plan = sched.schedule()
        preempted = plan.preempted
        for s in plan.decode:
            sched.sampled(s, 7)
    assert preempted == [b] and b.state == "waiting" and b.computed == 0 and b.pages == []
    assert b.context == [4, 5, 6] + b.generated  # recomputed later from prompt + tokens so far
    assert a.state == DECODE


def test_a_prefix_being_computed_is_waited_for_not_computed_twice():
    """Two requests with the same 3-page prefix arrive together: the second waits until the
    first has computed those pages, then takes them from the prefix cache."""
    sched = Scheduler(PagePool(20, 4), n_slots=2, prefill_chunk=4, prefix_cache=True)
    shared = list(range(10, 22))
    a = Seq(rid=0, prompt=shared + [1, 2], max_new_tokens=2)
    b = Seq(rid=1, prompt=shared + [3], max_new_tokens=2)
    sched.add(a), sched.add(b)
    plan = sched.schedule()
    assert plan.admitted == [a] and b.state == "waiting"  # b's first page is a's to compute
    while b.state == "waiting":
        for c in plan.prefill:
            sched.prefilled(c)
            if c.last:
                sched.sampled(c.seq, 7)
        plan = sched.schedule()
    assert b.cached_tokens == 12 and sched.pool.hit_pages == 3  # all three shared pages reused


def test_one_call_takes_the_oldest_alone_or_many_short_chunks_together():
    """[1, C] for one chunk, [slots, C] for many short ones, counting the call's fixed rows."""
    seqs = [Seq(rid=i, prompt=[1] * 600, max_new_tokens=4) for i in range(9)]
    chunk = lambda i, n: Chunk(seq=seqs[i], start=0, n=n, last=True)  # noqa: E731
    buckets, wide = [32, 64, 128, 256, 512], [(8, 32), (8, 64)]
    assert one_call([chunk(0, 20)], 8, buckets, wide, 32) == [chunk(0, 20)]
    # three short prompts: one [1, 32] call (20 tokens / 72 rows) beats [8, 32] (60 / 296)
    three = [chunk(i, 20) for i in range(3)]
    assert one_call(three, 8, buckets, wide, 32) == three[:1]
    # eight of them: [8, 32] (160 / 296) beats one alone
    eight = [chunk(i, 20) for i in range(8)]
    assert one_call(eight + [chunk(8, 20)], 8, buckets, wide, 32) == eight
    # a long chunk first is taken alone (512 / 552) over the short ones behind it
    assert one_call([chunk(0, 512)] + eight[1:], 8, buckets, wide, 32) == [chunk(0, 512)]
    # short chunks that do not fit the wide bucket are left for later: [8, 64] holds those <= 64
    mixed = [chunk(0, 100)] + [chunk(i, 60) for i in range(1, 8)]
    assert one_call(mixed, 8, buckets, wide, 32) == mixed[1:]
    # the oldest (100 tokens) and two of 60 with a [4, 64] shape too: at a fixed cost of 32 rows
    # (a CPU) [1, 128] wins (100 / 168 rows against 120 / 296); at 700 (a GPU) [4, 64] does
    # (120 / 964 against 100 / 836), and over [8, 64] (120 / 1,220) for its fewer rows
    four = wide + [(4, 64)]
    assert one_call(mixed[:3], 8, buckets, four, 32) == mixed[:1]
    assert one_call(mixed[:3], 8, buckets, four, 700) == mixed[1:3]


def test_one_call_weighs_shapes_by_their_measured_seconds_when_it_has_them():
    """With every shape's measured seconds, one_call compares prompt tokens per second, not per
    row of a fitted line: two short chunks at a fitted fixed cost of 49 rows go to one [8, 16]
    call by rows (19 / 185 rows against 7 / 73), but a [1, 16] call for the oldest alone wins at
    a 2-core CPU's measured 80 ms against 265 ms; where every call costs about the same (a GPU)
    the wide call wins. Seconds missing a shape are not used."""
    seqs = [Seq(rid=i, prompt=[1] * 600, max_new_tokens=4) for i in range(3)]
    two = [Chunk(seq=seqs[0], start=0, n=7, last=True), Chunk(seq=seqs[1], start=0, n=12, last=True)]
    buckets, wide = [16, 32, 64], [(8, 16), (8, 32)]
    cpu = {(1, 16): 0.080, (1, 32): 0.113, (1, 64): 0.144, (8, 16): 0.265, (8, 32): 0.415}
    assert one_call(two, 8, buckets, wide, 49) == two
    assert one_call(two, 8, buckets, wide, 49, cpu) == two[:1]
    assert one_call(two, 8, buckets, wide, 49, {k: 0.03 for k in cpu}) == two
    assert one_call(two, 8, buckets, wide, 49, {k: v for k, v in cpu.items() if k != (8, 32)}) == two


def test_one_call_cuts_the_oldest_chunk_where_padding_costs_more_than_a_call():
    """first_piece: the tokens of a chunk its call prefills, all of them padded to a bucket or a
    smaller bucket's worth, whichever prefills the chunk in the fewest rows at `fixed` rows a call."""
    buckets = [32, 64, 128, 256, 512]
    # 321 tokens: 256 + 64 + 1 (padded to 32) in 3 calls, 352 + 3 x 40 rows, against 512 + 40 in one
    assert first_piece(321, buckets, 40) == 256
    assert first_piece(65, buckets, 40) == 65  # 128 + 40 in one call, against 64 + 32 + 2 x 40
    # padding of at most one call's cost is kept (200 in a 256 call: 56 rows of padding, 40 a call)
    assert first_piece(480, buckets, 40) == 480 and first_piece(200, buckets, 40) == 200
    assert first_piece(70, buckets, 0) == 64  # 64 + 32 rows, against 128
    assert first_piece(40, buckets, 0) == 40  # 64 rows either way (8 tokens pad to 32): one call
    assert first_piece(20, buckets, 0) == 20 and first_piece(512, buckets, 0) == 512
    assert first_piece(600, buckets, 0) == 600  # beyond every bucket: not the scheduler's chunk
    seqs = [Seq(rid=i, prompt=[1] * 600, max_new_tokens=4) for i in range(2)]
    long = Chunk(seq=seqs[0], start=100, n=321, last=True)
    (cut,) = one_call([long, Chunk(seq=seqs[1], start=0, n=20, last=True)], 8, buckets, [(8, 32)], 32)
    assert (cut.seq, cut.start, cut.n, cut.last) == (seqs[0], 100, 256, False)
    assert long.n == 321  # the scheduler's chunk is left as it was: the rest comes next iteration


def test_join_grows_pages_for_the_tokens_a_joining_request_samples():
    sched = Scheduler(PagePool(7, 4), n_slots=2, prefill_chunk=16, prefix_cache=False)
    a = Seq(rid=0, prompt=[1, 2, 3, 4, 5], max_new_tokens=8)
    sched.add(a)
    (c,) = sched.schedule(8).prefill
    assert len(a.pages) == 2 and c.last
    # first token after position 4, then 7 written at positions 5..11: 3 pages in all
    assert sched.join(c, 8) == 8 and len(a.pages) == 3
    sched.prefilled(c), sched.sampled(a, 7)
    b = Seq(rid=1, prompt=[6] * 12, max_new_tokens=8)
    sched.add(b)
    (c,) = sched.schedule(8).prefill
    assert len(b.pages) == 3 and sched.pool.available() == 0
    # no page left: its first token, and the token at position 12 has no page: 1 token this iteration
    assert sched.join(c, 8) == 1 and len(b.pages) == 3


def test_call_rows_is_the_fixed_cost_of_a_call_in_token_rows():
    """From (rows, seconds) of calls of several shapes: intercept over slope; flat -> the most."""
    assert call_rows([(64, 0.040 + 64e-3), (96, 0.040 + 96e-3), (1056, 0.040 + 1056e-3)]) == 40
    assert call_rows([(40, 0.005), (72, 0.005), (1056, 0.005)]) == MAX_CALL_ROWS  # every shape the same
    assert call_rows([(40, 0.006), (72, 0.005), (1056, 0.004)]) == MAX_CALL_ROWS  # noise falling
    assert call_rows([(40, 0.0), (1040, 1.0)]) == 0  # a line through the origin (clipped at 0 below it)
    with pytest.raises(ValueError, match="two sizes"):
        call_rows([(40, 0.1), (40, 0.2)])
