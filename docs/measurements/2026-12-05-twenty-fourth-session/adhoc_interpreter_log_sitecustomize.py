import atexit, os, sys, time
_t0 = time.time()
def _log():
    try:
        import resource
        ru = resource.getrusage(resource.RUSAGE_SELF)
        with open("/tmp/sc/log.tsv", "a") as f:
            f.write(f"{os.getpid()}\t{ru.ru_utime+ru.ru_stime:.2f}\t{time.time()-_t0:.2f}\t{'torch' in sys.modules}\t{' '.join(sys.argv)[:200]}\n")
    except Exception:
        pass
atexit.register(_log)
