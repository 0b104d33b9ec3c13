#!/bin/bash
R="parity run default --golden off --snapshot none --out /tmp/pa1"
U="python -m pytest -q -p no:xdist -p no:cacheprovider -p no:logging tests/integration/test_stack_single_rank.py tests/integration/test_optim_single_rank.py tests/unit/test_checkpoint.py"
for i in 1 2; do
echo -n "R alone: "; /tmp/idle.sh bash -c "$R >/dev/null"
echo -n "U alone: "; /tmp/idle.sh bash -c "$U >/dev/null"
echo -n "R+U:     "; /tmp/idle.sh bash -c "$R >/dev/null & $U > /dev/null; wait"
done
