#!/bin/bash
# Session 38's GPU plan, not run (no machine could be started). Copy it to .device/s38.sh; from the repository root on the GPU machine:
#   source .device/setup.sh > /dev/null && BENCH_COMMIT=<hash> OUT=$OUT bash .device/s38.sh PART
# PART: long (drafting-capable vs plain engine at 4K, 32K, 126K, every round logged),
# engine (drafted vs plain at 1 and 16 streams).
set -u
part=${1:?usage: s38.sh long|engine}
work=${WORK:-/root/s38}/$part
mkdir -p "$OUT" "$work"
began=$SECONDS
say() { echo "[s38 $part $((SECONDS - began)) s] $*"; }
pack() { tar -C "${WORK:-/root/s38}" -czf "$OUT/$part.tar.gz" "$part"; say "packed $(du -h "$OUT/$part.tar.gz" | cut -f1)"; }
trap pack EXIT
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
ck=/root/ck; mkdir -p $ck
[ -f $ck/2.6b/config.json ] || python -m bench.random_checkpoint --preset lfm2.5-2.6b --out $ck/2.6b > /dev/null
[ -f $ck/2.6b-dspark/config.json ] || python -m daemon.cli make-tiny --kind dspark --target $ck/2.6b \
  --out $ck/2.6b-dspark --layers 5 --heads 32 --kv-heads 8 --head-dim 64 --intermediate 6144 --rank 256 \
  --block-size 9 --taps 2,9,17,21,27 --rope-theta 1e7 --dtype bfloat16 > /dev/null
say "checkpoints ready"
case "$part" in
  long) timeout "${BUDGET:-560}" python -m bench.bench_engine --model $ck/2.6b --drafter $ck/2.6b-dspark --out "$work" \
      --name engine-long --streams '' --long-contexts "${CONTEXTS:-4096,32768,126000}" --long-alternations "${ALT:-6}" \
      --long-gen-tokens 1024 --long-prompt-cache --long-turn-tokens 128 --log "$work/engine-long.log" 2>&1 \
      | grep -v "^alternation\|^  turn" | tail -30
    gzip -f "$work/engine-long.log" ;;
  engine) timeout "${BUDGET:-560}" python -m bench.bench_engine --model $ck/2.6b --drafter $ck/2.6b-dspark --out "$work" \
      --name engine --streams 1,16 --gen-tokens 1024 --alternations 5 --log "$work/engine.log" 2>&1 \
      | grep -v "^alternation\|^  turn" | tail -30
    gzip -f "$work/engine.log" ;;
esac
say "done"
