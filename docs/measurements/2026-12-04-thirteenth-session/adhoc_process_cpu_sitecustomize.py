"""Ad hoc (thirteenth session): logs, at exit, every Python process's own CPU and whether it imported
torch (cpu-suite-process-cpu.txt). Copy as sitecustomize.py into a folder DIR and run the suite with
PYTHONPATH=<clone>:DIR; the log goes to /tmp/trc2/procs.log."""
import os, sys, time, atexit
_t0 = time.time()
def _log():
    try:
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF)
        with open("/tmp/trc2/procs.log", "a") as f:
            f.write(f"{os.getpid()}\t{os.getppid()}\t{'torch' in sys.modules}\t{r.ru_utime + r.ru_stime:.2f}\t{time.time() - _t0:.2f}\t{' '.join(sys.argv[:6])[:200]}\n")
    except Exception:
        pass
atexit.register(_log)
