"""One run, one writer: the run directory's lock refuses a second holder in one line naming the
first, a dead holder's lock is said and taken over, and every rank learns rank 0's outcome."""
import json
import os
import socket

import pytest
import torch.distributed as dist

from mrl.checkpoint.lock import LOCK_FILE, RunLock, agree_on_lock
from mrl.errors import UserError


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    first = RunLock(tmp_path / "run").acquire()
    record = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(UserError) as e:
        RunLock(tmp_path / "run").acquire()
    msg = str(e.value)
    assert msg.startswith("job.output_dir: the run directory") and "\n" not in msg
    assert f"pid {os.getpid()} on {socket.gethostname()} since {record['started']}" in msg
    first.release()
    assert (tmp_path / "run" / LOCK_FILE).read_text() == ""   # a clean release clears the record
    said = []
    with RunLock(tmp_path / "run", say=said.append) as again:
        assert again.held and again.took_over is None and said == []
    assert not again.held


def test_the_lock_of_a_dead_process_is_said_and_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "gone", "started": "yesterday"}))
    said = []
    lock = RunLock(tmp_path, say=said.append).acquire()
    assert lock.took_over["pid"] == 999999
    assert len(said) == 1 and "took over the stale lock of pid 999999 on gone since yesterday" in said[0]
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_an_unwritable_run_directory_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match=r"^job.output_dir: .*/file/run is not writable \(Not a directory\)$"):
        RunLock(tmp_path / "file" / "run").acquire()


def test_every_rank_learns_rank_0s_outcome(tmp_path):
    store = dist.HashStore()
    lock = agree_on_lock(tmp_path, rank=0, world_size=2, store=store, key_prefix="g0")
    assert lock.held and agree_on_lock(tmp_path, rank=1, world_size=2, store=store, key_prefix="g0") is None
    with pytest.raises(UserError, match="is in use by pid") as on_rank0:
        agree_on_lock(tmp_path, rank=0, world_size=2, store=store, key_prefix="g1")
    with pytest.raises(UserError) as on_rank1:
        agree_on_lock(tmp_path, rank=1, world_size=2, store=store, key_prefix="g1")
    assert str(on_rank1.value) == str(on_rank0.value)
    lock.release()
