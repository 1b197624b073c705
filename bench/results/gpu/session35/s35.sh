#!/bin/bash
# Session 35's GPU work (outside git). From the repository root on the GPU machine:
#   source .device/setup.sh > /dev/null && BENCH_COMMIT=<hash> OUT=$OUT bash .device/s35.sh PART
# Each part packs what it wrote into $OUT/PART.tar.gz (a call brings back few files).
set -u
part=${1:?usage: s35.sh engine|ab|prompts|ck|gap|tailrun|default|steps}
ck=${CK:-/root/ck}
work=${WORK:-/root/s35}/$part
mkdir -p "$OUT" "$ck" "$work"
began=$SECONDS
say() { echo "[s35 $part $((SECONDS - began)) s] $*"; }
pack() { tar -C "${WORK:-/root/s35}" -czf "$OUT/$part.tar.gz" "$part"; say "packed $(du -h "$OUT/$part.tar.gz" | cut -f1)"; }
trap pack EXIT

checkpoints() {  # the 2.6B shape, decisive, and its drafter of the published shape, as gpu_serve.sh makes them
  if [ ! -f "$ck/2.6b/config.json" ]; then
    say "random 2.6B checkpoint"
    python -m bench.random_checkpoint --preset lfm2.5-2.6b --dtype bfloat16 --decisive 0.03125 --out "$ck/2.6b" \
      > "$work/ck.log" 2>&1 || { tail -5 "$work/ck.log"; return 1; }
  fi
  if [ ! -f "$ck/2.6b-dspark/config.json" ]; then
    python -m daemon.cli make-tiny --kind dspark --target "$ck/2.6b" --out "$ck/2.6b-dspark" --layers 5 --heads 32 \
      --kv-heads 8 --head-dim 64 --intermediate 6144 --rank 256 --block-size 9 --taps 2,9,17,21,27 --rope-theta 1e7 \
      --dtype bfloat16 > "$work/ckd.log" 2>&1 || { tail -5 "$work/ckd.log"; return 1; }
  fi
  say "checkpoints ready"
}

ready() {  # url pid: until /ready answers 200 (300 s at most), or the server exits
  local deadline=$((SECONDS + 300))
  until python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/ready", timeout=2)' "$1" 2>/dev/null; do
    kill -0 "$2" 2>/dev/null || { say "server $2 exited before it was ready"; return 1; }
    [ $SECONDS -lt $deadline ] || { say "server $2 not ready after 300 s"; return 1; }
    sleep 1
  done
}

engine() {  # drafted vs plain at the published profile, every round logged
  timeout 400 python -m bench.bench_engine --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --decisive 1 --out "$work" \
    --name overlap --streams "${STREAMS:-1,16}" --prompt-tokens 256 --gen-tokens 1024 --alternations 5 --log "$work/engine.log" \
    2>&1 | tail -25
  gzip -f "$work/engine.log"
  python -m bench.round_phases "$work/engine.log.gz" --out "$work" --name rounds --min-rounds 20 ${TAILS:+--tails $TAILS} 2>&1 | tail -40
}

ab() {  # laneserve at this commit beside BASE (50751f6: before steady prompt reads), alone, in turns
  local base_commit=${BASE:-50751f6}
  python -m bench.serve_scripted --log-level DEBUG --model "$ck/2.6b" --draft-model "$ck/2.6b-dspark" --port 8301 \
    --max-streams 16 --prompt-lookup 0 > "$work/head.log" 2>&1 &
  local head=$!
  (cd .device/code-$base_commit && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec python -m bench.serve_scripted \
    --log-level DEBUG --model "$ck/2.6b" --draft-model "$ck/2.6b-dspark" --port 8305 --max-streams 16 --prompt-lookup 0) \
    > "$work/base.log" 2>&1 &
  local base=$!
  if ready http://127.0.0.1:8301 $head && ready http://127.0.0.1:8305 $base; then
    say "both servers ready"
    timeout "${BUDGET:-200}" python -m bench.bench_concurrent --url "laneserve-$BENCH_COMMIT=http://127.0.0.1:8301" \
      --url "laneserve-$base_commit=http://127.0.0.1:8305" --streams 16 --draft both --rounds 6 --min-seconds 5 --max-tokens 128 \
      --max-tokens-spread 0.25 --time-budget "$((${BUDGET:-200} - 20))" --out "$work" 2>&1 | tail -30
  else
    tail -20 "$work/head.log" "$work/base.log"
  fi
  kill $head $base 2>/dev/null; wait $head $base 2>/dev/null
  for f in head base; do echo "$f: $(grep -h "listening on\|serving on" "$work/$f.log" | cut -c1-23 | tr '\n' ' ')"; done | tee "$work/startup.txt"
  rm -f "$work"/*.png
  gzip -f "$work/head.log" "$work/base.log"
  python -m bench.round_phases "$work/head.log.gz" --out "$work" --name rounds-head --min-rounds 30 2>&1 | tail -12
  python -m bench.round_phases "$work/base.log.gz" --out "$work" --name rounds-base --min-rounds 30 2>&1 | tail -12
}

prompts() {  # a prompt read of a new row count against a steady one
  python -m bench.bench_prompt_reads --model "$ck/2.6b" --out "$work" --length 48 --lanes 4 --long 0 --name prompt-joins-2.6b 2>&1 | tail -12
  python -m bench.bench_prompt_reads --model "$ck/2.6b" --out "$work" --long 0 --name prompt-reads-2.6b 2>&1 | tail -12
}

ck() { :; }  # the checkpoints alone

steps() {  # one plain step, one drafting round and a joining lane's prompt read of 48 tokens (compiled, eager)
  timeout 240 python -m bench.bench_step --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --lanes 1,16 --read 48 \
    --seconds 1 --turns 5 --out "$work" --name step-read 2>&1 | tail -8
}

default() {  # the embedded default: drafted (fixed, priced, with lookup) against plain, greedy, held-out prompts
  timeout "${BUDGET:-400}" python -m bench.bench_default --out "$work" --name default --repeats "${REPEATS:-2}" 2>&1 | tail -20
}

gap() {  # a step and a drafting round with slots 0..N-1 (views) and behind a hole (slot ids)
  timeout 300 python -m bench.bench_step --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --lanes "${LANES:-8,15,16}" --slot-gap \
    --seconds 1 --turns 5 --out "$work" --name slot-gap 2>&1 | tail -6
}

tailrun() {  # drafted / plain at 16 streams, with its tail: this code beside SETTINGS (an earlier code, MLX settings)
  timeout "${BUDGET:-480}" python -m bench.backend_settings --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --out "$work" \
    --settings "${SETTINGS:-default;code=.device/code-ba1e835;MLX_USE_CUDA_GRAPHS=0}" --streams ${STREAMS:-16} --alternations "${ALTS:-5}" \
    --name tail 2>&1 | tee "$work/tail.log" | grep -v "^alternation" | tail -40
  gzip -f "$work/tail.log"
}

nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
checkpoints || exit 1
"$part"
say "done"
