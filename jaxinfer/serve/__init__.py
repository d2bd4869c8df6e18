"""Serving: the continuous-batching engine and `jaxinfer serve`, OpenAI's HTTP API over it."""
