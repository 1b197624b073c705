set -u
new=$PWD; old=/root/oldtree
rm -rf $old && mkdir -p $old && cp -r bench families lanes daemon $old/ && cp runs/guard_old.py $old/lanes/guard.py
for i in 1 2 3; do
  (cd $new && BENCH_COMMIT=$(cat runs/commit) timeout 100 python -m bench.bench_default --out $OUT/new$i 2>&1 | grep -E "dspark|ngram|plain" | tail -5)
  (cd $old && BENCH_COMMIT=$(cat $new/runs/commit)-old-guard PYTHONPATH=/opt/mlxsite:$old timeout 100 python -m bench.bench_default --out $OUT/old$i 2>&1 | grep -E "dspark|ngram|plain" | tail -5)
done
