# How many OpenBLAS worker threads a forked child has, and what they cost: run once plainly and once
# with OPENBLAS_NUM_THREADS=1 (python openblas_pool_after_fork.py; OPENBLAS_NUM_THREADS=1 python ...).
import os, time, numpy as np, threadpoolctl
def n(): return len(os.listdir("/proc/self/task"))
print("parent threads after numpy import", n())
pid = os.fork()
if pid == 0:
    print(" child after fork", n())
    threadpoolctl.threadpool_limits(1, user_api="blas")
    print(" child after limit(1)", n())
    a = np.ones((256, 256)); a @ a
    print(" child after a matmul", n())
    t0 = time.process_time(); time.sleep(0.5)
    task = [t for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
    for t in task:
        f = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
        print("  worker", t, "utime+stime ticks", int(f[11]) + int(f[12]))
    os._exit(0)
os.waitpid(pid, 0)
