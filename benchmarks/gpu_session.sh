#!/usr/bin/env bash
# One lent-GPU session's checks, in the order that matters if time runs out. Each step has its own
# time limit and writes its output under $OUT (the device tool brings that folder back).
#
#   device run, carry [.whl]: bash benchmarks/gpu_session.sh
#
# 1. conformance goldens on CUDA (float32: the CUDA path of model + decode loop vs the reference)
# 2. the shipped testbed checkpoint evaluated on CUDA in float32 (must match the card's CPU
#    numbers) and bfloat16
# 3. one MoE layer of mini's size: grouped GEMM vs per-expert reference (time, error vs fp32)
# 4. full-scale decode, random weights in mini's shapes, bf16: Q/S x batch 1/8, grouped MoE;
#    then the reference MoE at batch 1 (Q)
# 5. official-format checkpoint round trip at mini's shapes (first 4 layers): save, load onto the
#    GPU, decode the same tokens
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -d .whl ]; then  # packages the GPU image lacks (pydantic), carried as wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
fi
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$?"; tail -n 4 "$OUT/$name.txt"; }

nvidia-smi -L
python3 -c "import torch, torch.nn.functional as F; print('torch', torch.__version__, torch.cuda.get_device_name(), 'grouped_mm', hasattr(F, 'grouped_mm'))"

step conformance-tiny 90 python3 -m dlm_toolkit.cli conformance conformance/llada2_tiny --device cuda
step conformance-mask 90 python3 -m dlm_toolkit.cli conformance conformance/llada2_mask --device cuda
for dtype in float32 bfloat16; do
    for task in add tiesort either; do
        step "eval-$task-$dtype" 90 python3 -m dlm_toolkit.cli eval --checkpoint checkpoints/testbed-v2-editable \
            --task "$task" --n 500 --seed 0 --batch-size 100 --device cuda --dtype "$dtype" --json --no-progress
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r.get(k) for k in ('accuracy','tpf','nfe_mean','tokens_per_second')})" "$OUT/eval-$task-$dtype.txt" 2>/dev/null
    done
done
step moe-mini 120 python3 benchmarks/moe_speed.py --device cuda --dims mini --tokens 32 256 2048
step full-scale-mini 240 python3 benchmarks/full_scale.py --shape mini --json
step full-scale-mini-reference 150 python3 benchmarks/full_scale.py --shape mini --json --moe-impl reference --presets Q --batch 1
step roundtrip-mini 240 python3 benchmarks/full_scale.py --shape mini --layers 4 --json --presets Q S --batch 8 --roundtrip /tmp/mini-4l
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
