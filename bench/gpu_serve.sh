#!/bin/bash
# laneserve against mlx_lm.server over HTTP, on the GPU machine, in one call of at most
# 10 minutes (see bench/results/README.md, "Serving over HTTP"):
#
#   source .device/setup.sh && BENCH_COMMIT=<commit> bash bench/gpu_serve.sh OUT
#
# BENCH_COMMIT names the commit of the tree (its copy on the GPU machine has no reliable
# git metadata; commit first, as the copy carries uncommitted changes too): the result
# files record it with their command and machine (bench/provenance.py).
# For each model (random bf16 checkpoints of the LFM2.5-2.6B and LFM2.5-8B-A1B shapes,
# each with a DSpark drafter of the published shape, made decisive so that the scripted
# drafter keeps its track; see bench/random_checkpoint.py): start laneserve with the
# measurement-only scripted-acceptance drafter at the published profile
# (bench/serve_scripted.py) and mlx_lm.server on the same checkpoint, run bench_concurrent
# at 1/4/8/16 streams with drafting on and off against both, then bench.exact against
# laneserve. The next model's servers start while bench.exact runs. Everything lands
# under OUT/<model>/ (results, server logs); each step prints its progress and
# bench_concurrent rewrites its JSON after every cell, so a cut-short call leaves what
# it measured. Each model's bench_concurrent gets an equal share of what is left of
# BUDGET and runs as many whole rounds as fit (the first always runs). One model's files
# are the 8 a call of the GPU machine brings back: run MODELS=2.6b and MODELS=8b apart.
#
# Env: CHECKPOINTS (/root/ck), BUDGET (560 s), MIN_SECONDS (5), ROUNDS (at most; 5),
# MAX_TOKENS (128), STREAMS (1,4,8,16), MODELS ("2.6b 8b"), EXACT_RESERVE (45 s a model),
# SPREAD (0): bench_concurrent's --max-tokens-spread (replies of varied lengths, so plain
# lanes do not end in one round and rejoin together; see bench_concurrent).
# LOG_LEVEL (INFO): laneserve's --log-level (DEBUG logs every round and guard decision).
# LOOKUP (0): laneserve's --prompt-lookup. Off by default: a decisive random target's
# replies repeat themselves, so lookup's copies are accepted nearly whole and the drafted
# figures would measure those loops, not the drafter at the published profile (session
# 30's run with lookup on: 0.99 of first drafts kept against the profile's 0.865).
# BESIDE=DIR: a second laneserve from the code in DIR (an earlier commit's tree,
# `bench.export_code`; carry it to the GPU machine under .device/) serves the same
# checkpoint on the next port but four, a third server in bench_concurrent's turns, named
# laneserve-<its commit>: a change to the code measured beside the code before it.
# SMOKE=1: the same on the tiny presets in float32 with short settings (a CPU check).
set -u
out=${1:?usage: BENCH_COMMIT=<commit> gpu_serve.sh OUT}
[ "${SMOKE:-0}" = 1 ] || : "${BENCH_COMMIT:?usage: BENCH_COMMIT=<commit> gpu_serve.sh OUT (the commit of this tree)}"
ck=${CHECKPOINTS:-/root/ck}
budget=${BUDGET:-560}
exact_reserve=${EXACT_RESERVE:-45}
lookup=${LOOKUP:-0}
models=${MODELS:-2.6b 8b}
if [ "${SMOKE:-0}" = 1 ]; then
  min_seconds=${MIN_SECONDS:-1}; rounds=${ROUNDS:-2}; max_tokens=${MAX_TOKENS:-8}; streams=${STREAMS:-1,2}
  exact_streams=2; exact_tokens=8; dtype=float32
else
  min_seconds=${MIN_SECONDS:-5}; rounds=${ROUNDS:-5}; max_tokens=${MAX_TOKENS:-128}; streams=${STREAMS:-1,4,8,16}
  exact_streams=16; exact_tokens=32; dtype=bfloat16
fi
mkdir -p "$out" "$ck"
beside=""
if [ -n "${BESIDE:-}" ]; then
  beside=$(cd "$BESIDE" && pwd) || exit 1
  beside_name="laneserve-$(cat "$beside/COMMIT" 2>/dev/null || basename "$beside")"
fi
began=$SECONDS
say() { echo "[gpu_serve $((SECONDS - began)) s] $*"; }
declare -A model_pids
stop_servers() { for pid in "$@"; do kill "$pid" 2>/dev/null; done; for pid in "$@"; do wait "$pid" 2>/dev/null; done; }
trap 'stop_servers ${model_pids[*]}' EXIT

# preset, drafter taps, drafter rope theta, laneserve port, mlx_lm port
spec() {
  case "$1" in
  2.6b) [ "${SMOKE:-0}" = 1 ] && echo "tiny 1,3,5 1e4 8201 8202" || echo "lfm2.5-2.6b 2,9,17,21,27 1e7 8201 8202" ;;
  8b) [ "${SMOKE:-0}" = 1 ] && echo "tiny-moe 1,3,5 1e4 8211 8212" || echo "lfm2-8b-a1b 2,6,10,14,18 5e6 8211 8212" ;;
  esac
}

checkpoints() {  # model
  read -r preset taps theta _ _ <<<"$(spec "$1")"
  local target="$ck/$1" drafter="$ck/$1-dspark"
  if [ ! -f "$target/config.json" ]; then
    say "$1: random $preset checkpoint ($dtype, decisive 1/32)"
    python -m bench.random_checkpoint --preset "$preset" --dtype "$dtype" --decisive 0.03125 --out "$target" || return 1
  fi
  if [ ! -f "$drafter/config.json" ]; then
    say "$1: DSpark drafter of the published shape"
    if [ "${SMOKE:-0}" = 1 ]; then
      python -m daemon.cli make-tiny --kind dspark --target "$target" --out "$drafter" --taps "$taps" || return 1
    else
      python -m daemon.cli make-tiny --kind dspark --target "$target" --out "$drafter" --layers 5 --heads 32 \
        --kv-heads 8 --head-dim 64 --intermediate 6144 --rank 256 --block-size 9 --taps "$taps" \
        --rope-theta "$theta" --dtype bfloat16 || return 1
    fi
  fi
}

start_servers() {  # model: starts both servers in the background, their pids in model_pids
  read -r _ _ _ lport mport <<<"$(spec "$1")"
  mkdir -p "$out/$1"
  python -m bench.serve_scripted --log-level "${LOG_LEVEL:-INFO}" --model "$ck/$1" --draft-model "$ck/$1-dspark" --port "$lport" \
    --max-streams 16 --prompt-lookup "$lookup" >"$out/$1/laneserve.log" 2>&1 &
  local lpid=$!
  python -m mlx_lm.server --model "$ck/$1" --port "$mport" >"$out/$1/mlx_lm.log" 2>&1 &
  local mpid=$!
  model_pids[$1]="$lpid $mpid"
  say "$1: laneserve (pid $lpid, port $lport) and mlx_lm.server (pid $mpid, port $mport) starting"
  if [ -n "$beside" ]; then  # run from its own tree, whose packages come first on the path
    (cd "$beside" && PYTHONPATH="$beside${PYTHONPATH:+:$PYTHONPATH}" exec python -m bench.serve_scripted --model "$ck/$1" \
      --draft-model "$ck/$1-dspark" --port $((lport + 4)) --max-streams 16 --prompt-lookup "$lookup") >"/tmp/gpu_serve-$1-$beside_name.log" 2>&1 &
    model_pids[$1]="${model_pids[$1]} $!"
    # Its log stays on the machine: a call brings back 8 files, which one model's fill.
    say "$1: $beside_name (pid $!, port $((lport + 4))) starting, log /tmp/gpu_serve-$1-$beside_name.log"
  fi
}

wait_ready() {  # model: until laneserve's /ready and mlx_lm's /health answer 200, or a server exits
  read -r _ _ _ lport mport <<<"$(spec "$1")"
  python - "$lport" "$mport" "$1" "$beside" ${model_pids[$1]} <<'PY' || return 1
import os, sys, time, urllib.request
def up(url):
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False
def gone(pid):  # exited (a zombie until the shell waits for it)
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
lport, mport, model, beside, *pids = sys.argv[1:]
ready = [f"http://127.0.0.1:{lport}/ready", f"http://127.0.0.1:{mport}/health"]
if beside:
    ready.append(f"http://127.0.0.1:{int(lport) + 4}/ready")
start = time.monotonic()
while not all(up(url) for url in ready):
    if exited := [pid for pid in pids if gone(pid)]:  # no waiting out the timeout on a dead server
        sys.exit(f"{model}: server pid {', '.join(exited)} exited before it was ready (its log says why)")
    if time.monotonic() - start > 300:
        sys.exit(f"{model}: servers not ready after 300 s")
    time.sleep(0.5)
PY
  say "$1: servers ready"
}

bench() {  # model, seconds for bench_concurrent
  read -r _ _ _ lport mport <<<"$(spec "$1")"
  say "$1: bench_concurrent, streams $streams, at least $min_seconds s a cell, up to $rounds rounds within $2 s"
  python -m bench.bench_concurrent --url "laneserve=http://127.0.0.1:$lport" --url "mlx_lm=http://127.0.0.1:$mport" \
    ${beside:+--url "$beside_name=http://127.0.0.1:$((lport + 4))"} --streams "$streams" --draft both --rounds "$rounds" --min-seconds "$min_seconds" --max-tokens "$max_tokens" --max-tokens-spread "${SPREAD:-0}" \
    --time-budget "$2" --out "$out/$1" 2>&1 | tee "$out/$1/bench_concurrent.log"
}

exact() {  # model
  read -r _ _ _ lport _ <<<"$(spec "$1")"
  say "$1: bench.exact against laneserve, $exact_streams streams, $exact_tokens tokens"
  python -m bench.exact --url "http://127.0.0.1:$lport" --streams "$exact_streams" --max-tokens "$exact_tokens" \
    --out "$out/$1/exact.json" 2>&1 | tee "$out/$1/exact.log"
}

share() {  # models left: bench_concurrent's seconds for the next one
  local left=$((budget - (SECONDS - began) - exact_reserve * $1))
  echo $((left > $1 * 30 ? left / $1 : 30))
}

set -- $models
checkpoints "$1" || { say "$1: checkpoints failed"; exit 1; }
start_servers "$1"
# The other models' checkpoints are made while the first servers load; nothing is timed
# until they are written.
(for model in "${@:2}"; do checkpoints "$model" || say "$model: checkpoints failed"; done) &
wait $!
left=$#
for model in "$@"; do
  shift
  if ! wait_ready "$model"; then
    say "$model: servers did not come up (logs under $out/$model)"
  else
    bench "$model" "$(share "$left")"
  fi
  [ $# -gt 0 ] && start_servers "$1"
  exact "$model"
  stop_servers ${model_pids[$model]}
  say "$model: done, its servers stopped"
  left=$((left - 1))
done
say "all done; results under $out"
