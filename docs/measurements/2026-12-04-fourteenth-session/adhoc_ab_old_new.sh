#!/bin/bash
# Runs one scenario with two checkouts alternately (old, new / new, old, ...), 5 pairs, and prints
# each run's scenario wall time and its ranks' mean CPU time from report.json. Prints numbers;
# asserts nothing. The fourteenth session's runs: OLD a worktree of 9b2ad54, NEW a5328c5.
#
#   docs/measurements/2026-12-04-fourteenth-session/adhoc_ab_old_new.sh OLD_DIR NEW_DIR [parity run args...]
#   e.g. ... /tmp/old . --recipe blockwise --ep 8 --steps 10
set -u
old_dir=$(cd "$1" && pwd); new_dir=$(cd "$2" && pwd); shift 2
out=$(mktemp -d)
for i in 1 2 3 4 5; do
  if [ $((i % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    if [ $side = old ]; then dir=$old_dir; else dir=$new_dir; fi
    (cd "$dir" && PYTHONPATH="$dir" python -m parity.cli run "$@" --snapshot none --golden off --quiet \
       --out "$out/$side" > /dev/null 2>&1)
    python -c "
import json; e=json.load(open('$out/$side/report.json'))['scenarios'][0]; c=e['timing']['cpu']
print('$i $side scenario %.2f s, %s, rank user %.3f s, system %.3f s' % (e['elapsed_s'], e['status'], c['user_s'], c['system_s']))"
  done
done
rm -rf "$out"
