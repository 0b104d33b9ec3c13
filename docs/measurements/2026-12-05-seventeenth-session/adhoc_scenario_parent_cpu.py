import cProfile, pstats, time, sys
from parity.harness import goldens_cli
from parity.harness.driver import run_scenario
from parity.harness.runner import RunOptions
from parity.harness.scenario import load_all
def one(s):
    if s.resume_at is None and s.steps > 8: s = s.prefix(8)
    found = goldens_cli.prepare([s], allow_other_platform=True)[s.name]
    entry, results = run_scenario(s, RunOptions(progress=False, snapshot="none", golden_digests=True))
    goldens_cli.check(entry, s, results, found, require=True)
    return entry
if __name__ == "__main__":
    S={s.name:s for s in load_all()}
    one(S["quick-w2-fp8-head"])
    for name in sys.argv[1:]:
        pr=cProfile.Profile(); t=time.time(); c=time.process_time()
        pr.enable(); e=one(S[name]); pr.disable()
        print(name, e["status"], e["golden"], "wall", round(time.time()-t,2), "parent cpu", round(time.process_time()-c,2))
        pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
