#!/bin/bash
# usage: ab_suite.sh ROUNDS OLD NEW -- pytest args ; prints busy CPU-s and wall per run, alternated
rounds=$1; old=$2; new=$3; shift 4
log=$(mktemp)
busy() { awk 'NR==1{print ($2+$3+$4+$7+$8+$9)/100}' /proc/stat; }
for r in $(seq $rounds); do
  for tree in $old $new; do
    b0=$(busy); t0=$(date +%s.%N)
    (cd $tree && python -m pytest -p no:cacheprovider -q "$@" > $log 2>&1)
    b1=$(busy); t1=$(date +%s.%N)
    echo "$(basename $tree) round $r: busy $(echo "$b1 - $b0" | bc) s, wall $(echo "$t1 - $t0" | bc | cut -c1-6) s, $(tail -1 $log)"
  done
done
