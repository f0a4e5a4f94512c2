#!/usr/bin/env bash
# GPU check: our trainer on CUDA (and NCCL ranks), then vLLM hidden-state extraction over
# Mooncake, then vLLM serving our DSpark draft under our load client. No network: everything
# comes from the working tree (README.md here).
# Exit: 0 pass, 1 a check failed, 2 inputs missing or no GPU, 3 vLLM not importable, 124 timeout.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-${TMPDIR:-/tmp}/dspark-gpu-check}
WHEELS=${GPU_CHECK_WHEELHOUSE:-.whl}
TOTAL=${GPU_CHECK_SECONDS:-470}  # the whole run, wheels and imports included: under 8 minutes
mkdir -p "$OUT" || exit 2

# Wheels carried in (see README.md): installed beside the machine's own packages.
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  timeout 150 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl >"$OUT/pip.log" 2>&1 \
    || { echo "gpu-check: FAIL the wheels in $WHEELS/ did not install (see pip.log)"; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi

# Up front, in one line: without vLLM only the trainer can be checked.
vllm=1
if ! timeout 90 "$PY" -c "import vllm" >/dev/null 2>&1; then
  echo "gpu-check: FAIL vLLM is not importable here and cannot be installed: no network, and" \
    "vllm 0.33.0 (336 MB) pins torch 2.14.0 (555 MB) against a 64 MiB carry; see infra/gpu/README.md"
  vllm=0
fi

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# The trainer needs torch alone (plus pydantic, pyyaml, safetensors, tqdm): about a minute.
timeout -k 10 150 "$PY" infra/gpu/train_check.py --out "$OUT"
train=$?
[ $train -eq 124 ] && echo "gpu-check: FAIL train timed out after 150 s"
if [ $vllm -eq 0 ]; then exit 3; fi
# What is left of TOTAL: the driver's own deadline, 15 s short of this backstop.
left=$((TOTAL - SECONDS))
if [ "$left" -lt 120 ]; then
  echo "gpu-check: FAIL only ${left} s of ${TOTAL} s left after installing and importing"; exit 124
fi
timeout -k 10 "$left" "$PY" infra/gpu/check.py --out "$OUT" --budget $((left - 15)) "$@"
rc=$?
[ $rc -eq 124 ] && echo "gpu-check: FAIL timed out after ${TOTAL} s (see $OUT/*.log)"
if [ $rc -eq 0 ] && [ $train -ne 0 ]; then rc=1; fi
exit $rc
