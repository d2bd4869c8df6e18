"""The backend-specific kernels (`jaxinfer.model.kernels`) against the portable paths they replace.

Off a GPU the Pallas kernels run in interpret mode and the fused attention through XLA, so these
check on a CPU what a GPU runs, shapes tiny so interpret mode stays fast. Timings are benchmarks
(`experiments/device_check.py --preset kernels`), never here.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.model import cache as kv
from jaxinfer.model import config as C
from jaxinfer.model import forward as mdl
from jaxinfer.model import layout as lay
from jaxinfer.model import quantize as Q
from jaxinfer.model.kernels import int8_matmul as km
from jaxinfer.model.kernels import prefill_attention
from jaxinfer.model.params import init_params
from tests.tolerances import assert_close


# int8 matmul ---------------------------------------------------------------------------------

@pytest.mark.parametrize("w_layout,I,O,rows,blocks", [
    ("OI", 128, 64, (2, 3), None),                       # per_layer matrices, one program per 64 outputs
    ("IO", 64, 96, (5,), None),                          # an untied head [D, V]
    ("OI", 256, 32, (1, 1), km.Blocks(16, 32, split_k=4)),  # inputs split over 4 programs, summed after
    ("IO", 128, 64, (3,), km.Blocks(32, 16, split_k=2)),
])
def test_int8_kernel_equals_the_xla_path(w_layout, I, O, rows, blocks):
    k1, k2 = jax.random.split(jax.random.key(0))
    w = jax.random.normal(k1, (O, I) if w_layout == "OI" else (I, O))
    qw = Q.quantize_int8(w, (-1,) if w_layout == "OI" else (-2,))
    x = jax.random.normal(k2, (*rows, I))
    want = qw.einsum("...I,OI->...O" if w_layout == "OI" else "...I,IO->...O", x)
    got = km.int8_matmul(x, qw.q, qw.scale, w_layout=w_layout, blocks=blocks, interpret=True)
    assert got.shape == want.shape and got.dtype == x.dtype
    assert_close(got, want, what=f"int8 Pallas kernel ({w_layout}, {blocks}) vs XLA")


def test_int8_kernel_in_bfloat16_accumulates_in_float32():
    k1, k2 = jax.random.split(jax.random.key(1))
    qw = Q.quantize_int8(jax.random.normal(k1, (64, 128)), (-1,))
    x = jax.random.normal(k2, (4, 128)).astype(jnp.bfloat16)
    want = (x.astype(jnp.float32) @ qw.q.T.astype(jnp.float32)) * qw.scale[:, 0]
    got = km.int8_matmul(x, qw.q, qw.scale.astype(jnp.bfloat16), interpret=True)
    assert got.dtype == jnp.bfloat16
    assert_close(got.astype(jnp.float32), want, dtype="bfloat16", what="int8 kernel, bfloat16 rows")


def test_int8_kernel_choice_by_backend_dtype_and_shape():
    # default: the kernel only on a GPU, for bf16/fp16 rows of decode size, where a tiling divides the shape
    assert not km.use_kernel(None, 1, jnp.bfloat16, I=4096, O=4096, backend="cpu")
    assert km.use_kernel(None, 1, jnp.bfloat16, I=4096, O=4096, backend="gpu")
    assert km.use_kernel(None, 64, jnp.float16, I=4096, O=14336, w_layout="IO", backend="gpu")
    assert not km.use_kernel(None, 65, jnp.bfloat16, I=4096, O=4096, backend="gpu")  # a prefill chunk: XLA's GEMM
    assert not km.use_kernel(None, 1, jnp.float32, I=4096, O=4096, backend="gpu")
    assert not km.use_kernel(None, 1, jnp.bfloat16, I=4096, O=100, backend="gpu")  # no Triton tile divides 100
    assert km.use_kernel("pallas", km.MAX_ROWS, jnp.float32, I=64, O=64, backend="cpu")  # the config forces it
    # ... where it applies: the kernel holds every row in one tile, so a prefill chunk stays on XLA's GEMM
    assert not km.use_kernel("pallas", km.MAX_ROWS + 1, jnp.bfloat16, I=4096, O=4096, backend="gpu")
    assert not km.use_kernel("pallas", 512, jnp.float32, I=64, O=64, backend="cpu")
    assert not km.use_kernel("xla", 1, jnp.bfloat16, I=4096, O=4096, backend="gpu")
    with pytest.raises(ValueError, match="int8 matmul kernel must be one of"):
        km.use_kernel("triton", 1, jnp.bfloat16, I=64, O=64)
    with pytest.raises(ValueError, match="int8_matmul must be None or one of"):
        C.tiny(int8_matmul="triton")
    # many programs for a narrow matrix: 4,096 outputs in blocks of 64 are 64 programs, inputs split 4 ways
    b = km.default_blocks(1, 4096, 4096)
    assert b.fits(4096, 4096) and (4096 // b.block_o) * b.split_k >= km.TARGET_PROGRAMS


def test_int8_kernel_refuses_what_it_cannot_tile():
    qw = Q.quantize_int8(jnp.ones((100, 64)), (-1,))
    with pytest.raises(ValueError, match="no Triton tiling"):
        km.int8_matmul(jnp.ones((1, 64)), qw.q, qw.scale, interpret=True)
    with pytest.raises(ValueError, match="w_layout"):
        km.int8_matmul(jnp.ones((1, 64)), qw.q, qw.scale, w_layout="IOX")
    with pytest.raises(ValueError, match="rank-2 int8"):
        km.int8_matmul(jnp.ones((1, 64)), qw.q.astype(jnp.int32), qw.scale)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Triton lowering needs a GPU")
@pytest.mark.parametrize("rows", [1, 64])
def test_int8_kernel_compiled_for_the_gpu_equals_xla(rows):
    """The default choice on a GPU: Llama-3-8B's wq shape in bfloat16, Triton-compiled."""
    k1, k2 = jax.random.split(jax.random.key(2))
    qw = Q.quantize_int8(jax.random.normal(k1, (4096, 4096)).astype(jnp.bfloat16), (-1,))
    x = jax.random.normal(k2, (rows, 4096)).astype(jnp.bfloat16)
    assert km.use_kernel(None, rows, x.dtype, I=4096, O=4096)
    got = km.int8_matmul(x, qw.q, qw.scale)
    want = qw.einsum("...I,OI->...O", x)
    assert_close(got.astype(jnp.float32), want.astype(jnp.float32), dtype="bfloat16", what="Triton int8 vs XLA")


@pytest.mark.parametrize("eq,want", [("BTD,VD->BTV", "OI"), ("BTD,DF->BTF", "IO"), ("...I,OI->...O", "OI"),
                                     ("BTD,DNH->BTNH", None), ("BTD,DF->BFT", None)])
def test_matrix_layout_reads_the_einsum(eq, want):
    assert km.matrix_layout(eq) == want


@pytest.mark.parametrize("layout", ["stacked", "per_layer"])
def test_forward_with_the_int8_kernel_equals_xla(layout, monkeypatch):
    """Every int8 matrix of a tiny model through the Pallas kernel (interpret mode): same logits."""
    calls = []
    kernel = km.int8_matmul
    monkeypatch.setattr(km, "int8_matmul", lambda *a, **k: calls.append(k["w_layout"]) or kernel(*a, **k))
    cfg = C.tiny()
    qp = Q.quantize(init_params(cfg, jax.random.key(0)), cfg, "int8")
    qp, cfg = lay.convert(qp, cfg, layout), cfg.replace(layout=layout)
    tokens = jax.random.randint(jax.random.key(1), (2, 3), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(3), (2, 3))
    want = mdl.forward(qp, tokens, pos, None, cfg.replace(int8_matmul="xla")).logits
    assert not calls  # "xla" never runs the kernel
    got = mdl.forward(qp, tokens, pos, None, cfg.replace(int8_matmul="pallas")).logits
    assert calls  # the MLP matrices (stacked), every matrix (per_layer), and the head go through it
    assert_close(got, want, what=f"{layout}: int8 forward, Pallas kernel vs XLA")


# Fused prefill attention -----------------------------------------------------------------------

def _chunked_logits(cfg, params, firsts=(40, 29), chunk=24, batch=2):
    """Logits of a second prompt chunk after rows of different context lengths: [B, chunk, V]."""
    cache = kv.init_cache(cfg, batch, 128, page_size=8)
    tokens = jax.random.randint(jax.random.key(2), (batch, max(firsts) + chunk), 0, cfg.vocab_size)
    first = max(firsts)
    pos = jnp.broadcast_to(jnp.arange(first), (batch, first))
    cache = mdl.forward(params, tokens[:, :first], pos, cache, cfg).cache
    cache = kv.rewind(cache, jnp.array(firsts, jnp.int32))  # row 1 keeps fewer positions
    pos = cache.lengths[:, None] + jnp.arange(chunk)
    rows = jnp.arange(batch)[:, None]
    return mdl.forward(params, tokens[rows, pos], pos, cache, cfg).logits


@pytest.mark.parametrize("family", ["gqa", "window", "window_per_layer", "one_block"])
def test_fused_prefill_attention_equals_paged(family):
    """A prompt chunk over itself and earlier context: fused ("xla", the cuDNN path's calls) == paged."""
    cfg = C.tiny(context_block=16)  # several context blocks per row, the last one partly filled
    if family.startswith("window"):  # local layers see 20 positions, every 2nd layer is global
        cfg = cfg.replace(sliding_window=20, global_every=2)
    if family == "one_block":
        cfg = cfg.replace(context_block=4096)
    params = init_params(cfg, jax.random.key(0))
    if family == "window_per_layer":  # `local` a Python bool per layer instead of traced in the scan
        params, cfg = lay.convert(params, cfg, "per_layer"), cfg.replace(layout="per_layer")
    want = _chunked_logits(cfg.replace(prefill_attention="paged"), params)
    got = _chunked_logits(cfg.replace(prefill_attention="xla"), params)
    assert_close(got, want, what=f"{family}: fused prefill attention (xla) vs paged")


def test_prefill_attention_choice_by_backend_dtype_and_shape():
    pa = prefill_attention
    cfg = C.llama3_8b()
    assert pa.kernel_for(cfg, 2048, jnp.bfloat16, backend="cpu") == "paged"  # the CPU default is unchanged
    assert pa.kernel_for(cfg, 2048, jnp.bfloat16, backend="gpu") == "cudnn"
    assert pa.kernel_for(cfg, 1, jnp.bfloat16, backend="gpu") == "paged"  # decode steps
    assert pa.kernel_for(cfg, 16, jnp.bfloat16, backend="gpu") == "paged"  # short chunks
    assert pa.kernel_for(cfg, 2048, jnp.float32, backend="gpu") == "paged"
    assert pa.kernel_for(cfg, 2048, jnp.bfloat16, window=4096, backend="gpu") == "paged"
    assert pa.kernel_for(cfg, 2048, jnp.bfloat16, window=4096, local=False, backend="gpu") == "cudnn"
    assert pa.kernel_for(cfg.replace(head_dim=256), 2048, jnp.bfloat16, backend="gpu") == "paged"
    # asked for: cuDNN where it can, else the same calls through XLA
    forced = cfg.replace(prefill_attention="cudnn")
    assert pa.kernel_for(forced, 2048, jnp.bfloat16, backend="gpu") == "cudnn"
    assert pa.kernel_for(forced, 2048, jnp.bfloat16, backend="cpu") == "xla"
    assert pa.kernel_for(forced, 64, jnp.bfloat16, window=20, local=jnp.array(True), backend="gpu") == "xla"
    assert pa.kernel_for(cfg.replace(prefill_attention="xla"), 4, jnp.float32) == "xla"
    with pytest.raises(ValueError, match="prefill_attention must be None or one of"):
        C.tiny(prefill_attention="flash")
    with pytest.raises(ValueError, match="context_block must be a positive int"):
        C.tiny(context_block=0)
    q = jnp.zeros((1, 4, 4, 16), jnp.float32)
    with pytest.raises(ValueError, match="cuDNN attention takes"):
        pa.prefill_attention(q, q, q, jnp.zeros((1, 4), jnp.int32), None, 0, scale=1.0, implementation="cudnn")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
def test_cudnn_prefill_attention_equals_paged_in_bfloat16():
    cfg = C.tiny(dtype="bfloat16", context_block=16)
    params = init_params(cfg, jax.random.key(0))
    want = _chunked_logits(cfg.replace(prefill_attention="paged"), params, chunk=128)
    got = _chunked_logits(cfg.replace(prefill_attention="cudnn"), params, chunk=128)
    assert_close(got.astype(jnp.float32), want.astype(jnp.float32), dtype="bfloat16",
                 what="cuDNN prefill attention vs paged, bfloat16")
