#!/bin/bash
# one run alone twice, then two at once
S=${1:-default}
shift
for mode in alone both alone both; do
  if [ $mode = alone ]; then
    /tmp/idle.sh bash -c "parity run $S --golden off --snapshot none --out /tmp/pa1 $* >/dev/null; parity run $S --golden off --snapshot none --out /tmp/pa2 $* >/dev/null" | sed "s/^/$mode /"
  else
    /tmp/idle.sh bash -c "parity run $S --golden off --snapshot none --out /tmp/pa1 $* >/dev/null & parity run $S --golden off --snapshot none --out /tmp/pa2 $* >/dev/null; wait" | sed "s/^/$mode /"
  fi
done
