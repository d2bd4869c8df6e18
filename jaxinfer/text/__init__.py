"""Text <-> tokens: tiktoken encodings built from a model's own vocabulary, and its chat template.

  tokenizer.py     the `Tokenizer` interface (BOS rule, stop ids, chat template) and OpenAI's
                   cl100k_base / o200k_base; imports no format module
  bpe.py           byte-level BPE (GGUF `gpt2` vocabularies, tokenizer.json ByteLevel), with the
                   pre-tokenizer steps and the GGUF pre-tokenizer names it accepts
  spm.py           SentencePiece BPE vocabularies (Llama 2, Mistral, Gemma) on tiktoken
  hf_tokenizer.py  a Hugging Face tokenizer.json as bpe or spm, exact or refused
  chat.py          the model's own Jinja chat template, rendered as transformers renders it
  stream.py        incremental detokenizing and stop strings
  tool_calls.py    the tool-call formats chat templates teach: detect, parse, stream

Imports run one way: chat <- tokenizer <- bpe, spm <- hf_tokenizer.
"""
