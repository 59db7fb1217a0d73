#!/usr/bin/env bash
# The checks that need a GPU, in one script: every built-in block with --device cuda (the CLI, the JSON
# report), the GPU tests (blocks, dropout, the fault catalogue with its correct twins, a case file) and
# the step and check benchmarks on GPUs. Under 5 minutes on one machine with 1 to 8 GPUs; with one GPU
# only world size 1 runs (NCCL refuses two ranks on one GPU) and the catalogue is skipped.
#
# Needs a CUDA build of torch with NCCL and tpcheck installed with its test extra
# (pip install -e '.[test]'); uses .venv/bin/python when there is one, else $PYTHON or python.
# Prints one line per part (ok, or FAILED with the tail of its log); logs and JSON in $OUT_DIR
# (default benchmarks/results/gpu). Exit 0 when every part passed, 1 otherwise, 2 without a GPU.
set -u
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
OUT=${OUT_DIR:-benchmarks/results/gpu}
LIMIT=${PART_LIMIT_S:-240}
mkdir -p "$OUT"
export PYTORCH_NVML_BASED_CUDA_CHECK=1  # counting GPUs never starts CUDA in a process that forks ranks

gpus=$($PY -c "import torch; print(torch.cuda.device_count() if torch.backends.cuda.is_built() else 0)")
$PY -c "import torch, torch.distributed as d; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', d.is_nccl_available())"
command -v nvidia-smi >/dev/null && nvidia-smi -L
if [ "${gpus:-0}" -lt 1 ]; then
    echo "gpu_check: no GPU visible to torch ($PY); nothing to check" >&2
    exit 2
fi
W=$(( gpus >= 2 ? 2 : 1 ))
echo "gpus $gpus, world sizes 1..$W"

status=0
part() {
    local name=$1 t0 rc
    shift
    t0=$(date +%s)
    timeout "$LIMIT" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
        echo "ok     $name ($(( $(date +%s) - t0 )) s)"
    else
        echo "FAILED $name (exit $rc after $(( $(date +%s) - t0 )) s; $OUT/$name.log)"
        tail -n 25 "$OUT/$name.log"
        status=1
    fi
}

part blocks "$PY" -m tpcheck run --block mlp attention layer lm embedding cross_entropy --preset tiny \
    --world-size $(seq -s ' ' 1 $W) --dtype float32 bf16 --device cuda -q --json "$OUT/blocks.json"
part tests "$PY" -m pytest -q -p no:cacheprovider tests/gpu tests/check/test_devices.py -rs
part step "$PY" benchmarks/bench_step.py --quick --device cuda --world-size $W
part check "$PY" benchmarks/bench_check.py --quick --device cuda --world-size $W
cp benchmarks/results/step_cuda.json benchmarks/results/check_cuda.json "$OUT/" 2>/dev/null
grep -h "TARGET\|^|" "$OUT/step.log" "$OUT/check.log" 2>/dev/null
exit $status
