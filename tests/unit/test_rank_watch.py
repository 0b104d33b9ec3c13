"""The rank's watcher thread: where its main thread is, read without touching its frames."""

import os
import tempfile
import threading
import time

from parity.harness import driver

PARITY = os.path.dirname(driver.__file__)


def _parked_in_marker_function(ready, release):
    ready.set()
    release.wait(30)


def test_another_threads_stack_is_read_innermost_first():
    ready, release = threading.Event(), threading.Event()
    t = threading.Thread(target=_parked_in_marker_function, args=(ready, release))
    t.start()
    try:
        assert ready.wait(30)
        with tempfile.TemporaryFile() as scratch:
            first = driver._read_stack(scratch.fileno(), t.ident)
            second = driver._read_stack(scratch.fileno(), t.ident)  # the scratch file is reused
    finally:
        release.set()
        t.join()
    funcs = [func for _, _, func in first]
    # innermost first: threading's wait, then the function that called it, then the thread's start
    assert "_parked_in_marker_function" in funcs
    assert funcs.index("wait") < funcs.index("_parked_in_marker_function") < funcs.index("run")
    here = [(fn, line) for fn, line, func in first if func == "_parked_in_marker_function"]
    assert here == [(__file__, str(_parked_in_marker_function.__code__.co_firstlineno + 2))]
    assert second == first
    # this thread's own frames are not taken for the other's
    assert "test_another_threads_stack_is_read_innermost_first" not in funcs


def test_a_stack_is_taken_from_its_own_thread_only():
    dump = ("Thread 0x00000000000000aa (most recent call first):\n"
            '  File "/x/parity/a.py", line 3 in f\n'
            "\n"
            "Current thread 0x00000000000000bb (most recent call first):\n"
            '  File "/x/parity/b.py", line 7 in g\n'
            '  File "/x/torch/distributed/c.py", line ??? in h\n'
            "  ...\n")
    assert driver._thread_stack(dump, 0xaa) == [("/x/parity/a.py", "3", "f")]
    assert driver._thread_stack(dump, 0xbb) == [("/x/parity/b.py", "7", "g"),
                                                  ("/x/torch/distributed/c.py", "???", "h")]
    assert driver._thread_stack(dump, 0xcc) == []


def test_where_names_the_innermost_parity_frame_and_a_wait_in_torch_distributed():
    stack = [("/site/torch/distributed/distributed_c10d.py", "10", "all_reduce"),
             (f"{PARITY}/runner.py", "42", "step"),
             (f"{PARITY}/driver.py", "99", "rank_main")]
    assert driver._where(stack) == (True, "runner.py:42 step")
    assert driver._where(stack[1:]) == (False, "runner.py:42 step")
    assert driver._where([("/site/torch/nn/modules/module.py", "1", "forward")]) == (False, "")
    assert driver._where([]) == (False, "")


def test_a_wait_in_parity_collectives_counts_and_an_import_of_torch_distributed_does_not():
    below = [(f"{PARITY}/runner.py", "42", "step")]
    # a collective parity started and now waits on: Work.wait is C, so parity's frame is innermost
    waits = [(f"{os.path.dirname(PARITY)}/distributed/collectives.py", "416", "wait")] + below
    assert driver._where(waits) == (True, "collectives.py:416 wait")
    # the rest of parity's distributed layer starts or waits on no collective of its own
    busy = [(f"{os.path.dirname(PARITY)}/distributed/determinism.py", "90", "apply_cpu_pins")] + below
    assert driver._where(busy) == (False, "determinism.py:90 apply_cpu_pins")
    # a torch.distributed package's module code runs during an import: no collective
    importing = [("/site/torch/distributed/checkpoint/__init__.py", "3", "<module>"),
                 ("<frozen importlib._bootstrap>", "241", "_call_with_frames_removed")] + below
    assert driver._where(importing) == (False, "runner.py:42 step")
    # a torch.distributed frame further out does not make the innermost work a wait
    assert driver._where(below + [("/site/torch/distributed/distributed_c10d.py", "1", "f")])[0] is False


def _run_watch(monkeypatch, state, seconds, reads_wanted=None):
    """Run the watcher on ``state`` (samples every 10 ms, quiet after 0.2 s) for ``seconds``, or
    until it has read ``reads_wanted`` stacks (at most 30 s); return (the threads whose stacks it
    read, the states it posted)."""
    monkeypatch.setattr(driver, "_SAMPLE_S", 0.01)
    monkeypatch.setattr(driver, "_QUIET_S", 0.2)
    read, posted = [], []

    def fake_read(scratch, thread_id):
        read.append(thread_id)
        return [("/site/torch/distributed/distributed_c10d.py", "1", "all_reduce"),
                (f"{PARITY}/runner.py", "7", "step")]

    monkeypatch.setattr(driver, "_read_stack", fake_read)
    stop, lock = threading.Event(), threading.Lock()
    t = threading.Thread(target=driver._watch, args=(state, lock, lambda: posted.append(dict(state)), 42, stop))
    t.start()
    if reads_wanted is None:
        stop.wait(seconds)
    else:  # however slowly a loaded machine runs the watcher
        end = time.monotonic() + 30
        while len(read) < reads_wanted and time.monotonic() < end:
            time.sleep(0.01)
    stop.set()
    t.join(30)
    assert not t.is_alive()  # stop ends it
    return read, posted


def test_the_watcher_leaves_a_rank_that_beats_alone(monkeypatch):
    # a beat 0.1 s ago at every sample: never quiet for 0.2 s, so no stack is read (reading one
    # races with the thread states gloo's threads make, docs/spec/platform.md s1.3)
    class Recent(dict):
        asked = 0

        def __getitem__(self, k):
            if k == "t":
                Recent.asked += 1
                return time.time() - 0.1
            return super().__getitem__(k)

    state = Recent(t=0.0, in_collective=False, where="")
    read, posted = _run_watch(monkeypatch, state, 0.5)
    assert Recent.asked > 1  # it looked, more than once
    assert read == [] and posted == []


def test_the_watcher_places_a_quiet_rank_once(monkeypatch):
    state = {"t": time.time() - 10.0, "in_collective": False, "where": ""}
    read, posted = _run_watch(monkeypatch, state, None, reads_wanted=3)
    assert len(read) >= 3 and set(read) == {42}  # the main thread's stack, at every sample
    assert posted == [{"t": state["t"], "in_collective": True, "where": "runner.py:7 step"}]  # posted once
