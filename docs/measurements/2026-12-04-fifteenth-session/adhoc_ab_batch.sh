#!/usr/bin/env bash
# Alternated A/B of SCHED_BATCH off (0) / on (1) for the ranks (ad hoc): N pairs of `parity run ARGS`.
# Prints per run: scenario wall, the ranks' mean user and system seconds, context switches.
N=$1; shift
for i in $(seq "$N"); do for b in 0 1; do
  rm -rf /tmp/ab_out
  PARITY_ADHOC_BATCH=$b python docs/measurements/2026-12-04-fifteenth-session/adhoc_sched_batch.py run "$@" --snapshot none --golden off --quiet --out /tmp/ab_out >/dev/null 2>&1
  python - "$b" <<'PY'
import json, sys
e = json.load(open('/tmp/ab_out/report.json'))['scenarios'][0]
c = e['timing']['cpu']
print(f"batch={sys.argv[1]} wall {e['elapsed_s']:.2f} s, rank user {c['user_s']:.2f} sys {c['system_s']:.2f} "
      f"vol {c['voluntary_switches']:.0f} invol {c['involuntary_switches']:.0f}")
PY
done; done
