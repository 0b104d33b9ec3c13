"""The chance that another bind(0) in this network namespace gets the port an earlier bind(0) gave
and released (the old free_port's rendezvous port): per later bind(0), measured.

    python port_collisions.py TRIALS BINDS_PER_TRIAL
"""
import socket, sys

trials, binds = int(sys.argv[1]), int(sys.argv[2])
hits = 0
for _ in range(trials):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for _ in range(binds):
        with socket.socket() as o:  # another process's listener, as gloo binds its own
            o.bind(("127.0.0.1", 0))
            if o.getsockname()[1] == port:
                hits += 1
                break
lo, hi = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
print(f"{hits} of {trials} released ports handed out again within {binds} later bind(0) calls "
      f"(ephemeral range {lo}-{hi}): about 1 in {trials * binds // max(hits, 1)} binds", flush=True)
