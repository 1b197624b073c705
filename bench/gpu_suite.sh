#!/bin/bash
# The GPU benchmarks behind bench/results/gpu/, as run on the project's H200, one mode a
# call (each within the 10-minute limit of one call and the 8 files that come back):
#
#   source .device/setup.sh && BENCH_COMMIT=<commit> bash bench/gpu_suite.sh OUT MODE
#
#   target    bench_target, LFM2.5-2.6B shape at 1, 8 and 16 lanes,
#             with the engine on cuBLASLt beside it (--cublas)        -> gpu-lfm2.5-2.6b.{json,md}
#   8b        bench_target, LFM2-8B-A1B shape at 16 lanes (--cublas
#             too), and its load memory                               -> gpu-lfm2-8b-a1b.*, gpu-load-memory-lfm2-8b-a1b.*
#   rows      bench_rows, 2.6B shape: a step's products for 2-16 rows,
#             laneserve's row kernel against MLX's matmul             -> rows-2.6b.{json,md}
#   launches  row_launches, 2.6B shape: the row kernel's launches per
#             weight shape for 2-16 rows, device time by CUPTI (through
#             the machine's torch), beside MLX's GEMV and matmul      -> row-launches-2.6b.{json,md}
#   experts   bench_experts, LFM2-8B-A1B shape: a step's expert products
#             for 1-16 rows, laneserve's expert kernel against
#             gather_mm                                               -> experts-8b.{json,md}
#   drafting  bench_drafting (2.6B shape, published drafter shape),
#             bench_default on the embedded default, greedy           -> drafting.*, default.*
#   engine    bench_engine, scripted acceptance at the published
#             profile, 1/4/8/16 streams, runs of 1024 tokens per
#             stream (about 2.5-8 s; 128 gave runs under a second),
#             and its rounds' time by phase (round_phases)            -> engine.{json,md}, engine.log.gz, engine-phases.*
#   long      bench_engine, acceptance falling with context, 4K to
#             126K tokens, guards on, runs of 1024 tokens (about 5 s
#             at 126K), the two engines in turns of 128 tokens, 6
#             passes (each prompt read once per engine, then
#             restored)                                 -> engine-long.{json,md}, engine-long.log.gz
#   upkeep    bench_upkeep, 2.6B shape at 32K context                 -> upkeep.{json,md}
#   prefix    bench_prefix_cache, 2.6B shape: an 8-turn chat to 4K
#             tokens, cache on and off                                -> gpu-prefix-cache-2.6b.{json,md}
#   prompts   bench_prompt_reads, 2.6B shape: prompts of new lengths,
#             fused attention for steady chunks only or for every one,
#             rows at steady widths or ragged; then four chat-sized
#             prompts joining at once                                 -> prompt-reads-2.6b.{json,md},
#                                                                        prompt-joins-2.6b.{json,md}
#   fuse      cuda_cache_fuse: MLX's graph-cache fuse, bare and with
#             laneserve's backend defaults                            -> cuda-cache-fuse.{json,md}
#   settings  backend_settings, 2.6B shape, published drafter shape:
#             the engine's plain and drafted rounds at 1 and 16 streams
#             under MLX's CUDA graph settings (graphs off, graphs of
#             up to 200 operations), each in its own process, in turns -> backend-settings.{json,md}
#   beside    backend_settings, as settings, but this tree beside the
#             code of an earlier commit: CODE=DIR names it, made here by
#             `python -m bench.export_code COMMIT .device/code-COMMIT`
#             and carried to the GPU machine with the call; EXTRA adds
#             settings after those two (';'-separated, as --settings;
#             `control` runs this tree again in a process of its own,
#             the floor under the other ratios)                      -> beside.{json,md}
#   kernels   kernel_counts, 2.6B shape: the kernels a plain and a
#             drafted round launch at 1 and 16 lanes, by name, and the
#             runtime calls that move memory (CUPTI through the
#             machine's torch), decoding only; then by round phase    -> kernels/kernel-counts.json, kernels/{table,phases}-*.txt
#   traffic   host_traffic: small int kernels' device time with host-made
#             and host-read arrays around them, at 16 lanes and 1 (MLX's
#             managed memory, CUPTI through the machine's torch)       -> host-traffic-{16,1}.{json,md}
#
# Every result file records its command, commit and machine (bench/provenance.py). The
# copy of the tree on the GPU machine has no reliable git metadata, so BENCH_COMMIT must
# name the commit it is: commit first (the copy carries uncommitted changes too), then
# pass `git rev-parse --short HEAD`. Each step prints its command (`== ...`) exactly as
# its files record it, and OUT/suite-MODE.log keeps the output. Random bf16 checkpoints
# of the released shapes are written under $CHECKPOINTS (default /root/ck) once per
# machine (decisive ones for bench_target, see checkpoint_2_6b_decisive). A failing step
# does not stop the next one.
set -u
usage="usage: BENCH_COMMIT=<commit> [CODE=<dir> [EXTRA=<settings>]] gpu_suite.sh OUT target|8b|rows|launches|experts|drafting|engine|long|upkeep|prefix|prompts|fuse|settings|beside|kernels|traffic"
out=${1:?$usage}
mode=${2:?$usage}
: "${BENCH_COMMIT:?$usage (the commit of this tree: its copy on the GPU machine has no reliable git metadata)}"
export BENCH_COMMIT
ck=${CHECKPOINTS:-/root/ck}
mkdir -p "$out" "$ck"
exec > >(tee -a "$out/suite-$mode.log") 2>&1
# Each step's command, quoted as its result files record it (shlex.join), then its seconds.
step() { python3 -c 'import shlex, sys; print("== " + shlex.join(sys.argv[1:]))' "$@"; local began=$SECONDS; "$@" || echo "!! step failed ($?): $*"; echo "-- $((SECONDS - began)) s"; }

checkpoints_2_6b() {
  [ -f "$ck/2.6b/config.json" ] || step python -m bench.random_checkpoint --preset lfm2.5-2.6b --out "$ck/2.6b"
  [ -f "$ck/2.6b-dspark/config.json" ] || step python -m daemon.cli make-tiny --kind dspark --target "$ck/2.6b" \
    --out "$ck/2.6b-dspark" --layers 5 --heads 32 --kv-heads 8 --head-dim 64 --intermediate 6144 --rank 256 \
    --block-size 9 --taps 2,9,17,21,27 --rope-theta 1e7 --dtype bfloat16
}

# bench_target's checkpoints are decisive (bench/random_checkpoint.py): greedy choices win
# by wide margins, as a trained model's do, so its 'agree' column (laneserve's tokens equal
# to mlx-lm's) checks both systems instead of recording bf16 near-ties.
checkpoint_2_6b_decisive() {
  [ -f "$ck/2.6b-decisive/config.json" ] || step python -m bench.random_checkpoint --preset lfm2.5-2.6b \
    --out "$ck/2.6b-decisive" --decisive 0.03125
}

checkpoint_8b() {
  [ -f "$ck/8b-decisive/config.json" ] || step python -m bench.random_checkpoint --preset lfm2-8b-a1b \
    --out "$ck/8b-decisive" --decisive 0.03125
}

case "$mode" in
target)
  checkpoint_2_6b_decisive
  step python -m bench.bench_target --model "$ck/2.6b-decisive" --out "$out" --name gpu-lfm2.5-2.6b --widths 1,8,16 --cublas
  ;;
8b)
  checkpoint_8b
  step python -m bench.bench_target --model "$ck/8b-decisive" --out "$out" --name gpu-lfm2-8b-a1b --widths 16 --cublas
  step python -m bench.bench_load_memory --model "$ck/8b-decisive" --out "$out" --name gpu-load-memory-lfm2-8b-a1b
  ;;
experts)
  checkpoint_8b
  step python -m bench.bench_experts --model "$ck/8b-decisive" --out "$out" --name experts-8b --rows 1,2,4,8,16 --seconds 1.5
  ;;
rows)
  checkpoints_2_6b
  step python -m bench.bench_rows --model "$ck/2.6b" --out "$out" --name rows-2.6b --rows 2,4,8,9,16 --seconds 1.5
  ;;
launches)
  checkpoints_2_6b
  step python -m bench.row_launches --model "$ck/2.6b" --out "$out" --name row-launches-2.6b --rows 2,9,16 --turns 5
  ;;
drafting)
  checkpoints_2_6b
  step python -m bench.bench_drafting --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --out "$out"
  step python -m bench.bench_default --out "$out"
  ;;
engine)
  checkpoints_2_6b
  step python -m bench.bench_engine --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --out "$out" --alternations 5 \
    --gen-tokens 1024 --log "$out/engine.log"
  step python -m bench.round_phases "$out/engine.log" --out "$out" --name engine-phases
  gzip -f "$out/engine.log"
  ;;
long)
  checkpoints_2_6b
  step python -m bench.bench_engine --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --out "$out" --name engine-long \
    --streams '' --long-contexts 4096,32768,126000 --long-alternations 6 --long-gen-tokens 1024 --long-prompt-cache \
    --long-turn-tokens 128 \
    --log "$out/engine-long.log"
  gzip -f "$out/engine-long.log"
  ;;
upkeep)
  checkpoints_2_6b
  step python -m bench.bench_upkeep --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --out "$out"
  ;;
prefix)
  checkpoints_2_6b
  step python -m bench.bench_prefix_cache --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --out "$out" --name gpu-prefix-cache-2.6b
  ;;
prompts)
  checkpoints_2_6b
  step python -m bench.bench_prompt_reads --model "$ck/2.6b" --out "$out" --name prompt-reads-2.6b
  step python -m bench.bench_prompt_reads --model "$ck/2.6b" --out "$out" --name prompt-joins-2.6b --length 48 --lanes 4 --long 0
  ;;
fuse)
  step python -m bench.cuda_cache_fuse --out "$out"
  ;;
settings)
  checkpoints_2_6b
  step python -m bench.backend_settings --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --out "$out"
  ;;
beside)
  : "${CODE:?$usage (beside: CODE names the code of an earlier commit, from bench.export_code)}"
  checkpoints_2_6b
  step python -m bench.backend_settings --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --out "$out" --name beside \
    --settings "default;code=$CODE${EXTRA:+;$EXTRA}"
  ;;
kernels)
  checkpoints_2_6b
  step python -m bench.kernel_counts --model "$ck/2.6b" --drafter "$ck/2.6b-dspark" --out "$out/kernels" --lanes 1,16 --phases
  ;;
traffic)
  step python -m bench.host_traffic --out "$out" --name host-traffic-16 --lanes 16
  step python -m bench.host_traffic --out "$out" --name host-traffic-1 --lanes 1
  ;;
*)
  echo "$usage" >&2
  exit 2
  ;;
esac
