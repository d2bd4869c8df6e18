"""Smoke tests of the logit-lens and steering experiments (fast settings, the real SmolLM2): each
writes its JSON and PNG; the facts they report are checked, their timings are not."""

import json

import numpy as np
import pytest

from experiments import logit_lens, steering


def _run(module, name, smollm2, tmp_path, *argv):
    result = module.main(["--smoke", "--out", str(tmp_path), *argv], model=smollm2)
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert json.loads((tmp_path / f"{name}.json").read_text())["experiment"] == name
    return result


@pytest.mark.usefixtures("optimized")
def test_logit_lens_experiment(smollm2, tmp_path):
    r = _run(logit_lens, "logit_lens", smollm2, tmp_path)
    assert r["final_token"] == " Paris" and r["tokens"][-1] == " is"
    assert len(r["layers"]) == 30 and 0 <= r["top_from_layer"] <= 29


@pytest.mark.usefixtures("optimized")
def test_steering_experiment(smollm2, tmp_path):
    r = _run(steering, "steering", smollm2, tmp_path)
    scores = [row["score"] for row in r["rows"]]
    assert [row["scale"] for row in r["rows"]] == [-4.0, 0.0, 4.0]
    assert scores[0] < scores[1] < scores[2]  # the vector moves the sentiment where it points
    assert all(len(row["samples"]) == 2 for row in r["rows"])


def test_steering_speed_rows(smollm2, tmp_path):
    """The speed rows' plumbing on a tiny random model with SmolLM2's tokenizer (their figures come
    from the real model in experiments/figures; only the structure and the 0 compiles are checked)."""
    from experiments._common import tiny_model

    tiny = tiny_model(tokenizer=smollm2.tokenizer, eos_token_id=smollm2.config.eos_token_id)
    r = _run(steering, "steering_speed", tiny, tmp_path, "--speed")
    assert len(r["rows"]) == 5 and r["rows"][-1]["ratio"] == 0  # no compile for new vectors and scales


def test_steering_training_rows(smollm2, tmp_path):
    """--train's plumbing on a tiny random model with SmolLM2's tokenizer (its figures come from the
    real model in experiments/figures): the loss curve, the held-out samples before and after, and
    the training-step speed row against a forward of the same batch."""
    from experiments._common import tiny_model

    tiny = tiny_model(tokenizer=smollm2.tokenizer, eos_token_id=smollm2.config.eos_token_id)
    r = _run(steering, "steering_train", tiny, tmp_path, "--train")
    assert len(r["losses"]) == 4 and all(np.isfinite(r["losses"]))  # (a random model: the drop is test_training's)
    assert len(r["before"]["samples"]) == len(r["after"]["samples"]) == 2
    assert r["speed"]["ratio"] > 0 and set(r["speed"]["seconds"]) == {"step", "forward_last", "forward_all"}
