"""The fault matrix TSV (adhoc_fault_matrix.py) as a markdown table: one row per fault, one column
per quick scenario. X: caught (the run fails), E: the run errors, o: the deviation ran and the run
passed, .: the deviation never ran (the stacks' record).

    python docs/measurements/2026-12-06-twenty-seventh-session/adhoc_matrix_table.py MATRIX.tsv
"""
import csv
import sys


def main():
    rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    faults = list(dict.fromkeys(r["fault"] for r in rows))
    cell = {(r["fault"], r["scenario"]): r for r in rows}

    def mark(r):
        if r is None:
            return " "
        if r["status"] == "error":
            return "E"
        if r["status"] == "fail":
            return "X" if r["fired"] == "yes" else "X!"  # a failure without the deviation: suspect
        return "o" if r["fired"] == "yes" else "."

    print("| fault | " + " | ".join(s.removeprefix("quick-") for s in scenarios) + " |")
    print("|---|" + "---|" * len(scenarios))
    for f in faults:
        print(f"| {f} | " + " | ".join(mark(cell.get((f, s))) for s in scenarios) + " |")
    n = {k: sum(mark(r) == k for r in rows) for k in ("X", "X!", "E", "o", ".")}
    print(f"\n{len(rows)} runs: caught {n['X']}, errored {n['E']}, ran and passed {n['o']}, never ran "
          f"{n['.']}, failed without the deviation {n['X!']}")


if __name__ == "__main__":
    main()
