"""How often is a port that bind(0) gave, then released, taken again 2 s later while gloo ranks
start and run beside it? (The old free_port: a rendezvous port chosen that way, bound by torchrun
seconds later.) Run it while something busy with sockets runs, e.g. parity's EP-8 command.

    python port_reuse.py TRIALS WAIT_S
"""
import socket, sys, time

trials, wait = int(sys.argv[1]), float(sys.argv[2])
taken = 0
for _ in range(trials):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    time.sleep(wait)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a TCPStore server binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            taken += 1
print(f"{taken} of {trials} ports taken again within {wait} s", flush=True)
