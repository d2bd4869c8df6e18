"""`python -m jaxinfer.eval ARGS`: lm-evaluation-harness's own command line (`lm_eval ARGS`, the same
flags) with the `jaxinfer` model registered first. lm-eval 0.4.13 discovers no model plugins (no
entry points; see jaxinfer/eval/harness.py), so the plain `lm_eval` command cannot know the name.

    python -m jaxinfer.eval --model jaxinfer --model_args model=smollm2-135m,max_slots=8 \\
        --tasks hellaswag --output_path results/
"""

import sys


def main() -> None:
    try:
        import jaxinfer.eval.harness  # noqa: F401  (registers the model name)
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        sys.exit(f"python -m jaxinfer.eval needs lm-evaluation-harness ({e}): pip install 'jaxinfer[eval]'")
    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
