#!/bin/bash
# Session 36's GPU work (outside git until committed under bench/results/gpu/session36/).
# From the repository root on the GPU machine:
#   source .device/setup.sh > /dev/null && BENCH_COMMIT=<hash> OUT=$OUT bash .device/s36.sh PART
# PART: target (2.6B plain rounds vs mlx-lm at 1, 8, 16 lanes), 8b (the 8B-A1B at 16),
# long (drafting-capable vs plain engine at 4K, 32K, 126K), steps (a plain step and a
# drafting round, this code beside FAMILIES_BASE's families package if given).
# Each part packs what it wrote into $OUT/PART.tar.gz.
set -u
part=${1:?usage: s36.sh target|8b|long|kernels|steps}
work=${WORK:-/root/s36}/$part
mkdir -p "$OUT" "$work"
began=$SECONDS
say() { echo "[s36 $part $((SECONDS - began)) s] $*"; }
pack() { tar -C "${WORK:-/root/s36}" -czf "$OUT/$part.tar.gz" "$part"; say "packed $(du -h "$OUT/$part.tar.gz" | cut -f1)"; }
trap pack EXIT
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
case "$part" in
  target|8b|long) timeout "${BUDGET:-560}" bash bench/gpu_suite.sh "$work" "$part" 2>&1 | grep -v "^alternation\|^  turn" | tail -40 ;;
  kernels)  # the CUDA kernels' tests, then a step, a drafting round and a 48-token read beside base_families
    timeout "${TESTS:-200}" python -m pytest -p no:cacheprovider -q -x tests/test_residual_kernel.py tests/test_heads_kernel.py \
      tests/test_conv_kernel.py tests/test_attention_kernel.py -k "${TESTK:-not nothing}" > "$work/tests.log" 2>&1
    echo "tests rc=$?"; tail -25 "$work/tests.log"
    grep -q " passed" "$work/tests.log" && ! grep -q "failed\|error" "$work/tests.log" || { say "tests did not pass"; exit 1; }
    ck=/root/ck; mkdir -p $ck /tmp/base
    [ -f $ck/2.6b/config.json ] || python -m bench.random_checkpoint --preset lfm2.5-2.6b --out $ck/2.6b > /dev/null
    [ -f $ck/2.6b-dspark/config.json ] || python -m daemon.cli make-tiny --kind dspark --target $ck/2.6b \
      --out $ck/2.6b-dspark --layers 5 --heads 32 --kv-heads 8 --head-dim 64 --intermediate 6144 --rank 256 \
      --block-size 9 --taps 2,9,17,21,27 --rope-theta 1e7 --dtype bfloat16 > /dev/null
    cp -r .device/code-$BASE/families /tmp/base/base_families
    PYTHONPATH=/tmp/base:$PYTHONPATH timeout "${BUDGET:-240}" python -m bench.bench_step --model $ck/2.6b \
      --drafter $ck/2.6b-dspark --lanes 1,16 --read 48 --seconds "${STEP_SECONDS:-1}" --turns 5 --families families,base_families \
      --out "$work" --name step-beside 2>&1 | tail -20 ;;
  steps)
    ck=/root/ck; mkdir -p $ck
    [ -f $ck/2.6b/config.json ] || python -m bench.random_checkpoint --preset lfm2.5-2.6b --out $ck/2.6b > /dev/null
    [ -f $ck/2.6b-dspark/config.json ] || python -m daemon.cli make-tiny --kind dspark --target $ck/2.6b \
      --out $ck/2.6b-dspark --layers 5 --heads 32 --kv-heads 8 --head-dim 64 --intermediate 6144 --rank 256 \
      --block-size 9 --taps 2,9,17,21,27 --rope-theta 1e7 --dtype bfloat16 > /dev/null
    timeout "${BUDGET:-300}" python -m bench.bench_step --model /root/ck/2.6b --drafter /root/ck/2.6b-dspark --lanes 1,16 \
      --seconds 1 --turns 5 ${FAMILIES:+--families $FAMILIES} --out "$work" --name step 2>&1 | tail -12 ;;
esac
say "done"
