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


def test_async_save_is_refused_in_one_line(tmp_path, capsys):
    rc, err = _validate(tmp_path, capsys, {"checkpoint": {"async_save": True}})
    lines = [line for line in err.splitlines() if ": checkpoint.async_save: " in line]
    assert rc == 2 and len(lines) == 1, err
    assert "not implemented" in lines[0] and "set it to false" in lines[0] and "job.toml" in lines[0], lines[0]


def test_synchronous_save_validates(tmp_path, capsys):
    rc, err = _validate(tmp_path, capsys, {"checkpoint": {"async_save": False}})
    assert rc == 0, err
