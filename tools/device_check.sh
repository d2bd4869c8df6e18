#!/usr/bin/env bash
# The device check on a lent GPU machine (no network there): see experiments/device_check.py
# for what it measures and tools/device_stage.py for how the files travel.
#
#   tools/device_check.sh --prepare [--models smollm2-135m,gemma3-270m]
#       HERE, before the machine starts: the wheels the device image lacks into .device/whl and
#       the GGUF files cut into chunks .device/parts/NN (one per call, under the 64 MiB a call
#       carries); prints the calls to make.
#   tools/device_check.sh --stage-only
#       ON THE DEVICE: install the carried wheels, stage the carried chunk, join complete files
#       into $JAXINFER_CACHE, print jax.devices(). Quick: a call that only carries a chunk.
#   tools/device_check.sh [device_check.py arguments]
#       ON THE DEVICE: the same, then the check; JSON, PNG and log go to $OUT (the device tool's
#       folder that comes back), else experiments/out.
# Staged chunks live in /tmp, which lasts only while the machine stays warm (30 s after a call).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  shift
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec python3 tools/device_stage.py prepare "$@"
fi

STAGE=${JAXINFER_STAGE:-/tmp/jaxinfer-stage}
SITE=${JAXINFER_SITE:-/tmp/jaxinfer-site}
export JAXINFER_CACHE=${JAXINFER_CACHE:-/tmp/jaxinfer-cache}
if compgen -G ".device/whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .device/whl/*.whl || { echo "installing the carried wheels failed" >&2; exit 1; }
fi
# The repository's own jaxinfer first (it travels with every call), then the carried wheels.
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$STAGE"
for d in .device/parts/*/; do
  [ -d "$d" ] || continue
  for f in "$d"*; do [ -e "$STAGE/$(basename "$f")" ] || cp "$f" "$STAGE"/; done
done
python3 tools/device_stage.py assemble --stage "$STAGE" --cache "$JAXINFER_CACHE"

if [ "${1:-}" = "--stage-only" ]; then
  python3 -c "import jax, gguf; print(jax.devices(), 'jax', jax.__version__)"
  exit $?
fi

OUTDIR=${OUT:-experiments/out}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
# The optimized HLO of the decode and prefill programs comes back too (hlo_after_optimizations.tgz):
# what the GPU compiler made of them (copies, loops, fusions) is read here, at no device time.
HLO=${JAXINFER_HLO_DUMP:-/tmp/jaxinfer-hlo}
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_dump_to=$HLO --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_(decode|prefill|mixed_step)"
python3 -m experiments.device_check --out "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/device_check.log"
rc=${PIPESTATUS[0]}
python3 tools/device_stage.py pack-hlo --dump "$HLO" --out "$OUTDIR/hlo_after_optimizations.tgz"
exit "$rc"
