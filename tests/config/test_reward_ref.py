"""Static checks of user function references (`file.py:function`), without running user code."""
import pytest

from mrl.reward.function import static_problem


@pytest.mark.parametrize("source,ref_func,fragment", [
    ("def score(prompt, response, ground_truth, extra):\n    return 1.0\n", "score", None),
    ("def score(prompt, response, ground_truth, extra=None, *, k=1):\n    return 1.0\n", "score", None),
    ("def score(*args):\n    return 1.0\n", "score", None),
    ("async def score(p, r, g, e):\n    return 1.0\n", "score", None),
    ("from x import score\n", "score", None),
    ("score = make()\n", "score", None),
    ("def score(prompt, response):\n    return 1.0\n", "score", "must accept 4 positional arguments"),
    ("def score(a, b, c, d, e):\n    return 1.0\n", "score", "must accept 4 positional arguments"),
    ("def scores(p, r, g, e):\n    return 1.0\n", "score", "did you mean 'scores'"),
    ("def score(p, r, g, e)\n    return 1.0\n", "score", "does not parse: line 1"),
])
def test_static_problem(tmp_path, source, ref_func, fragment):
    f = tmp_path / "rw.py"
    f.write_text(source)
    problem = static_problem(f"{f}:{ref_func}")
    if fragment is None:
        assert problem is None
    else:
        assert problem is not None and fragment in problem


def test_user_code_is_not_executed(tmp_path):
    f = tmp_path / "rw.py"
    marker = tmp_path / "ran"
    f.write_text(f"open({str(marker)!r}, 'w').close()\ndef score(p, r, g, e):\n    return 0.0\n")
    assert static_problem(f"{f}:score") is None
    assert not marker.exists()
