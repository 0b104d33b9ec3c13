"""Fault matrix of the whole catalogue on the padded scenarios (3 steps each): which faults each catches."""
import json, sys
from parity.harness.faults import CATALOGUE
from parity.harness.selftest import fault_matrix, matrix_table
from parity.harness.scenario import load_all

if __name__ == '__main__':
    sc = {s.name: s for s in load_all()}
    ss = [sc["quick-w4-padded-gap-shard-resume"], sc["padded-blockwise-overlap-pair"].prefix(3), sc["padded-mxfp8-overlap-pair"].prefix(3)]
    m = fault_matrix(ss, sorted(str(f.value) if hasattr(f, "value") else str(f) for f in CATALOGUE), out=lambda *a: None)
    print(matrix_table(m))
    json.dump(m, open(sys.argv[1], "w"), indent=1, default=str)
