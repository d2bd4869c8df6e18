"""Write the held-out evaluation text: sections of the Python reference manual, as shipped.

Source: `pydoc_data.topics` in CPython 3.11's standard library (the reference-manual text that
`help()` shows), Copyright Python Software Foundation, distributed under the PSF License
Agreement (see LICENSE.txt in the CPython distribution). No jaxinfer setting was tuned on it.

Run: python experiments/data/make_text.py  (rewrites pydoc_heldout.txt beside this file)
"""

import os

import pydoc_data.topics

SECTIONS = ("execmodel", "exceptions", "import", "naming", "class", "function", "with", "try")


def main() -> None:
    text = "\n\n".join(pydoc_data.topics.topics[s].strip() for s in SECTIONS) + "\n"
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pydoc_heldout.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {len(text)} characters to {path}")


if __name__ == "__main__":
    main()
