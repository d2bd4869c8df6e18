"""`jaxinfer.score` and lm-evaluation-harness (in process and over HTTP) against the uncached
reference forward `jaxinfer.logits`, on a tiny random model with SmolLM2's real tokenizer.

The reference for a (context, continuation) pair is log_softmax(jaxinfer.logits(context +
continuation)) read at the continuation's tokens; for a rolling document, the same over the
harness's own windows (lm_eval.utils.get_rolling_token_windows); for a generation,
`jaxinfer.generate` (greedy) cut at the first stop string. Tolerances are relative to the scale
of the logits (float32 sums over the vocabulary).
"""

import json
import os

import jax
import numpy as np
import pytest

import jaxinfer
from jaxinfer.eval import scoring
from jaxinfer.model import config as mconfig, params as mparams
from jaxinfer.model.model import Model
from jaxinfer.serve.engine import Engine

TOKENIZER = os.path.join(os.path.dirname(__file__), "golden", "hf_text", "smollm2")
CTX = "The lighthouse keeper wrote in the log every night before the lamp was lit. Question: what did he write?"
CHOICES = [" the weather", " a letter to his sister", " nothing", " the names of the ships"]


@pytest.fixture(scope="module")
def model():
    """A tiny random model with SmolLM2's tokenizer (vocabulary, BOS/EOS, chat template)."""
    tok = jaxinfer.load_tokenizer(os.path.join(TOKENIZER, "tokenizer.json.xz"))
    cfg = mconfig.tiny(vocab_size=tok.vocab_size or tok.n_vocab, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    return Model(cfg, mparams.init_params(cfg, jax.random.key(0)), tok)


# One engine shape for every test, so the jitted programs are built once per module: the harness's
# own engine (max_length 64 -> max_len 65) and the server's (66: lm-eval's API client scores a
# 65-token window with max_tokens 1) have the same page table width and pool.
ENGINE = {"max_slots": 2, "max_len": 66, "prefill_chunk": 16}
HARNESS_ARGS = {"max_slots": 2, "max_length": 64, "prefill_chunk": 16}


def engine_for(model):
    return Engine(model, **ENGINE)


def log_softmax(model, ids):
    logits = np.asarray(jaxinfer.logits(model, ids), np.float64)
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True)), logits


def reference(model, ctx_ids, cont_ids):
    """(per-token logprobs, is greedy, tolerance per token) from the uncached forward."""
    lp, logits = log_softmax(model, list(ctx_ids) + list(cont_ids))
    n = len(ctx_ids)
    toks = [lp[n - 1 + j, t] for j, t in enumerate(cont_ids)]
    greedy = all(int(logits[n - 1 + j].argmax()) == t for j, t in enumerate(cont_ids))
    return np.array(toks), greedy, 1e-5 * max(1.0, float(np.abs(logits).max()))


# ---- jaxinfer.score ------------------------------------------------------------------------------

def test_score_equals_the_uncached_forward_and_shares_the_context(model):
    engine = engine_for(model)
    pairs = [(CTX, c) for c in CHOICES] + [("", "Hello world"), ("Trailing space ", "moves")]
    scores = jaxinfer.score(engine, pairs)
    worst = 0.0
    for (ctx, cont), s in zip(pairs, scores):
        assert (s.context_ids, s.continuation_ids) == scoring.encode_pair(model.tokenizer, ctx, cont)
        want, greedy, tol = reference(model, s.context_ids, s.continuation_ids)
        worst = max(worst, float(np.abs(np.array(s.token_logprobs) - want).max()))
        np.testing.assert_allclose(s.token_logprobs, want, atol=tol)
        assert abs(s.logprob - want.sum()) <= tol * len(want)
        assert s.is_greedy == greedy
    print(f"score vs uncached forward: max |logprob diff| = {worst:.2e}")
    # the three later choices reuse the context's full pages (all but the last context token)
    ctx_len = len(scores[0].context_ids)
    assert engine.stats().prefix_hit_tokens >= 3 * ((ctx_len - 1) // engine.page_size) * engine.page_size > 0


def test_greedy_continuation_is_recognised(model):
    ctx = model.tokenizer.encode("Once upon a time")
    cont = []
    for _ in range(4):  # the argmax continuation, from the reference forward
        cont.append(int(np.asarray(jaxinfer.logits(model, ctx + cont))[-1].argmax()))
    other = cont[:3] + [(cont[3] + 1) % model.config.vocab_size]
    s_greedy, s_other = jaxinfer.score(engine_for(model), [(ctx, cont), (ctx, other)])
    assert s_greedy.is_greedy and not s_other.is_greedy
    np.testing.assert_allclose(s_greedy.token_logprobs[:3], s_other.token_logprobs[:3], atol=1e-5)


def test_identical_pairs_are_scored_once_and_results_are_reproducible(model):
    engine = engine_for(model)
    pairs = [("a b c", " d"), ("a b c", " d"), ("x y", " z")]
    first = jaxinfer.score(engine, pairs)
    assert engine.stats().requests_finished == 2
    assert first[0] == first[1]
    assert jaxinfer.score(engine, pairs) == first


def test_one_token_choices_are_read_off_the_leaders_alternatives(model):
    """Choices of one token after the same context: those among the first choice's 20 most likely
    tokens take their logprob from its prefill; the others get a request of their own."""
    engine = engine_for(model)
    ctx = model.tokenizer.encode("Question: which colour is the sky? Answer:")
    order = np.argsort(-np.asarray(jaxinfer.logits(model, ctx))[-1])
    choices = [int(order[5]), int(order[0]), int(order[19]), int(order[-1])]  # 2nd and 3rd: read off
    before = engine.stats().requests_finished
    scores = jaxinfer.score(engine, [(ctx, [t]) for t in choices])
    assert engine.stats().requests_finished - before == 2
    for t, s in zip(choices, scores):
        want, greedy, tol = reference(model, ctx, [t])
        np.testing.assert_allclose(s.token_logprobs, want, atol=tol)
        assert s.is_greedy == greedy == (t == int(order[0]))


def test_long_pairs_lose_context_from_the_left(model):
    ctx, cont = list(range(10, 70)), [5, 6, 7]
    engine = engine_for(model)
    (s,) = jaxinfer.score(engine, [(ctx, cont)], max_length=32)
    assert s.context_ids == ctx[-29:] and s.continuation_ids == cont
    want, _, tol = reference(model, s.context_ids, cont)
    np.testing.assert_allclose(s.token_logprobs, want, atol=tol)
    with pytest.raises(ValueError, match="continuation has 40 tokens"):
        jaxinfer.score(engine, [([1], list(range(10, 50)))], max_length=32)
    with pytest.raises(ValueError, match="beyond the engine's max_len"):
        jaxinfer.score(engine, [([1], [2])], max_length=100)


def test_max_length_beyond_the_context_is_clamped_with_or_without_interventions(model):
    """A Model's score clamps max_length to the context length on the engine path and on the
    interventions path alike (the latter used to refuse it)."""
    n = model.config.max_seq_len
    ctx, cont = [(7 * i) % 200 + 10 for i in range(n + 40)], [5, 6, 7]
    (s,) = jaxinfer.score(model, [(ctx, cont)], max_length=n + 1000, interventions=[], max_slots=1)
    assert s.context_ids == ctx[-(n - len(cont)):] and s.continuation_ids == cont
    want, _, tol = reference(model, s.context_ids, cont)
    np.testing.assert_allclose(s.token_logprobs, want, atol=tol)


def test_bad_pairs_are_refused(model):
    with pytest.raises(TypeError, match="mixes text and token ids"):
        jaxinfer.score(model, [("text", [1, 2])], max_slots=1, max_length=32)
    with pytest.raises(ValueError, match="continuation is empty"):
        jaxinfer.score(model, [("text", "")], max_slots=1, max_length=32)
    with pytest.raises(TypeError, match="pairs\\[0\\] must be a"):
        jaxinfer.score(model, ["just a string"], max_slots=1, max_length=32)


def test_leaders_wait_for_the_deepest_shared_page():
    page = 4
    base = list(range(100, 112))  # three full pages
    prompts = [base + [1], base + [2], base[:8] + [9, 9, 9, 9, 3], [7] * 13, base + [1]]
    # prompt 1 shares 2 usable pages (its score_from 12 leaves 11 tokens = 2 full pages) with 0;
    # prompt 2 shares page 1-2 with 0; prompt 3 shares nothing; prompt 4 only scores from 2
    assert scoring.leaders(prompts, [12, 12, 12, 12, 2], page) == [-1, 0, 0, -1, -1]
    assert scoring.leaders([base, base], [12, 12], page) == [-1, 0]


# ---- lm-evaluation-harness ----------------------------------------------------------------------

def _tasks(tmp_path):
    """Four tiny local tasks (data in JSONL beside them): multiple choice with shared contexts,
    rolling perplexity (two windows at max_length 64), generation with 5 stop strings, and
    generation with num_beams: 1 and max_new_tokens."""
    mc = [{"q": "What color is the sky?", "choices": ["blue", "green", "red"], "a": 0},
          {"q": "How many legs does a spider have?", "choices": ["six", "eight"], "a": 1}]
    docs = [{"text": "The river begins as rain in the hills. " * 9}, {"text": "Bread is old. " * 3}]
    qa = [{"q": "What is 2 + 3?", "a": "5"}, {"q": "Name a colour.", "a": "blue"}]
    for name, rows in (("mc", mc), ("ppl", docs), ("qa", qa)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    def data(name):
        return (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / name}.jsonl\n"
                "test_split: test\n")

    (tmp_path / "t_mc.yaml").write_text(
        "task: t_mc\n" + data("mc") + "output_type: multiple_choice\ndescription: \"Answer the questions.\\n\\n\"\n"
        "doc_to_text: \"Question: {{q}}\\nAnswer:\"\ndoc_to_choice: choices\ndoc_to_target: a\n"
        "metric_list:\n  - metric: acc\n")
    (tmp_path / "t_ppl.yaml").write_text(
        "task: t_ppl\n" + data("ppl") + "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
        "doc_to_target: \"{{text}}\"\nmetric_list:\n  - metric: word_perplexity\n")
    gen = ("output_type: generate_until\ndoc_to_text: \"Q: {{q}}\\nA:\"\ndoc_to_target: \" {{a}}\"\n"
           "metric_list:\n  - metric: exact_match\n")
    (tmp_path / "t_until5.yaml").write_text(
        "task: t_until5\n" + data("qa") + gen + "generation_kwargs:\n  until: [\"\\n\", \"Q:\", \".\", \"?\", \"!\"]\n"
        "  max_gen_toks: 12\n  do_sample: false\n")
    (tmp_path / "t_beams1.yaml").write_text(
        "task: t_beams1\n" + data("qa") + gen + "generation_kwargs:\n  until: [\"\\n\"]\n  num_beams: 1\n"
        "  max_new_tokens: 9\n  do_sample: false\n")
    return str(tmp_path)


def _evaluate(lm_eval, model_name, model_args, tasks_dir, tasks):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model_name, model_args=model_args, tasks=tasks, log_samples=True,
                                   task_manager=TaskManager(include_path=tasks_dir), bootstrap_iters=0)


def _check_loglikelihoods(model, res, max_length):
    """Every multiple-choice and rolling number against the uncached forward."""
    tok = model.tokenizer
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for s in res["samples"]["t_mc"]:
        for (ctx, cont), resp in zip(s["arguments"], s["resps"]):
            ctx_ids, cont_ids = _harness_pair(tok, ctx, cont)
            want, greedy, tol = reference(model, ctx_ids, cont_ids)
            assert abs(resp[0][0] - want.sum()) <= tol * len(want), (ctx, cont, resp, want.sum())
            assert resp[0][1] == greedy
    windows = 0
    for s in res["samples"]["t_ppl"]:
        ids = tok.encode(s["doc"]["text"], allowed_special="all")
        total, tol_sum, n = 0.0, 0.0, 0
        for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(ids, tok.bos_id, max_length, 1)):
            want, _, tol = reference(model, ctx, cont)
            total, tol_sum, n = total + want.sum(), tol_sum + tol * len(want), n + 1
        assert abs(s["resps"][0][0] - total) <= tol_sum, (s["resps"][0][0], total)
        windows = max(windows, n)
    return windows


def _harness_pair(tok, context, continuation):
    """lm-eval's causal rule, written out from its TemplateLM._encode_pair with this tokenizer."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, allowed_special="all")
    ctx = tok.encode(context, allowed_special="all")
    return ctx, whole[len(ctx):]


def greedy_text(model, ids, n_new):
    """Greedy continuation by the uncached forward, one token at a time, ended at a stop token."""
    out = []
    for _ in range(n_new):
        t = int(np.asarray(jaxinfer.logits(model, ids + out))[-1].argmax())
        out.append(t)
        if t in model.tokenizer.stop_ids:
            return model.tokenizer.decode(out[:-1])
    return model.tokenizer.decode(out)


def _check_generations(model, res, max_length):
    eos = model.tokenizer.decode([model.tokenizer.eos_id])
    for task, n_new in (("t_until5", 12), ("t_beams1", 9)):
        for s in res["samples"][task]:
            context, kwargs = s["arguments"][0]
            ids = model.tokenizer.encode(context, allowed_special="all")[-(max_length - n_new):]
            text = greedy_text(model, ids, n_new)
            for stop in list(kwargs["until"]) + [eos]:
                text = text.split(stop)[0]
            assert s["resps"][0][0] == text, (task, s["resps"][0][0], text)


def test_lm_eval_in_process(model, tmp_path):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install '.[eval]')")
    import jaxinfer.eval.harness  # noqa: F401  (registers "jaxinfer")

    res = _evaluate(lm_eval, "jaxinfer", {"model": model, **HARNESS_ARGS}, _tasks(tmp_path),
                    ["t_mc", "t_ppl", "t_until5", "t_beams1"])
    assert _check_loglikelihoods(model, res, 64) == 2  # the long document took two windows
    _check_generations(model, res, 64)
    assert res["results"]["t_mc"]["acc,none"] in (0.0, 0.5, 1.0)


def test_lm_eval_harness_tokenization_is_ours(model):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install '.[eval]')")
    from jaxinfer.eval.harness import JaxinferLM

    lm = JaxinferLM(model=model, **HARNESS_ARGS)
    for ctx, cont in [(CTX, " x"), ("Ends with spaces  ", "word"), ("a", "b"), ("tail\n", "\nnext"),
                      ("special <|im_end|> text", " more <|im_start|>")]:
        assert lm._encode_pair(ctx, cont) == scoring.encode_pair(model.tokenizer, ctx, cont)


def test_lm_eval_over_http_local_completions(model, tmp_path):
    """lm-eval's own HTTP client against `jaxinfer serve`, tokenizing through the server's /tokenize
    (`tokenizer_backend=remote`, as against vLLM): no transformers needed."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install '.[eval]')")
    pytest.importorskip("starlette")
    from jaxinfer.serve import http_api as srv

    engine = engine_for(model)
    app = srv.create_app(engine, model, model_name="tiny")
    server, thread, url = srv.serve_in_thread(app)
    try:
        # an API model's max_length counts one token less (and its windows one less again)
        args = {"model": "tiny", "base_url": url + "/v1/completions", "tokenizer_backend": "remote",
                "max_length": 66, "max_gen_toks": 16, "max_retries": 1, "timeout": 120}
        res = _evaluate(lm_eval, "local-completions", args, _tasks(tmp_path), ["t_mc", "t_ppl", "t_until5",
                                                                               "t_beams1"])
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert _check_loglikelihoods(model, res, 64) == 2
    _check_generations(model, res, 64)
