"""jaxinfer vs the independent reference: Hugging Face transformers on the same GGUF (fp32).

Golden data: tests/golden/make_reference.py (regenerate with torch + transformers installed).
"""

import json
import os

import numpy as np
import pytest

import jaxinfer
from tests.tolerances import assert_close, golden_fp32_error


@pytest.fixture(scope="module")
def golden(golden_dir):
    data = np.load(os.path.join(golden_dir, "smollm2_logits.npz"))
    with open(os.path.join(golden_dir, "smollm2_reference.json")) as f:
        meta = json.load(f)
    return data, meta


def _n_prompts(data):
    return len([k for k in data.files if k.startswith("ids_")])


@pytest.mark.usefixtures("optimized")
def test_logits_match_transformers(smollm2, golden):
    data, _ = golden
    err = golden_fp32_error(data)  # the model's float32 error: the largest over its golden prompts
    for i in range(_n_prompts(data)):
        ids = data[f"ids_{i}"]
        ours = np.asarray(jaxinfer.logits(smollm2, ids.tolist()))  # [T, V]
        sel = np.take_along_axis(ours, data[f"vocab_idx_{i}"], axis=1)
        assert_close(sel, data[f"logits_{i}"], fp32_error=err, what=f"SmolLM2 prompt {i} (T={len(ids)}) logits")
        # a logsumexp moves by at most the largest logit error: the logits' error bounds it
        lse = np.log(np.exp(ours - ours.max(1, keepdims=True)).sum(1)) + ours.max(1)
        assert_close(lse, data[f"lse_{i}"], fp32_error=err, scale=np.abs(data[f"logits_{i}"]).max(),
                     what=f"SmolLM2 prompt {i} logsumexp")
        np.testing.assert_array_equal(ours.argmax(-1), data[f"argmax_{i}"], err_msg=f"prompt {i} argmax")


@pytest.mark.usefixtures("optimized")
def test_greedy_continuation_matches_transformers(smollm2, golden):
    data, meta = golden
    prompts = [data[f"ids_{i}"].tolist() for i in range(_n_prompts(data))]
    out = jaxinfer.generate(smollm2, prompts, max_new_tokens=32, stop_at_eos=False)
    for i, c in enumerate(out.completions):
        ref = data[f"greedy_{i}"].tolist()
        assert c.token_ids == ref, f"prompt {i}: first difference at {next(j for j, (a, b) in enumerate(zip(c.token_ids, ref)) if a != b)}"
    assert out.completions[0].text.startswith(" Paris")


def test_reference_file_matches_model(smollm2_path, golden):
    from jaxinfer.weights.hub import sha256_file

    _, meta = golden
    assert meta["gguf_sha256"] == sha256_file(smollm2_path)
