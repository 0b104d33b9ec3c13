"""What the session's new shared faults and two selftest cases do on their quick-set scenarios:
failed checks, divergences, and (for the resume fault) whether the divergences are ON-vs-OFF bit
comparisons (they carry an element count) or digest differences across the two launches (none).
Run from the repository root: python docs/measurements/2026-12-05-twenty-sixth-session/adhoc_shared_faults.py"""
from parity.harness.driver import run_scenario
from parity.harness.faults import Injection
from parity.harness.runner import RunOptions
from parity.harness.selftest import scenario

CASES = [("rank1-skips-rank0-slot", "w4-dense"), ("rank1-skips-rank0-slot", "w4-moe"),
         ("checkpoint-drops-momentum", "w4-padded-gap-shard-resume"),
         ("force-sync-stale", "w4-force-sync-pair"), ("no-rearm-in-finish-grad-sync", "w4-moe-overlap")]

if __name__ == "__main__":
    for fault, key in CASES:
        entry, _ = run_scenario(scenario(key), RunOptions(
            injections=(Injection("fault", name=fault),), progress=False, golden_digests=False,
            snapshot="none", fail_fast=True), timeout_s=120)
        table = entry.get("divergence_table", [])
        fd = entry.get("first_divergence") or {}
        print(f"{fault} on quick-{key}: status {entry['status']}, {entry['n_divergences']} divergences "
              f"({sum(d.get('n_diff') is not None for d in table)} with an element count), first "
              f"{fd.get('step')}/{fd.get('phase')}/{fd.get('tensor')} against {fd.get('against', 'OFF')}; failed checks "
              f"{sorted({(c['check'], c['step']) for c in entry.get('failed_checks', [])})}")
