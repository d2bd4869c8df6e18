"""transformers' decoder-layer outputs and a steered forward pass, for the golden scripts beside this file.

What jaxinfer calls `resid_post` of layer l is what transformers' decoder layer l returns. Its
`output_hidden_states` holds those outputs for every layer but the last, whose entry is after the
final norm, so the outputs are read here with a forward hook on each decoder layer instead (and
checked against `hidden_states[l + 1]` where both exist). Steering is a forward hook that adds
`scale * v` to decoder layer l's output, at every position, prompt and generated tokens alike.

Each script stores, in a `sites.npz` of its own (the existing golden files are left as they are):

  positions [P]            the prompt positions stored (a few: the golden files stay small)
  resid_post [L, P, D]     every decoder layer's output at those positions, float32
  resid_post_fp32_error [L, P]   max |float32 - float64| of each stored vector (the reference's own
                           float error, float64_reference.py)
  steer_layer [], steer_scale [], steer_vector [D]   the steering reference's settings
  steered_idx [T, M], steered_logits [T, M]   logits with the hook on, at M columns per position
                           (the top half of the steered logits, then a fixed random fill)
  steered_logits_fp32_error [T]
  steered_greedy [n]       transformers' greedy continuation with the hook on (its own KV cache)
  plain_greedy [n]         ... and without (a steering vector that changes nothing tests nothing)

Needs torch + transformers; tests never import this file.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from float64_reference import Float64Mode, float64_model


def decoder_layers(model) -> list:
    return list(model.model.layers)


def _out(output):
    return output[0] if isinstance(output, tuple) else output


@contextlib.contextmanager
def steering(model, layer: int, vector: torch.Tensor):
    """Inside: decoder layer `layer` returns its output + vector (broadcast over batch and positions)."""
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0] + vector.to(output[0].dtype),) + tuple(output[1:])
        return output + vector.to(output.dtype)

    handle = decoder_layers(model)[layer].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def layer_outputs(model, ids: list[int]) -> np.ndarray:
    """Every decoder layer's output over one uncached pass: [L, T, D] (the model's dtype, as numpy)."""
    outs = []
    handles = [m.register_forward_hook(lambda mod, a, o: outs.append(_out(o)[0].detach().clone()))
               for m in decoder_layers(model)]
    try:
        with torch.no_grad():
            res = model(input_ids=torch.tensor([list(ids)]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    stacked = torch.stack(outs)
    hidden = res.hidden_states  # [emb, layer 0, ..., final_norm(layer L-1)]
    for i in range(len(outs) - 1):  # the hooks read what output_hidden_states reports
        assert torch.equal(hidden[i + 1][0], stacked[i]), f"layer {i}: hook output != hidden_states[{i + 1}]"
    return stacked.numpy()


def layer_outputs64(model64, ids: list[int]) -> np.ndarray:
    with Float64Mode():
        out = layer_outputs(model64, ids)
    assert out.dtype == np.float64, out.dtype
    return out


def steered_logits(model, ids: list[int], layer: int, vector: torch.Tensor) -> np.ndarray:
    with torch.no_grad(), steering(model, layer, vector):
        return model(input_ids=torch.tensor([list(ids)])).logits[0].numpy()


def greedy(model, ids: list[int], n: int, pad_id: int = 0) -> list[int]:
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=pad_id)
    return gen[0, len(ids):].tolist()


def steering_vector(d: int, seed: int) -> np.ndarray:
    """A fixed random unit vector [D] (float32)."""
    v = np.random.default_rng(seed).standard_normal(d)
    return (v / np.linalg.norm(v)).astype(np.float32)


def sites_arrays(model, ids: list[int], *, layer: int, scale_of_norm: float, n_new: int, cols: int,
                 seed: int = 0, pad_id: int = 0) -> dict:
    """The sites.npz arrays (module docstring) of `model` (float32, eager attention) on prompt `ids`.

    The steering scale is `scale_of_norm` times the median norm of layer `layer`'s output over the
    prompt (the median: a first position's outlier norm, as in SmolLM2, does not set it), so the same
    setting moves a tiny model and a real one by a comparable amount."""
    model = model.eval()
    model64 = float64_model(model)
    T = len(ids)
    positions = np.array(sorted({1, T // 2, T - 1}), np.int64)
    resid = layer_outputs(model, ids)  # [L, T, D]
    resid64 = layer_outputs64(model64, ids)
    err = np.abs(resid[:, positions].astype(np.float64) - resid64[:, positions]).max(-1)  # [L, P]
    D = resid.shape[-1]
    v = steering_vector(D, seed)
    scale = np.float32(scale_of_norm * np.median(np.linalg.norm(resid[layer], axis=-1)))
    vec32 = torch.tensor(scale * v)  # what the hook adds: scale * v, formed once in float32
    logits = steered_logits(model, ids, layer, vec32)  # [T, V]
    with Float64Mode():
        logits64 = steered_logits(model64, ids, layer, vec32.double())
    V = logits.shape[-1]
    idx = np.empty((T, cols), np.int64)
    rng = np.random.default_rng(seed)
    for t in range(T):
        if cols >= V:
            idx[t] = np.arange(V)
            continue
        top = np.argsort(-logits[t])[:cols // 2]
        rest = rng.choice(np.setdiff1d(np.arange(V), top), cols - cols // 2, replace=False)
        idx[t] = np.concatenate([top, rest])
    steered = np.take_along_axis(logits, idx, 1).astype(np.float32)
    steered_err = np.abs(steered.astype(np.float64) - np.take_along_axis(logits64, idx, 1)).max(-1)
    with steering(model, layer, vec32):
        steered_greedy = greedy(model, ids, n_new, pad_id)
    plain_greedy = greedy(model, ids, n_new, pad_id)
    return {"ids": np.asarray(ids, np.int32), "positions": positions.astype(np.int32),
            "resid_post": resid[:, positions].astype(np.float32),
            "resid_post_fp32_error": err.astype(np.float32),
            "steer_layer": np.int32(layer), "steer_scale": scale, "steer_vector": v,
            "steered_idx": idx.astype(np.int32), "steered_logits": steered,
            "steered_logits_fp32_error": steered_err.astype(np.float32),
            "steered_greedy": np.asarray(steered_greedy, np.int32), "plain_greedy": np.asarray(plain_greedy, np.int32)}
