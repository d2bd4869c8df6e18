#!/usr/bin/env python3
"""Reference outputs of transformers' RepetitionPenaltyLogitsProcessor, for tests/test_penalties.py.

Uses nothing from jaxinfer. Random float32 logits [B, V] (both signs, a few exact zeros) and token
histories [B, T] (prompt + generated, with repeats); each row has its own penalty, so each row is
run through its own processor (transformers takes one penalty per call):

  penalties_golden.npz   logits [B, V], input_ids [B, T], penalty [B], expected [B, V], versions

Run:  python tests/golden/make_penalties_golden.py   (a second; needs torch + transformers)
"""

from __future__ import annotations

import importlib.metadata as md
import os

import numpy as np
import torch
from transformers import RepetitionPenaltyLogitsProcessor

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "penalties_golden.npz")
B, V, T, SEED = 6, 300, 40, 0
PENALTIES = [1.0, 1.3, 0.7, 2.0, 1.05, 10.0]  # 1.0 is off; < 1 rewards repeats


def main() -> None:
    rng = np.random.default_rng(SEED)
    logits = (rng.standard_normal((B, V)) * 5).astype(np.float32)
    logits[:, :4] = 0.0  # l == 0: unchanged either way
    input_ids = rng.integers(0, V // 3, size=(B, T)).astype(np.int64)  # a third of the vocab: many repeats
    input_ids[:, :3] = [0, 1, 2]  # the zero logits are seen too
    expected = np.empty_like(logits)
    for b in range(B):
        proc = RepetitionPenaltyLogitsProcessor(penalty=PENALTIES[b])
        out = proc(torch.from_numpy(input_ids[b:b + 1]), torch.from_numpy(logits[b:b + 1].copy()))
        expected[b] = out.numpy()[0]
    np.savez_compressed(OUT, logits=logits, input_ids=input_ids.astype(np.int32),
                        penalty=np.array(PENALTIES, np.float32), expected=expected,
                        versions=np.array([f"transformers {md.version('transformers')}", f"torch {torch.__version__}"]))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
