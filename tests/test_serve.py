"""The serving engine on a tiny random model: every request's tokens equal `generate` alone."""

import asyncio
import dataclasses

import jax
import numpy as np
import pytest

import jaxinfer
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.model import config
from jaxinfer.model.model import Model
from jaxinfer.model.params import init_params
from jaxinfer.serve import Engine
from jaxinfer.serve.scheduler import Chunk, Seq
from tests.compiling import optimized
from tests.tolerances import assert_close, smollm2_fp32_error

SETTINGS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20),
            SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05)]
ENGINE = dict(max_slots=4, page_size=8, max_len=64, prefill_chunk=16)  # one width, one chunk bucket


class CharTokenizer:
    """Two letters per token (so a string can span tokens); id 2 is the stop id."""

    bos_id, add_bos, stop_ids = None, False, (2,)

    def encode(self, text):
        return [(ord(a) - 97) + 26 * (ord(b) - 97) for a, b in zip(text[::2], text[1::2])]

    def decode(self, ids):
        return "".join(chr(97 + t % 26) + chr(97 + (t // 26) % 26) for t in ids)


def tiny_model(**overrides):
    cfg = config.tiny(**overrides)
    return Model(config=cfg, params=init_params(cfg, jax.random.key(0)), tokenizer=CharTokenizer())


@dataclasses.dataclass
class Spec:
    prompt: list
    max_new_tokens: int
    sampling: SamplingParams
    seed: int


def make_specs(n, seed=0, settings=SETTINGS):
    rng = np.random.default_rng(seed)
    shared = list(map(int, rng.integers(3, 256, 24)))  # 3 full pages: the prefix cache's share
    specs = []
    for i in range(n):  # prompts <= 31 tokens and <= 32 new ones: few programs for generate too
        n_prompt = int(rng.integers(3, 32))
        own = list(map(int, rng.integers(3, 256, n_prompt)))
        prompt = (shared + own)[:max(n_prompt, 26)] if i % 3 == 0 else own
        specs.append(Spec(prompt, int(rng.integers(1, 33)), settings[i % len(settings)], 1000 + i))
    return specs


def reference(model, specs):
    return [jaxinfer.generate(model, [s.prompt], seed=s.seed, sampling=s.sampling, max_new_tokens=s.max_new_tokens).completions[0] for s in specs]


def submit(engine, s, **kw):
    return engine.submit(s.prompt, max_new_tokens=s.max_new_tokens, sampling=s.sampling, seed=s.seed, **kw)


def run_staggered(engine, specs):
    """Submit two requests, step, two more, step...: each arrives while others run."""
    reqs = []
    for i in range(0, len(specs), 2):
        reqs += [submit(engine, s) for s in specs[i:i + 2]]
        engine.step()
    engine.run_until_idle()
    return [r.result() for r in reqs]


def assert_same(got, want, fp32_error=None, kv_dtype="float32"):
    """Tokens, text and finish reason identical; logprobs within the parity tolerance (`fp32_error`:
    the model's measured float32 error, None for the tiny random models). A coarser KV cache turns
    a last-bit difference in a key (prompts chunked differently) into a whole step of its own grid,
    so its logprobs get that step's bound instead of float32 error: one float16 rounding of the
    logprobs' scale for "float16", 1e-2 for "int8" (1/127 of the head's absmax per entry)."""
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"request {i}: {g.token_ids} != {w.token_ids}"
        if kv_dtype == "int8":
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-2, err_msg=f"request {i} logprobs")
            continue
        assert_close(g.logprobs, w.logprobs, fp32_error=fp32_error, dtype=kv_dtype,
                     what=f"request {i} logprobs vs generate")
        assert (g.text, g.finish_reason) == (w.text, w.finish_reason)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def specs_and_ref(model):
    specs = make_specs(18)
    return specs, reference(model, specs)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_identity_staggered_mixed_requests_no_compiles_after_warmup(model, specs_and_ref, prefix_cache):
    """18 requests (mixed seeds, settings, lengths, shared prefixes) arriving at staggered steps:
    tokens equal generate alone; with the prefix cache the shared pages are reused; after warmup
    nothing compiles."""
    specs, want = specs_and_ref
    engine = Engine(model, n_pages=40, prefix_cache=prefix_cache, **ENGINE)
    engine.warmup()
    with CompileCounter() as compiles:
        got = run_staggered(engine, specs)
    assert compiles.count == 0
    assert_same(got, want)
    st = engine.stats()
    assert st.pages_in_use == 0 and st.running == 0 and st.waiting == 0 and st.requests_finished == len(specs)
    assert st.tokens_generated == sum(len(c.token_ids) for c in want)
    assert (st.prefix_hit_pages > 0) == prefix_cache


def test_identity_with_preemption_in_a_tiny_pool(model, specs_and_ref):
    """A pool of 11 pages (88 tokens) for 4 slots: requests are preempted and recomputed, and
    still give generate's tokens."""
    specs, want = specs_and_ref
    engine = Engine(model, n_pages=12, **ENGINE)
    got = run_staggered(engine, specs)
    assert engine.stats().preemptions > 0
    assert_same(got, want)
    assert engine.stats().pages_in_use == 0


def test_scans_chain_while_requests_wait_for_a_full_set_of_slots(model, specs_and_ref):
    """18 requests at once for 4 slots: while requests wait and every slot is taken, the next
    scan is chained (dispatched before the last one is read) unless a row may end by its length
    in the scan under way; every other call goes on from the slots on the device too (the host
    builds whole slot tables for the first call only); the tokens still equal generate alone."""
    specs, want = specs_and_ref
    engine = Engine(model, n_pages=40, **ENGINE)
    runner = engine.runner
    chained, tables, chain, build = [], [], runner.chain, runner._tables

    def counted(*args):
        chained.append(len(engine.scheduler.waiting))
        return chain(*args)

    runner.chain = counted
    runner._tables = lambda *args: tables.append(1) or build(*args)
    reqs = [submit(engine, s) for s in specs]
    engine.run_until_idle()
    assert_same([r.result() for r in reqs], want)
    assert any(chained), chained  # some scans went on while requests waited
    assert len(tables) == 1 and engine.scans > len(chained) + 1


def test_decode_results_by_slot():
    """A flight's decode block [steps, S] as each slot's tokens: a slot that emitted at every
    step, at the first steps (it ended), from a later step (it joined after the mixed call), or
    not at all; the steps some slot emitted at; the alternatives of the tokens kept."""
    from jaxinfer.serve.runner import DecodeOut

    count = np.array([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 0]], np.int32)  # [steps 3, slots 4]
    tokens = np.arange(12, dtype=np.int32).reshape(3, 4)
    logprobs = -tokens.astype(np.float32)
    top_ids = np.stack([tokens * 10, tokens * 10 + 1], axis=-1)  # [3, 4, 2]
    out = DecodeOut(tokens=tokens, logprobs=logprobs, count=count, top=(top_ids, -top_ids.astype(np.float32)))
    block = out.by_slot()
    assert block.tokens == [[0, 4, 8], [1, 5], [6, 10], []]
    assert block.logprobs == [[-0.0, -4.0, -8.0], [-1.0, -5.0], [-6.0, -10.0], []]
    assert block.steps_run == 3
    assert block.tops(2, 1) == [[(60, -60.0)], [(100, -100.0)]] and block.tops(1, 0) == [(), ()]
    assert DecodeOut(tokens=tokens, logprobs=logprobs, count=0 * count, top=None).by_slot().steps_run == 0


def test_plain_deliveries_take_the_plain_path_only_when_nothing_ends():
    """Live.take_plainly: a request with no constraint, stop strings, penalties or alternatives
    keeps tokens that hold no stop id or invalid token and leave it below max_new_tokens, and
    returns their text (as `accept` and `delta` would); other tokens are left to `accept`."""
    from jaxinfer.serve.live import Live
    from jaxinfer.text.stream import Detokenizer, StopStrings

    def live(**kw):
        seq = Seq(rid=0, prompt=[5, 6], max_new_tokens=6, generated=[7])
        kw = dict(stop=None, n_top=0) | kw
        return Live(seq=seq, req=None, key_data=np.zeros(2, np.uint32), sampling=SamplingParams(), stop_ids=(2,),
                    detok=Detokenizer(CharTokenizer().decode), prompt_logprobs=None, score_from=1, **kw)

    lv = live()
    for ends in ([3, 2, 5], [3, -1], [3, 4, 5, 6, 8]):  # a stop id; nothing to sample; its 6th token
        assert lv.take_plainly(ends, [0.0] * len(ends)) is None and lv.logprobs == [] and lv.text == ""
    assert lv.plain and lv.take_plainly([], []) == ""
    assert lv.take_plainly([3, 4], [-0.5, -0.25]) == CharTokenizer().decode([3, 4]) and lv.logprobs == [-0.5, -0.25]
    assert lv.text == CharTokenizer().decode([3, 4]) and lv.sent == len(lv.text)
    for kw in (dict(stop=StopStrings(["x"])), dict(n_top=2), dict(counts=np.zeros(8, np.int32))):
        assert not live(**kw).plain and live(**kw).take_plainly([3], [0.0]) is None


def test_scan_length_while_a_slot_is_free_follows_admission_wait(model, specs_and_ref):
    """A slot is free (one request on 4 slots): with admission_wait 0 every scan decodes one step
    (a request arriving then waits one step for its slot); with a long wait the scans run up to
    decode_steps. Scan lengths only move host syncs: the tokens are generate's either way."""
    specs, want = specs_and_ref
    s, w = next((s, w) for s, w in zip(specs, want) if len(w.token_ids) >= 12)
    scans = {}
    for wait in (0.0, 1e3):
        engine = Engine(model, n_pages=40, decode_steps=8, admission_wait=wait, **ENGINE)
        got = submit(engine, s).result()
        assert_same([got], [w])
        scans[wait] = engine.stats().scans
        assert engine.step_seconds is not None and engine.step_seconds > 0
    n = len(w.token_ids)
    # one token per iteration, after the first two (busy_decode_steps = 4 tokens each before a step
    # is timed: the second scan is dispatched before the first one's results are read)
    assert scans[0.0] >= n - 6, (scans, n)
    assert scans[1e3] <= 2 + (n - 1 + 7) // 8, (scans, n)
    for bad in (-1, float("nan"), "0.2", True):
        with pytest.raises(ValueError, match="admission_wait must be a finite number of seconds >= 0"):
            Engine(model, n_pages=40, admission_wait=bad, **ENGINE)


def test_warmup_measures_a_calls_fixed_cost_unless_given(model, monkeypatch):
    """warmup times every mixed call shape and fits call_rows (scheduler.call_rows) from them,
    and those times then pick a call's chunks; call_rows given is kept, and its rows pick them. Chunk buckets stop at the longest context (max_len 64: 16, 32 and 64),
    whatever prefill_chunk allows. Timed calls keep the token counts on the device, as serving
    does while nobody is penalized: only the very first call sends them."""
    from jaxinfer.serve import warmup
    from jaxinfer.serve.scheduler import call_rows

    monkeypatch.setattr(warmup, "timings_key", lambda runner, shapes: None)  # no stored seconds: it times them
    engine = Engine(model, max_slots=4, page_size=8, max_len=64, n_pages=40)
    assert engine.runner.chunks == [16, 32, 64] and engine.runner.wide == [(4, 16), (4, 32), (4, 64)]
    sent, counts = [], engine.runner._counts  # True: a call's [S, V] counts built and sent from the host
    monkeypatch.setattr(engine.runner, "_counts",
                        lambda lives: (out := counts(lives)) and sent.append(isinstance(out[0], np.ndarray)) or out)
    engine.warmup()
    mixed = sent[:2 * len(engine.runner.shapes())]  # each shape: two timed runs
    assert mixed[0] is True and not any(mixed[1:]), sent
    monkeypatch.undo()
    times = engine.runner.call_shapes.call_seconds
    assert set(times) == set(engine.runner.shapes()) and all(t > 0 for t in times.values())
    assert engine.stats().call_rows == call_rows([(R * C + 4, t) for (R, C), t in times.items()])
    fixed = Engine(model, max_slots=4, page_size=8, max_len=64, n_pages=40, call_rows=7)
    fixed.warmup()
    assert fixed.stats().call_rows == 7
    # Timed shapes choose a call's chunks by their seconds (scheduler.one_call); with call_rows
    # given, the rows do (7 + 4 rows a call: [4, 16] prefills 40 / 75 rows, [1, 16] 10 / 27).
    seqs = [Seq(rid=i, prompt=[1] * 10, max_new_tokens=1, slot=i) for i in range(4)]
    short = [Chunk(seq=s, start=0, n=10, last=True) for s in seqs]
    for e in (engine, fixed):
        e.runner.call_shapes.call_seconds = {s: 1.0 if s[0] > 1 else 0.1 for s in e.runner.shapes()}
    assert engine.runner.pick(short) == short[:1] and fixed.runner.pick(short) == short
    engine.runner.call_shapes.call_seconds = {s: 0.1 for s in engine.runner.shapes()}
    assert engine.runner.pick(short) == short
    with pytest.raises(ValueError, match="call_rows must be an int >= 0"):
        Engine(model, call_rows=-1, **ENGINE)


def test_mid_row_calls_where_a_call_is_dear(model, specs_and_ref):
    """16 slots and a fixed cost of 10,000 rows (a GPU's ~700, exaggerated): 8-row chunk calls are
    built beside 1- and 16-row ones, a burst of 18 requests is admitted through them, and every
    request's tokens still equal generate alone."""
    specs, want = specs_and_ref
    engine = Engine(model, max_slots=16, page_size=8, max_len=64, n_pages=120, prefill_chunk=64, call_rows=10_000)
    assert engine.runner.wide == [(16, 16), (8, 16)]
    assert Engine(model, max_slots=16, page_size=8, max_len=64, n_pages=120, prefill_chunk=64,
                  call_rows=32).runner.wide == [(16, 16)]  # a CPU's cost: no 8-row calls
    shapes, arrays = [], engine.runner._chunk_arrays
    engine.runner._chunk_arrays = lambda chunks, shape=None: shapes.append(arrays(chunks, shape).tokens.shape) or \
        arrays(chunks, shape)
    reqs = [submit(engine, s) for s in specs]
    engine.run_until_idle()
    assert (8, 16) in shapes
    assert_same([r.result() for r in reqs], want)


def test_identity_when_chunks_are_cut_to_pad_less(model):
    """At a call cost of 0 rows (`call_rows`), chunks are cut at smaller buckets rather than padded
    (a 70-token prompt as 64 + 6, not one 128-token call; `scheduler.first_piece`): every request's
    tokens still equal generate alone, and a scoring request cut the same way gets the uncached
    forward's prompt logprobs."""
    rng = np.random.default_rng(5)
    specs = [Spec(list(map(int, rng.integers(3, 256, n))), int(rng.integers(1, 25)), SETTINGS[i % len(SETTINGS)],
                  2000 + i) for i, n in enumerate((40, 70, 100, 33, 90, 50))]
    want = reference(model, specs)
    engine = Engine(model, max_slots=4, page_size=8, max_len=128, n_pages=80, prefill_chunk=128, call_rows=0)
    assert engine.runner.chunks == [16, 32, 64, 128]
    cuts, pick = [], engine.runner.pick
    engine.runner.pick = lambda chunks, **k: cuts.append((chunks[0].n, out := pick(chunks, **k))) or out
    assert_same(run_staggered(engine, specs), want)
    assert any(len(out) == 1 and out[0].n < n for n, out in cuts), cuts
    prompt = list(range(3, 73))  # 70 tokens: 64 + 6 (padded to 16), not one 128-token call
    cuts.clear()
    scored = engine.submit(prompt, max_new_tokens=0, prompt_logprobs=0)
    engine.run_until_idle()
    assert [out[0].n for _, out in cuts] == [64, 6], cuts
    rows = np.asarray(jax.nn.log_softmax(jaxinfer.logits(model, prompt), axis=-1))
    assert_close(scored.result().prompt_logprobs[1:], [rows[j - 1, prompt[j]] for j in range(1, len(prompt))],
                 what="prompt logprobs")


def test_identity_float16_kv_cache():
    """float16 pages (llama.cpp's default KV dtype, half of float32's bytes): the engine still gives
    generate's tokens on the same cache dtype."""
    model = tiny_model(kv_dtype="float16")
    specs = make_specs(6, seed=2, settings=SETTINGS[:2])
    want = reference(model, specs)
    engine = Engine(model, n_pages=40, **ENGINE)
    assert engine.stats().pool_bytes * 2 == Engine(tiny_model(), n_pages=40, **ENGINE).stats().pool_bytes
    assert_same(run_staggered(engine, specs), want, kv_dtype="float16")


def test_identity_int8_kv_cache():
    model = tiny_model(kv_dtype="int8")
    specs = make_specs(6, seed=1, settings=SETTINGS[:2])
    want = reference(model, specs)
    engine = Engine(model, n_pages=40, **ENGINE)
    assert engine.stats().pool_bytes < Engine(tiny_model(), n_pages=40, **ENGINE).stats().pool_bytes
    assert_same(run_staggered(engine, specs), want, kv_dtype="int8")


def test_stop_string_spanning_tokens_and_streaming(model, specs_and_ref):
    specs, want = specs_and_ref
    s, full = next((s, w) for s, w in zip(specs, want) if len(w.token_ids) >= 8 and w.finish_reason == "length")
    stop = full.text[5:8]  # token 2 decodes to chars 4-5, token 3 to 6-7: the string spans both
    engine = Engine(model, n_pages=40, **ENGINE)
    req = submit(engine, s, stop=[stop, "not-there"])
    deltas = list(req)
    c = req.result()
    expected = full.text[:full.text.find(stop)]
    assert c.text == expected and c.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == expected  # nothing of the stop string was streamed
    assert c.token_ids == full.token_ids[:len(c.token_ids)] and len(c.token_ids) <= 4
    assert [t for d in deltas for t in d.token_ids] == c.token_ids
    assert deltas[-1].finish_reason == "stop" and all(d.finish_reason is None for d in deltas[:-1])


def test_cancel_mid_stream_frees_pages(model, specs_and_ref):
    """A long request cancelled after its first streamed tokens ends "cancelled" with a prefix of
    its tokens; its neighbour is untouched and every page comes back."""
    specs, want = specs_and_ref
    long = Spec(specs[0].prompt[:10], 48, SETTINGS[0], 5)
    full = reference(model, [long])[0]
    engine = Engine(model, n_pages=40, decode_steps=4, **ENGINE)
    other = submit(engine, specs[1])
    req = submit(engine, long)
    seen = []
    for d in req:
        seen += d.token_ids
        if seen and len(seen) < 8:
            req.cancel()
    c = req.result()
    assert c.finish_reason == "cancelled" and c.token_ids == full.token_ids[:len(c.token_ids)]
    assert 1 <= len(c.token_ids) < len(full.token_ids)
    assert other.result().token_ids == want[1].token_ids  # the neighbour is untouched
    engine.run_until_idle()
    assert engine.stats().pages_in_use == 0


def test_refused_at_submit(model):
    with pytest.raises(ValueError, match="max_len 64"):
        Engine(model, n_pages=40, **ENGINE).submit([5] * 40, max_new_tokens=30)
    engine = Engine(model, n_pages=6, **ENGINE)  # 5 pages = 40 tokens
    with pytest.raises(ValueError, match="max_len 40"):  # the pool holds 40 tokens: max_len is capped to it
        engine.submit([5] * 30, max_new_tokens=20)
    assert engine.max_len == 40
    with pytest.raises(ValueError, match="context length 512"):
        Engine(model, n_pages=6, max_slots=1, page_size=8).submit([5] * 500, max_new_tokens=20)
    with pytest.raises(ValueError, match="needs a key or a seed"):
        engine.submit([5] * 4, max_new_tokens=8, sampling=SETTINGS[1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit([5] * 4, max_new_tokens=0)
    assert engine.stats().waiting == 0


def test_background_thread_and_async_stream(model, specs_and_ref):
    specs, want = specs_and_ref
    engine = Engine(model, n_pages=40, **ENGINE)

    async def consume(req):
        toks, lps = [], []
        async for d in req:
            toks += d.token_ids
            lps += d.logprobs
        return toks, lps

    async def main():
        reqs = [submit(engine, s) for s in specs[:4]]
        return await asyncio.gather(*(consume(r) for r in reqs))

    engine.start()
    try:
        out = asyncio.run(main())
    finally:
        engine.stop()
    for (toks, lps), w in zip(out, want[:4]):
        assert toks == w.token_ids
        assert_close(lps, w.logprobs, what="streamed logprobs vs generate")


REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
REAL_SETTINGS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=40)]


@pytest.fixture(scope="module")
def real_alone(smollm2):
    """generate's completions of REAL_PROMPTS alone (greedy and sampled in turn, seeds 7, 8, ...)."""
    with optimized():
        return [jaxinfer.generate(smollm2, p, seed=7 + i, sampling=REAL_SETTINGS[i % 2],
                                  max_new_tokens=12).completions[0] for i, p in enumerate(REAL_PROMPTS)]


@pytest.mark.slow
@pytest.mark.parametrize("lay", ["stacked", "per_layer"])
def test_identity_real_smollm2(smollm2, real_alone, lay, request):
    """The real model in either layout: greedy and sampled requests arriving at different steps
    give generate's tokens alone."""
    if lay == "stacked":  # its time goes into running the model; the unrolled layout's into compiling
        request.getfixturevalue("optimized")
    model = smollm2 if lay == "stacked" else jaxinfer.layout.to_layout(smollm2, lay)
    engine = Engine(model, max_slots=4, page_size=16, max_len=64, prefill_chunk=16)
    reqs = []
    for i, p in enumerate(REAL_PROMPTS):
        reqs.append(engine.submit(p, max_new_tokens=12, sampling=REAL_SETTINGS[i % 2], seed=7 + i))
        engine.step()
    engine.run_until_idle()
    assert_same([r.result() for r in reqs], real_alone, fp32_error=smollm2_fp32_error())


def test_scoring_requests_are_admitted_and_cancelled_like_any_other(model):
    """A prompt-scoring request (max_new_tokens 0, prompt_logprobs: lm-eval's loglikelihood call) takes
    a slot and pages like any request: with one slot the others wait, a cancelled one ends without
    running, and every page comes back. Its logprobs are those of the uncached forward."""
    engine = Engine(model, max_slots=1, page_size=8, max_len=64, prefill_chunk=16)
    prompts = [list(range(3, 43)), list(range(50, 90)), list(range(100, 140))]  # 3 prefill steps each
    reqs = [engine.submit(p, max_new_tokens=0, prompt_logprobs=0) for p in prompts]
    engine.step()
    s = engine.stats()
    assert (s.running, s.waiting) == (1, 2) and 0 < s.pages_in_use <= 5
    reqs[2].cancel()
    engine.run_until_idle()
    cancelled = reqs[2].result()
    assert cancelled.finish_reason == "cancelled" and not any(x is not None for x in cancelled.prompt_logprobs)
    for r, p in zip(reqs[:2], prompts):
        c = r.result()
        assert c.token_ids == [] and c.prompt_logprobs[0] is None
        rows = np.asarray(jax.nn.log_softmax(jaxinfer.logits(model, p), axis=-1))
        assert_close(c.prompt_logprobs[1:], [rows[j - 1, p[j]] for j in range(1, len(p))], what="prompt logprobs")
    assert engine.stats().pages_in_use == 0
