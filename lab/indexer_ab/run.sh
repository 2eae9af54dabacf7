#!/bin/bash
# A B A B of two kvengine binaries on one indexer workload: 5 pairs of
# `bench indexer --indexer hosted-runtime --cores 2 --repeat 1`, then each figure's median [min-max].
# usage: lab/indexer_ab/run.sh WORKLOAD BINARY_A BINARY_B   (JSON per run in $OUT, default /tmp)
w=$1; A=$2; B=$3; OUT=${OUT:-/tmp}; export OUT
for i in 1 2 3 4 5; do
  for tag in A B; do
    bin=$A; [ $tag = B ] && bin=$B
    $bin bench indexer --workload $w --indexer hosted-runtime --cores 2 --repeat 1 --json $OUT/abq-$w-$tag-$i.json > /dev/null 2>&1
  done
done
python3 - $w <<'PY'
import json,os,sys,statistics as st
w=sys.argv[1]
d=os.environ['OUT']
keys=['store_blocks_per_s','remove_blocks_per_s','hit_p50_us','hit_p99_us','hit_qps_1','hit_qps_2','mixed_query_p50_us','mixed_query_p99_us','bytes_per_block']
for tag in 'AB':
    rows=[json.load(open(f'{d}/abq-{w}-{tag}-{i}.json')) for i in range(1,6)]
    cells=[]
    for k in keys:
        v=sorted(r[k] for r in rows)
        f=(lambda x: f'{x/1e6:.2f}M') if 'blocks_per' in k else ((lambda x: f'{x/1e3:.0f}k') if 'qps' in k else (lambda x: f'{x:.2f}'))
        cells.append(f'{k}={f(st.median(v))} [{f(v[0])}-{f(v[-1])}]')
    print(w,tag,' | '.join(cells))
PY
