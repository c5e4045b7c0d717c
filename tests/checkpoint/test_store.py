"""Checkpoint directory bookkeeping: commits, the latest pointer, retention, stale temporaries."""
from mrl.checkpoint import store


def _save(root, step, payload="x"):
    tmp = store.tmp_path(root, step)
    tmp.mkdir(parents=True)
    (tmp / "data").write_text(f"{payload}{step}")
    return store.commit(root, tmp, step)


def test_commit_renames_and_moves_latest(tmp_path):
    assert store.latest(tmp_path) is None
    _save(tmp_path, 1)
    final = _save(tmp_path, 2)
    assert final.name == "step_00000002" and (final / "data").read_text() == "x2"
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"
    assert store.latest(tmp_path) == final
    assert not list(tmp_path.glob(".tmp.*"))


def test_interrupted_save_is_ignored_and_cleaned(tmp_path):
    _save(tmp_path, 1)
    half = store.tmp_path(tmp_path, 2)
    half.mkdir()
    (half / "partial").write_text("...")
    assert store.latest(tmp_path).name == "step_00000001"
    assert [p.name for p in store.checkpoints(tmp_path)] == ["step_00000001"]
    assert store.remove_stale_tmp(tmp_path) == [half] and not half.exists()


def test_resaving_a_step_replaces_it(tmp_path):
    _save(tmp_path, 3, "old")
    final = _save(tmp_path, 3, "new")
    assert (final / "data").read_text() == "new3" and store.latest(tmp_path) == final


def test_prune_keeps_the_last_k_and_the_latest(tmp_path):
    for s in (1, 2, 3, 4):
        _save(tmp_path, s)
    removed = store.prune(tmp_path, 2)
    assert [p.name for p in removed] == ["step_00000001", "step_00000002"]
    assert [p.name for p in store.checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    store.write_latest(tmp_path, "step_00000003")  # e.g. resumed from an older one
    assert [p.name for p in store.prune(tmp_path, 0)] == ["step_00000004"]


def test_latest_without_pointer_falls_back_to_highest_step(tmp_path):
    _save(tmp_path, 5)
    _save(tmp_path, 12)
    (tmp_path / "latest").unlink()
    assert store.latest(tmp_path).name == "step_00000012"
