# The embedded default, greedy: bench_default at 2412967 (a worktree at /tmp/base, first on
# PYTHONPATH; each prompt's read waited for, its first token a second wait) and at 66393ba
# (the read launched behind the round in flight, the first token read after it), in turns,
# five pairs, on the 2-core x86 CPU with OpenBLAS preloaded, run from the repository root.
# Each result's head names its command, commit and date.
set -u
. .venv/bin/activate
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
out=bench/results/cpu-default/beside-2412967
for i in 1 2 3; do
  (cd /tmp/base && PYTHONPATH=/tmp/base python -m bench.bench_default --repeats 2 --out /tmp/bdalt/base$i)
  python -m bench.bench_default --repeats 2 --out /tmp/bdalt/new$i
done
# Then two more pairs with 66393ba first (the first three all had 2412967 first):
for i in 4 5; do
  python -m bench.bench_default --repeats 2 --out /tmp/bdalt/new$i
  (cd /tmp/base && PYTHONPATH=/tmp/base python -m bench.bench_default --repeats 2 --out /tmp/bdalt/base$i)
done
mkdir -p $out && cp -r /tmp/bdalt/* $out/
