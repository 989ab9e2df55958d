#!/usr/bin/env bash
# The checks that need a GPU, in one go, for a machine lent for minutes, in this order:
#   1. the engine's tests on CUDA (test_cuda_engine.py, the Triton backend, speculative decoding's
#      Triton path, the sampler's Triton kernels), then bench/sampler.py on the GPU: the sampler's
#      device path with its draws as torch ops against the Triton kernels;
#   2. bench/engine_realistic.py on the GPU in bf16: Strata vs transformers generate (static batches) vs
#      transformers' continuous batching (vLLM's CPU build does not run there); then M's sampled points
#      again with Strata's sampler in torch ops (--strata-sampler-backend torch), the A/B of its Triton kernels;
#   3. the Triton kernels' tests on CUDA, in the time that is left.
#
#   bench/gpu_checks.sh OUT_DIR [quick|full] [TOKENIZERS_DIR]
#
# quick: the M shape at the bench's --quick sizes; full: M and L at its full sizes, three runs of
# each point. TOKENIZERS_DIR: tokenizers shared/realistic_models.py trained elsewhere (its
# STRATA_HOME/tokenizers), so that the GPU machine does not spend its minutes training them.
# Each part has a time limit (TESTS_S, SAMPLER_S, BENCH_S, AB_S, KERNELS_S seconds) and a failure does not stop the
# next. Everything lands in OUT_DIR (12 files).
set -uo pipefail
out=${1:?usage: bench/gpu_checks.sh OUT_DIR [quick|full] [TOKENIZERS_DIR]}
size=${2:-quick}
tokenizers=${3:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 STRATA_HOME=${STRATA_HOME:-/tmp/strata-gpu}
py=${PYTHON:-python3}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $py -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$out/machine.txt" 2>&1

echo "== engine tests on CUDA"
timeout "${TESTS_S:-150}" $py -m pytest -q -rs -p no:cacheprovider --timeout 120 \
  tests/engine/test_cuda_engine.py tests/engine/test_triton_backend.py \
  tests/engine/test_spec_decode.py tests/engine/test_sampler_device_path.py \
  tests/engine/test_sampler_triton.py -k "cuda or triton" 2>&1 | tee "$out/engine_tests.log" | tail -25

echo "== sampler"
timeout "${SAMPLER_S:-60}" $py bench/sampler.py --device cuda --no-reference --repeats 10 \
  --out "$out/sampler_gpu.json" 2>&1 | tee "$out/sampler.log"

echo "== models"
$py -m shared.realistic_models M L ${tokenizers:+--tokenizers "$tokenizers"} 2>&1 | tee "$out/models.log"

echo "== bench ($size)"
# full: three runs of every point (the bench's L default is one, sized for a CPU) and 64 decode tokens.
if [ "$size" = quick ]; then shapes=(--shapes M --quick); else shapes=(--shapes M,L --repeats 3 --decode-tokens 64); fi
timeout "${BENCH_S:-360}" $py bench/engine_realistic.py --device cuda --dtype bfloat16 "${shapes[@]}" \
  --runners strata,hf-static,hf-cb --threads 8 --kv-cache-gib 16 --quiet-wait 0 --noise-budget 0 \
  --out "$out/engine_realistic_gpu.json" --png "$out/engine_realistic_gpu.png" 2>&1 | tee "$out/bench.log"
if [ "$size" = quick ]; then ab=(--quick); else ab=(--repeats 3 --decode-tokens 64); fi
timeout "${AB_S:-120}" $py bench/engine_realistic.py --device cuda --dtype bfloat16 --shapes M --modes sampled "${ab[@]}" \
  --runners strata --strata-sampler-backend torch --threads 8 --kv-cache-gib 16 --quiet-wait 0 --noise-budget 0 \
  --out "$out/engine_realistic_gpu_torch_sampler.json" --png "$out/engine_realistic_gpu_torch_sampler.png" 2>&1 \
  | tee -a "$out/bench.log"
# The runners' own logs, kept by the bench when a runner failed.
tail -n 40 /tmp/engine_realistic_*/*.log > "$out/runner_logs.txt" 2>/dev/null

echo "== kernel tests on CUDA"
timeout "${KERNELS_S:-120}" $py -m pytest -q -rs -p no:cacheprovider --timeout 60 tests/kernels 2>&1 \
  | tee "$out/kernel_tests.log" | tail -15
