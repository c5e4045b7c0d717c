"""The `mrl` command itself: version, keys, paths from any directory, errors once under torchrun."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOBS = sorted((REPO / "jobs").glob("*.toml"))
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}


def mrl(*args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "mrl", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_version_line():
    proc = mrl("--version", cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip().startswith("mrl 0.")


def test_keys_json_lists_every_leaf_with_its_default(cli):
    rc, out, _ = cli("keys", "--json")
    rows = json.loads(out)
    by_key = {r["key"]: r for r in rows}
    # derived when unset (None): a group for the group estimators, one response otherwise
    assert rc == 0 and by_key["rollout.responses_per_prompt"]["default"] is None
    assert "8 for an estimator that compares" in by_key["rollout.responses_per_prompt"]["meaning"]
    assert by_key["rollout.validation.responses_per_prompt"]["default"] == 1
    assert by_key["model.path"]["required"] and by_key["tracking.backends"]["default"] == ["console", "mlflow"]
    assert "job" not in by_key and len(rows) > 150 and set(rows[0]) == {"key", "type", "required", "default", "meaning"}


def test_keys_table_says_how_paths_resolve(cli):
    rc, out, _ = cli("keys", "data.")
    assert rc == 0 and "data.train_files" in out and "relative to that file" in " ".join(out.split())


def test_every_shipped_job_validates_from_any_directory(tmp_path):
    proc = mrl("validate", *JOBS, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok: ") == len(JOBS) >= 8


def test_paths_in_a_job_file_are_relative_to_it_and_overrides_to_the_cwd(tmp_path):
    from mrl.config.loader import load

    (tmp_path / "proj" / "tasks").mkdir(parents=True)
    (tmp_path / "proj" / "tasks" / "gen.py").write_text("def rows(size, seed):\n    return []\n")
    (tmp_path / "proj" / "job.toml").write_text(
        f'extends = "{REPO / "jobs/quickstart_cpu.toml"}"\n[data]\ngenerator = "tasks/gen.py:rows"\n'
        '[job]\noutput_dir = "out"\n')
    spec, _ = load(tmp_path / "proj" / "job.toml")
    assert spec.data.generator == f"{tmp_path / 'proj/tasks/gen.py'}:rows"
    assert spec.job.output_dir == str(tmp_path / "proj" / "out")
    assert spec.reward.function == f"{REPO / 'jobs/tasks/digits.py'}:score"   # from the base file, against it
    proc = mrl("validate", tmp_path / "proj/job.toml", "data.generator=tasks/gen.py:rows", cwd=tmp_path)
    assert proc.returncode == 2 and f"file '{tmp_path / 'tasks/gen.py'}' not found" in proc.stderr, proc.stderr


def test_generator_and_train_files_together_are_an_error(tmp_path):
    proc = mrl("validate", REPO / "jobs/quickstart_cpu.toml", 'data.train_files=["a.parquet"]', cwd=tmp_path)
    assert proc.returncode == 2
    assert "data.generator: set either data.generator or data.train_files, not both" in proc.stderr


@pytest.mark.slow
def test_launch_prints_a_user_error_once_and_exits_2(tmp_path):
    """Both ranks fail the same way; the lowest prints; no torchrun ChildFailedError report."""
    proc = mrl("launch", REPO / "jobs/quickstart_cpu.toml", 'data.train_files=["/nope/x.parquet"]',
               "data.generator=none", f"job.output_dir={tmp_path}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: /nope/x.parquet: parquet file not found (data.train_files / data.val_files)"], proc.stderr
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr


def test_docs_exist_and_every_cited_doc_is_in_the_repository():
    import re

    assert (REPO / "docs/design.md").is_file() and (REPO / "docs/algorithms.md").is_file()
    texts = {p: p.read_text() for p in [*(REPO / "mrl").rglob("*.py"), REPO / "CONTRIBUTING.md", REPO / "README.md"]}
    cited = {(p, m) for p, t in texts.items() for m in re.findall(r"\b(docs/[\w-]+\.md|[A-Z][A-Z_]+\.md)\b", t)}
    missing = sorted(f"{p.relative_to(REPO)} cites {m}" for p, m in cited
                     if not (REPO / m).is_file() and m not in ("README.md", "CONTRIBUTING.md"))
    assert not missing, missing


def test_show_get_prints_values_for_scripts(cli):
    rc, out, _ = cli("show", "jobs/quickstart_cpu.toml", "--get", "platform.world_size", "--get", "tracking.backends",
                     "--get", "trainer.val_before_train", "--get", "checkpoint.load_from", "--get", "rollout.engine_kwargs",
                     "--get", "actor.lora")
    assert rc == 0
    size, backends, flag, unset, table, section = out.split("\n")[:6]
    assert (size, backends, flag, unset, table) == ("2", "console mlflow", "false", "", "{}")   # no Python reprs
    assert json.loads(section)["target_modules"][0] == "q_proj" and json.loads(section)["adapter_path"] is None


def test_every_subcommand_help_has_a_description_and_examples():
    from mrl.cli.parser import EXAMPLES, build_parser

    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == set(EXAMPLES)
    for name, command in sub.choices.items():
        text = command.format_help()
        assert command.description and "\nExamples:\n" in text, (name, text)
        assert EXAMPLES[name] and all(f"  {line}\n" in text + "\n" for line in EXAMPLES[name]), name   # as written


def test_readme_job_is_the_shipped_grpo_recipe_and_its_commands_exist(tmp_path):
    """The README's one real job validates and resolves to `jobs/grpo_qwen2.5_7b.toml`; its two
    commands are the Makefile's targets (CI runs the test command through .ci/run)."""
    import re

    from mrl.schema.dump import to_toml
    from mrl.config.loader import load

    readme = (REPO / "README.md").read_text()
    [job] = re.findall(r"```toml\n(.*?)```", readme, re.S)
    (tmp_path / "my_job.toml").write_text(job)
    same = [f"job.output_dir={tmp_path}"]
    ours, _ = load(tmp_path / "my_job.toml", same)
    shipped, _ = load(REPO / "jobs/grpo_qwen2.5_7b.toml", same)
    assert to_toml(ours) == to_toml(shipped)
    make = (REPO / "Makefile").read_text()
    assert "make demo" in readme and "make test " in readme and re.search(r"^demo:", make, re.M)
    assert re.search(r"^test:", make, re.M) and "\nmake test\n" in (REPO / ".ci/run").read_text()
