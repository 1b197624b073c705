#!/bin/bash
# The GPU benchmark suite, as run on the project's H200 (see bench/results/README.md).
#
#   bash bench/gpu_suite.sh OUT 2.6b     # LFM2.5-2.6B shape: target vs mlx-lm, drafting costs, engine
#   bash bench/gpu_suite.sh OUT engine   # LFM2.5-2.6B shape: the engine benchmark alone, with its debug log
#   bash bench/gpu_suite.sh OUT 8b       # LFM2(.5)-8B-A1B shape: target vs mlx-lm, load memory
#
# Random bf16 checkpoints of the released shapes are written under $CHECKPOINTS
# (default /root/ck). Each step writes its own result files under OUT and a failing
# step does not stop the next one.
set -u
out=${1:?usage: gpu_suite.sh OUT 2.6b|engine|8b}
shape=${2:?usage: gpu_suite.sh OUT 2.6b|engine|8b}
ck=${CHECKPOINTS:-/root/ck}
mkdir -p "$out" "$ck"
step() { echo "== $*"; "$@" || echo "!! step failed ($?): $*"; }

checkpoints_2_6b() {
  [ -f "$ck/2.6b/config.json" ] || step python -m bench.random_checkpoint --preset lfm2.5-2.6b --out "$ck/2.6b"
  [ -f "$ck/2.6b-dspark/config.json" ] || step python -m daemon.cli make-tiny --kind dspark --target "$ck/2.6b" \
    --out "$ck/2.6b-dspark" --layers 5 --heads 32 --kv-heads 8 --head-dim 64 --intermediate 6144 --rank 256 \
    --block-size 9 --taps 2,9,17,21,27 --rope-theta 1e7 --dtype bfloat16
}
engine_2_6b() {
  step python -m bench.bench_engine --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --out "$out/engine" \
    --alternations 5 --log "$out/engine.log"
  step python -m bench.bench_engine --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --out "$out/long" --streams '' \
    --long-contexts "${LONG_CONTEXTS:-4096,32768,126000}" --long-alternations 3 --long-gen-tokens 256 --log "$out/long.log"
}

case "$shape" in
2.6b)
  checkpoints_2_6b
  step python -m bench.bench_target --model "$ck/2.6b" --out "$out" --name gpu-lfm2.5-2.6b --alternations 5
  step python -m bench.bench_drafting --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --out "$out/gpu-drafting-2.6b"
  engine_2_6b
  ;;
engine)
  checkpoints_2_6b
  engine_2_6b
  ;;
8b)
  [ -f "$ck/8b/config.json" ] || step python -m bench.random_checkpoint --preset lfm2-8b-a1b --out "$ck/8b"
  step python -m bench.bench_target --model "$ck/8b" --out "$out" --name gpu-lfm2-8b-a1b --alternations 5
  step python -m bench.bench_load_memory --model "$ck/8b" --out "$out" --name gpu-load-memory-lfm2-8b-a1b
  ;;
esac
