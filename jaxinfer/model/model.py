"""`Model`: what `jaxinfer.load` returns and every client runs: a config, its params, a tokenizer."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params

if TYPE_CHECKING:  # the model runs on token ids; only its holder refers to a tokenizer
    from jaxinfer.text.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Model:
    """Everything needed to run a model. Params live on device; config is static (it declares the
    params' layout, `config.layout`)."""

    config: ModelConfig
    params: Params
    tokenizer: Optional["Tokenizer"] = None
    adapters: tuple[str, ...] = ()  # the LoRA adapters in params["lora"], in stack order (`jaxinfer.model.lora`)
