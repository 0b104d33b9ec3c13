import torch
from parity.harness.snapshot import StreamingSnapshotWriter, read_snapshot, read_snapshot_metadata


def test_streaming_writer_writes_each_step_and_bounds_the_queue(tmp_path):
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
    assert w.bytes_written > 0


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
