import os, sys, atexit, time
def _rec():
    try:
        t = os.times()
        with open("/tmp/interpreter_census.txt", "a") as f:
            f.write(f"{os.getpid()}\t{os.getppid()}\t{'torch' in sys.modules}\t{t.user+t.system:.2f}\t{' '.join(sys.argv)[:200]}\n")
    except Exception:
        pass
atexit.register(_rec)
