#!/usr/bin/env bash
# One lent-GPU session's checks for issue 25 (CUDA graphs, the weight-read bound), in the order
# that matters if time runs out; under 8 minutes in all. Each step has its own time limit and
# writes its output under $OUT (the device tool brings that folder back).
#
#   device run, carry [.whl]: bash benchmarks/gpu_session.sh
#
# 1. the capture tests on CUDA (tests/test_capture.py defines its CUDA-graph tests only where CUDA
#    exists: graph replay == eager bit for bit in float32 and bf16, host-read fallback)
# 2. conformance goldens on CUDA, forwards replayed from CUDA graphs (decode's default on CUDA)
# 3. one MoE layer of mini's size: grouped GEMM's expert-read rate over the copy rate (target >= 0.5
#    at 32 tokens)
# 4. full-scale decode, random weights in mini's shapes, bf16, block 32: Q/S x batch 1/8/32, eager
#    and CUDA graphs side by side (tokens/s, step ms per forward, GPU busy, kernels and aten ops
#    per forward, experts hit, bytes per forward, copy rate, weight-read bound, fraction_of_bound)
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -d .whl ]; then  # packages the GPU image lacks (pydantic), carried as wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
fi
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$?"; tail -n 4 "$OUT/$name.txt"; }

nvidia-smi -L
python3 -c "import torch, torch.nn.functional as F; print('torch', torch.__version__, torch.cuda.get_device_name(), 'grouped_mm', hasattr(F, 'grouped_mm'))"

step capture-tests 60 python3 -m pytest tests/test_capture.py -q -p no:cacheprovider
step conformance-tiny 60 python3 -m dlm_toolkit.cli conformance conformance/llada2_tiny --device cuda
step moe-mini 45 python3 benchmarks/moe_speed.py --device cuda --dims mini --tokens 32 256
step full-scale-mini 270 python3 benchmarks/full_scale.py --shape mini --json
python3 - "$OUT/full-scale-mini.txt" <<'PY'
import json, sys
keys = ("preset", "batch", "tokens_per_second", "tokens_per_second_graphs", "tokens_identical_graphs",
        "step_ms_per_forward", "step_ms_per_forward_graphs", "gpu_busy_fraction", "gpu_busy_fraction_graphs",
        "kernels_per_forward", "aten_ops_per_forward", "experts_hit_per_moe_layer", "bytes_per_forward",
        "copy_bandwidth_gb_s", "bound_ms_per_forward", "fraction_of_bound", "fraction_of_bound_graphs")
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        print({k: (round(r[k], 3) if isinstance(r.get(k), float) else r.get(k)) for k in keys})
PY
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
