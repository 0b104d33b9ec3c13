"""Two helpers for a suite timeline (twenty-first session).

    python adhoc_suite_timeline.py sample OUT      # every second: seconds since start, % of all CPUs busy (/proc/stat)
    CMD | python adhoc_suite_timeline.py stamp T0   # prefix each line with seconds since T0 (time.time())
"""
import sys, time


def sample(path):
    def read():
        v = list(map(int, open("/proc/stat").readline().split()[1:]))
        return sum(v), v[3] + v[4]
    out, t0, a = open(path, "w"), time.time(), read()
    while True:
        time.sleep(1.0)
        b = read()
        tot, idle = b[0] - a[0], b[1] - a[1]
        out.write(f"{time.time() - t0:.1f} {100 * (1 - idle / max(tot, 1)):.0f}\n")
        out.flush()
        a = b


def stamp(t0):
    for line in sys.stdin:
        sys.stdout.write(f"{time.time() - t0:.1f} {line}")
        sys.stdout.flush()


if __name__ == "__main__":
    sample(sys.argv[2]) if sys.argv[1] == "sample" else stamp(float(sys.argv[2]))
