"""The stress script of the SIGSEGV hunt (forty-first session), made self-contained: the old watcher's
frame walk (sys._current_frames + f_back, as parity/harness/driver.py had it at d933586) as fast as it
can, with a tiny switch interval, while the main thread imports sympy and torch's sympy functions.
Run it in a loop: `for i in $(seq 50); do python stress_frame_walk.py || echo crashed; done`."""
import os
import sys
import threading

def _where(frame) -> tuple[bool, str]:
    """(waiting in a torch.distributed call?, innermost parity frame) of a main-thread stack."""
    in_collective, where = False, ""
    while frame is not None:
        fn = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in fn:
            in_collective = True
        if not where and "/parity/" in fn:
            where = f"{os.path.basename(fn)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return in_collective, where


sys.setswitchinterval(float(os.environ.get("SW", "1e-5")))
main_id = threading.get_ident()
def watch():
    while True:
        _where(sys._current_frames().get(main_id))
threading.Thread(target=watch, daemon=True).start()
import sympy  # noqa: F401, E402  (the import is the load: class creation in C calling Python)
import torch.utils._sympy.functions  # noqa: F401, E402
print("ok")
