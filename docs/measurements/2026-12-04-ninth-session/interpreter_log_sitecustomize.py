import atexit, os, sys, time, resource
_t0 = time.time()
def _log():
    try:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        with open("/tmp/sc/log.txt", "a") as f:
            f.write(f"{os.getpid()}\t{'torch' in sys.modules}\t{ru.ru_utime+ru.ru_stime:.2f}\t{time.time()-_t0:.2f}\t{' '.join(sys.argv[:6])[:150]}\n")
    except Exception:
        pass
atexit.register(_log)
