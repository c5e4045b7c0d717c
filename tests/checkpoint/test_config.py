"""The `checkpoint` section's cross-checks: `mrl validate` refuses what the checkpoint code cannot do."""
import tomli_w

from mrl.cli import main
from tests.config.conftest import BASE, deep_merge


def _validate(tmp_path, capsys, patch):
    path = tmp_path / "job.toml"
    path.write_text(tomli_w.dumps(deep_merge(BASE, patch)))
    try:
        rc = main(["validate", str(path)])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def test_async_save_was_removed_and_says_why_in_one_line(tmp_path, capsys):
    for value in (True, False):   # a key that does nothing is refused whatever its value
        rc, err = _validate(tmp_path, capsys, {"checkpoint": {"async_save": value}})
        lines = [line for line in err.splitlines() if ": checkpoint.async_save: " in line]
        assert rc == 2 and len(lines) == 1, err
        assert "written synchronously" in lines[0] and "job.toml" in lines[0], lines[0]


def test_a_plain_checkpoint_section_validates(tmp_path, capsys):
    rc, err = _validate(tmp_path, capsys, {"checkpoint": {"every_steps": 5}})
    assert rc == 0, err
