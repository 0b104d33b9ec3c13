#!/bin/bash
# (run from anywhere; needs /tmp/wt-a = git worktree add --detach /tmp/wt-a 49295db, adhoc_idle.sh beside this file: busy CPU-seconds from /proc/stat around a command)
# alternated: A = 49295db's tests (no thread limits in test processes), B = HEAD's; the in-process test files under -n 2
HERE=$(cd "$(dirname "$0")" && pwd)
source /work/venv-base/bin/activate
FILES="tests/integration/test_stack_single_rank.py tests/integration/test_resume.py tests/integration/test_stress.py tests/unit/test_checkpoint.py tests/unit/test_muon.py tests/integration/test_optim_single_rank.py tests/unit/test_init_edges.py"
for i in 1 2 3 4; do
  if [ $((i % 2)) -eq 1 ]; then order="A B"; else order="B A"; fi
  for side in $order; do
    if [ $side = A ]; then dir=/tmp/wt-a; else dir=/work/main; fi
    cd $dir
    # PYTHONPATH: the tree's own parity package (the venv's editable install points at /work/main)
    r=$(PYTHONPATH=$dir "$HERE/adhoc_idle.sh" python -m pytest -n 2 -q -p no:cacheprovider $FILES 2>&1 | tail -2 | tr '\n' ' ')
    echo "pair $i $side: $r"
  done
done
