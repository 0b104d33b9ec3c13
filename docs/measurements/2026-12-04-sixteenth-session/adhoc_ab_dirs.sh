#!/bin/bash
# Ad hoc A/B of two trees: the whole command's wall and the scenario's (report.json), alternated pairs.
# usage: ab_dirs.sh PAIRS OLD_DIR NEW_DIR parity-run-args...   (command wall and scenario wall)
set -u
pairs=$1; old=$(cd "$2" && pwd); new=$(cd "$3" && pwd); shift 3
out=$(mktemp -d)
for i in $(seq 1 $pairs); do
  if [ $((i % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    if [ $side = old ]; then d=$old; else d=$new; fi
    t0=$(date +%s.%N)
    (cd $d && PYTHONPATH=$d python -m parity.cli run "$@" --snapshot none --quiet --out "$out/$side" > $out/log 2>&1)
    t1=$(date +%s.%N)
    python -c "
import json; e=json.load(open('$out/$side/report.json'))['scenarios'][0]; c=e['timing']['cpu']
print('$i $side cmd %.2f scenario %.2f s, %s, golden %s, rank user %.3f sys %.3f' % ($t1-$t0, e['elapsed_s'], e['status'], e.get('golden'), c['user_s'], c['system_s']))"
  done
done
rm -rf "$out"
