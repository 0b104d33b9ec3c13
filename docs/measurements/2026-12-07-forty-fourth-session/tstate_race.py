"""faulthandler.dump_traceback(all_threads=True), called in a loop, while native threads make and
drop Python thread states (a ctypes callback run by pthread_create takes the GIL the way a C
library thread does: PyGILState_Ensure, which makes a new thread state without holding the GIL).

    python tstate_race.py SECONDS spawn   # native threads come and go: crashes (SIGSEGV)
    python tstate_race.py SECONDS none    # the same dumps, no native threads: runs to the end
"""
import ctypes, faulthandler, os, sys, tempfile, threading, time

faulthandler.enable(all_threads=False)
libc = ctypes.CDLL(None)
pthread_t = ctypes.c_ulong
THREAD_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


@THREAD_FN
def body(arg):
    return None


libc.pthread_create.argtypes = [ctypes.POINTER(pthread_t), ctypes.c_void_p, THREAD_FN, ctypes.c_void_p]
libc.pthread_join.argtypes = [pthread_t, ctypes.c_void_p]
stop = False
made = 0


def spawner():
    global made
    while not stop:
        tids = []
        for _ in range(8):
            t = pthread_t()
            libc.pthread_create(ctypes.byref(t), None, body, None)
            tids.append(t)
        for t in tids:
            libc.pthread_join(t, None)
        made += 8


seconds, mode = float(sys.argv[1]), sys.argv[2]
th = threading.Thread(target=spawner, daemon=True)
if mode == "spawn":
    th.start()
sys.setswitchinterval(1e-5)
dumps, t0 = 0, time.time()
with tempfile.TemporaryFile() as f:
    while time.time() - t0 < seconds:
        os.lseek(f.fileno(), 0, 0)
        faulthandler.dump_traceback(f.fileno(), all_threads=True)
        dumps += 1
stop = True
print(f"{mode}: {dumps} dumps in {seconds} s, {made} native threads, no crash", flush=True)
