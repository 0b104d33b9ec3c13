#!/bin/bash
# alternate old (9b2ad54 worktree) and new (a5328c5) on one scenario; $1.. = parity run args
for i in 1 2 3 4 5; do
  if [ $((i % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    if [ $side = old ]; then dir=/tmp/ab14_old; else dir=/work/main; fi
    cd $dir
    PYTHONPATH=$dir /work/venv-base/bin/python -m parity.cli run "$@" --snapshot none --golden off --quiet --out /tmp/ab14b_$side > /dev/null 2>&1
    python3 -c "
import json; e=json.load(open('/tmp/ab14b_$side/report.json'))['scenarios'][0]; c=e['timing']['cpu']
print('$i $side scenario %.2f s, %s, rank user %.3f s, system %.3f s' % (e['elapsed_s'], e['status'], c['user_s'], c['system_s']))"
  done
done
