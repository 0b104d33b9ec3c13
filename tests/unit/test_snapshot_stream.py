import threading
from pathlib import Path

import torch

from parity.harness import snapshot
from parity.harness.snapshot import StreamingSnapshotWriter, read_snapshot, read_snapshot_metadata


def test_streaming_writer_writes_each_step(tmp_path):
    w = StreamingSnapshotWriter(tmp_path, rank=3, metadata={"scenario": "s"})
    for step in range(4):
        w.submit(step, {"test/forward/loss": torch.full((2,), float(step))})
    paths = w.close()
    assert [p.rsplit("/", 1)[1] for p in paths] == [f"step_{s:05d}_rank_003.safetensors" for s in range(4)]
    for s, p in enumerate(paths):
        t, _ = read_snapshot(p)
        assert t["test/forward/loss"].view(torch.int32).tolist() == torch.full((2,), float(s)).view(torch.int32).tolist()
        md = read_snapshot_metadata(p)
        assert md["step"] == str(s) and md["rank"] == "3" and md["scenario"] == "s"
    # what the report's write rate divides: every file's bytes, over the time spent writing them
    assert w.bytes_written == sum(Path(p).stat().st_size for p in paths) and w.write_seconds > 0


def test_streaming_writer_surfaces_a_write_failure(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    w = StreamingSnapshotWriter(blocker / "sub", rank=0, metadata={})
    w.submit(0, {"a": torch.zeros(1)})
    try:
        w.close()
    except Exception as e:
        assert "cannot" in str(e)
    else:
        raise AssertionError("a failed write must be reported")


def test_a_failed_write_stops_the_steps_after_it(tmp_path, monkeypatch):
    """A rank whose writer failed learns it at one of the next three hand-overs, not at the run's
    end: its steps stop piling up behind a writer that drops them. (By the hand-over of step 3 the
    writer has taken step 1, which it does only after recording step 0's failure.)"""
    def failing_write(*args, **kwargs):
        raise snapshot.SnapshotError("cannot write: disk full")

    monkeypatch.setattr(snapshot, "write_snapshot", failing_write)
    w = StreamingSnapshotWriter(tmp_path, rank=0, metadata={})
    w.submit(0, {"x": torch.zeros(1)})
    refused = None
    for step in (1, 2, 3):
        try:
            w.submit(step, {"x": torch.ones(1)})
        except snapshot.SnapshotError as e:
            refused = (step, str(e))
            break
    assert refused is not None and "disk full" in refused[1], "steps were handed to a writer that had failed"


def test_a_failure_after_the_write_reaches_the_rank_not_a_hang(tmp_path, monkeypatch):
    """A writer that fails anywhere in its work, not only in the file write (here the written
    file's size, gone by then), reports it to the rank: a writer thread that died would leave the
    rank blocked on its next hand-over, forever."""
    real_write = snapshot.write_snapshot

    def write_then_lose(path, *args, **kwargs):
        real_write(path, *args, **kwargs)
        Path(path).unlink()  # e.g. a cleanup that raced the run

    monkeypatch.setattr(snapshot, "write_snapshot", write_then_lose)
    w = StreamingSnapshotWriter(tmp_path, rank=0, metadata={})
    outcome = []

    def rank():
        try:
            for step in range(4):
                w.submit(step, {"x": torch.zeros(1)})
            w.close()
        except FileNotFoundError as e:
            outcome.append(e)

    t = threading.Thread(target=rank, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the rank hangs on a writer thread that died"
    assert outcome and "step_00000_rank_000" in str(outcome[0])


def test_streaming_writer_holds_at_most_two_steps(tmp_path, monkeypatch):
    """While step 0 is being written and step 1 waits, handing over step 2 blocks (so a rank's host
    memory holds about two steps' tensors, not the run's), and goes on once the write finishes."""
    writing, release = threading.Event(), threading.Event()
    real_write = snapshot.write_snapshot

    def slow_write(*args, **kwargs):
        writing.set()
        assert release.wait(30), "the test never released the writer"
        return real_write(*args, **kwargs)

    monkeypatch.setattr(snapshot, "write_snapshot", slow_write)
    w = StreamingSnapshotWriter(tmp_path, rank=0, metadata={})
    w.submit(0, {"x": torch.zeros(1)})
    assert writing.wait(30)  # the writer holds step 0
    w.submit(1, {"x": torch.ones(1)})  # waits in the queue
    third = threading.Thread(target=w.submit, args=(2, {"x": torch.full((1,), 2.0)}))
    third.start()
    third.join(0.5)
    assert third.is_alive(), "a third step was taken while two were held"
    release.set()
    third.join(30)
    assert not third.is_alive()
    assert [p.rsplit("/", 1)[1] for p in w.close()] == [f"step_{s:05d}_rank_000.safetensors" for s in range(3)]
