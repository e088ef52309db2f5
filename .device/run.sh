#!/usr/bin/env bash
# The session's GPU check: the CUDA tests and the GPU benchmark (see docs/benchmarks.md).
set -o pipefail
export PYTHONUNBUFFERED=1 PROBES_LANE=device DS_ACCELERATOR=cuda
nvidia-smi -L
python3 -c "import torch, transformers, pyarrow; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py tests/stats/test_cuda_sync.py 2>&1 | tail -40 | tee "$OUT/cuda_tests.log"
timeout 150 python3 -m benchmarks.gpu_overhead 2>&1 | tail -30 | tee "$OUT/gpu_overhead.md"
timeout 100 python3 -m benchmarks.gpu_step --quick 2>&1 | tail -30 | tee "$OUT/gpu_step.md"
