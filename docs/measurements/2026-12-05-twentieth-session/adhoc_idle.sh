#!/bin/bash
# usage: idle.sh CMD... ; prints wall, busy CPU-seconds (all CPUs) from /proc/stat
read -r _ u n s i w x y z _ < /proc/stat; b0=$((u+n+s+x+y+z)); i0=$((i+w)); t0=$(date +%s.%N)
"$@"; rc=$?
read -r _ u n s i w x y z _ < /proc/stat; b1=$((u+n+s+x+y+z)); i1=$((i+w)); t1=$(date +%s.%N)
hz=$(getconf CLK_TCK)
echo "wall $(echo "$t1 - $t0" | bc) s, busy $(( (b1-b0)/hz )) CPU-s, idle $(( (i1-i0)/hz )) CPU-s, rc $rc"
