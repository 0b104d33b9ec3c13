#!/bin/bash
# Ad hoc A/B of one tree under two environments (the switches were temporary code, not committed).
# usage: ab_env.sh PAIRS "ENV_A" "ENV_B" parity-run-args...
set -u
pairs=$1; ea=$2; eb=$3; shift 3
out=$(mktemp -d)
for i in $(seq 1 $pairs); do
  if [ $((i % 2)) = 1 ]; then order="A B"; else order="B A"; fi
  for side in $order; do
    if [ $side = A ]; then e=$ea; else e=$eb; fi
    t0=$(date +%s.%N)
    env $e python -m parity.cli run "$@" --snapshot none --quiet --out "$out/$side" > $out/log 2>&1
    t1=$(date +%s.%N)
    python -c "
import json; e=json.load(open('$out/$side/report.json'))['scenarios'][0]; c=e['timing']['cpu']
g=e.get('golden',{})
print('$i $side cmd %.2f scenario %.2f s, %s, golden %s, rank user %.3f sys %.3f vcs %d' % ($t1-$t0, e['elapsed_s'], e['status'], g, c['user_s'], c['system_s'], c['voluntary_switches']))"
  done
done
rm -rf "$out"
