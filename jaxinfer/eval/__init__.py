"""Evaluation: scoring continuations, and lm-evaluation-harness on the engine.

  scoring.py   score(model, pairs): log p(continuation | context) for many pairs at once, on the
               serving engine (batched, prefix-shared); the harness's tokenization rule
  rollouts.py  rollout(engine, prompts, n=...): groups of samples as arrays for RL, and the
               differentiable teacher-forced logprobs a trainer compares them with
  harness.py   the `jaxinfer` model of lm-evaluation-harness (needs the [eval] extra)
  __main__.py  `python -m jaxinfer.eval ...`: lm-eval's own command line with that model registered
"""

from jaxinfer.eval.rollouts import Rollouts, rollout, teacher_forced_logprobs
from jaxinfer.eval.scoring import Score, encode_pair, score

__all__ = ["Score", "encode_pair", "score", "Rollouts", "rollout", "teacher_forced_logprobs"]
