"""`mrl merge` refuses a destination inside a checkpoint root (retention would delete it, or a
`step_*` name would take a checkpoint's slot), in one line, before reading the checkpoint."""
import pytest

from mrl.checkpoint.store import root_containing


def _root(tmp_path):
    root = tmp_path / "run" / "checkpoints" / "actor"
    (root / "step_00000004").mkdir(parents=True)
    (root / "latest").write_text("step_00000004\n")
    return root


def test_root_containing(tmp_path):
    root = _root(tmp_path)
    assert root_containing(root / "step_00000004" / "hf") == root
    assert root_containing(root / "step_00000099") == root
    assert root_containing(root) == root
    assert root_containing(tmp_path / "run" / "merged") is None
    assert root_containing(tmp_path / "run" / "checkpoints" / "merged") is None
    (tmp_path / "link").symlink_to(root)
    assert root_containing(tmp_path / "link" / "out") == root


@pytest.mark.parametrize("dest", ["step_00000004/hf", "step_00000099", "hf"])
def test_merge_into_a_checkpoint_root_is_refused_in_one_line(tmp_path, capsys, dest):
    from mrl.cli import main

    root = _root(tmp_path)
    assert main(["merge", str(root), str(root / dest)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"is inside the checkpoint root {root}" in err[0]
    assert not (root / dest).exists() or dest.startswith("step_00000004") and not (root / dest).exists()
