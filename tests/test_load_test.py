"""Smoke test of experiments/load_test.py: concurrent streaming clients with disconnects against
`jaxinfer serve` (a tiny random model with SmolLM2's tokenizer): no unexpected error, the KV pool back to 0."""

import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from experiments import load_test  # noqa: E402


def test_load_test_smoke(smollm2, tmp_path):
    import jax

    from jaxinfer.model import config, params
    from jaxinfer.model.model import Model

    cfg = config.tiny(vocab_size=smollm2.config.vocab_size, eos_token_id=smollm2.config.eos_token_id)
    tiny = Model(cfg, params.init_params(cfg, jax.random.key(0)), smollm2.tokenizer)  # SmolLM2's tokenizer
    r = load_test.main(["--smoke", "--out", str(tmp_path)], model=tiny)
    assert (tmp_path / "load_test.png").stat().st_size > 1000
    assert json.loads((tmp_path / "load_test.json").read_text())["experiment"] == "load_test"
    assert r["unexpected_errors"] == 0, r["error_examples"]
    assert r["requests_sent"] == 12 and r["disconnected"] >= 1 and r["completed"] + r["disconnected"] == 12
    assert r["kv_pages_in_use_after"] == 0 and r["engine"]["requests_running"] == 0
    assert r["output_tokens"] > 0
