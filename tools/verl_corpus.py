"""Run `mrl convert` over a corpus of real verl inputs and print what became of each.

    python tools/verl_corpus.py gather CORPUS_DIR VERL_GIT_DIR VERL_RECIPE_GIT_DIR VERL_SDIST_DIR
    python tools/verl_corpus.py run CORPUS_DIR [--list]

`gather` copies the inputs of issue 35 into CORPUS_DIR: verl's example scripts at tag v0.9.0
(`examples/**.sh`), the recipe scripts of DAPO, retool, FAPO and entropy (verl-recipe, HEAD), every
YAML of the verl 0.9.1 sdist's `verl/trainer/config`, and each `python3 -m verl.trainer.main_ppo`
command line in verl's v0.9.0 docs (one .sh per command). The git dirs are bare mirrors
(`git --git-dir=... show`); nothing is executed.

`run` converts each input in this process (as `mrl convert FILE` does) and validates the job with
stand-ins for what no converter can know here: the model (`builtin:tiny-qwen2`, also for a reward
model, judge or critic), a one-row parquet for the data, and empty files for the reward
functions and tool configs a job names (they exist on the user's machine, not on this one). Each
input lands in one row:

- converted+valid: the job validates with the stand-ins;
- converted-invalid: `mrl convert` wrote a job that still asks for a value (listed with `--list`);
- refused: one line, naming the script line or the capability mrl lacks;
- traceback: anything else (a bug).
"""
from __future__ import annotations

import io
import re
import subprocess
import sys
import tempfile
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True, text=True).stdout


def gather(corpus: str, verl_git: str, recipe_git: str, sdist: str) -> None:
    root = Path(corpus)
    for sub in ("examples", "recipe", "sdist", "docs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for f in _git(verl_git, "ls-tree", "-r", "--name-only", "v0.9.0", "examples").split():
        if f.endswith(".sh"):
            (root / "examples" / f[len("examples/"):].replace("/", "__")).write_text(_git(verl_git, "show", f"v0.9.0:{f}"))
    for f in _git(recipe_git, "ls-tree", "-r", "--name-only", "HEAD").split():
        if re.match(r"(dapo|retool|fapo|entropy)/.*\.sh$", f):
            (root / "recipe" / f.replace("/", "__")).write_text(_git(recipe_git, "show", f"HEAD:{f}"))
    for f in sorted((Path(sdist) / "verl" / "trainer" / "config").rglob("*.yaml")):
        rel = f.relative_to(Path(sdist) / "verl" / "trainer" / "config")
        (root / "sdist" / str(rel).replace("/", "__")).write_text(f.read_text())
    n = 0
    for f in _git(verl_git, "ls-tree", "-r", "--name-only", "v0.9.0", "docs").split():
        if not f.endswith((".md", ".rst")):
            continue
        text = _git(verl_git, "show", f"v0.9.0:{f}")
        for m in re.finditer(r"^[ \t]*(?:[A-Z_]+=\S+ )*(?:PYTHONUNBUFFERED=1 )?python3? -m verl\.trainer\.main_ppo(?:[^\n]*\\\n)*[^\n]*",
                             text, re.M):
            n += 1
            name = f[len("docs/"):].replace("/", "__").rsplit(".", 1)[0]
            (root / "docs" / f"{name}__{n}.sh").write_text(f"# verl v0.9.0 {f}\n" + m.group(0).strip() + "\n")
    print(f"{root}: " + ", ".join(f"{sub} {len(list((root / sub).iterdir()))}" for sub in ("examples", "recipe", "sdist", "docs")))


def _stand_ins(job: Path, tmp: Path) -> list[str]:
    """Overrides giving the converted job a model and data that exist here, and empty files for the
    user files it names (reward functions, tool configs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tomllib

    data = tmp / "train.parquet"
    if not data.exists():
        pq.write_table(pa.table({"data_source": ["openai/gsm8k"], "prompt": [[{"role": "user", "content": "1+1?"}]],
                                 "reward_model": [{"style": "rule", "ground_truth": "2"}]}), data)
    spec = tomllib.loads(job.read_text())
    par = spec.get("parallel", {})
    moe = par.get("expert", 1) > 1 or par.get("expert_tensor", 1) > 1 or spec.get("rollout", {}).get("expert_parallel")
    model = _model_dir(tmp, moe)
    out = [f"model.path={model}", f'data.train_files=["{data}"]', f'data.val_files=["{data}"]']
    if spec.get("critic", {}).get("model_path") or spec.get("critic", {}).get("enable"):
        out.append(f"critic.model_path={_model_dir(tmp, False)}")
    reward = spec.get("reward", {})
    if reward.get("model_path"):
        out.append(f"reward.model_path={_model_dir(tmp, False)}")
    if isinstance(reward.get("judge"), dict) and reward["judge"].get("model"):
        out.append(f"reward.judge.model={_model_dir(tmp, False)}")
    if isinstance(reward.get("function"), str) and ":" in reward["function"]:
        path, _, name = reward["function"].rpartition(":")
        if path.endswith(".py") and not Path(path).exists():
            stand = tmp / f"reward_{abs(hash(path))}.py"
            stand.write_text(f"def {name}(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return 0.0\n")
            out.append(f'reward.function="{stand}:{name}"')
    for key in ("tool_config", "interaction_config"):
        value = spec.get("rollout", {}).get("multi_turn", {}).get(key)
        if value and not Path(value).exists():
            stand = tmp / f"{key}.yaml"
            stand.write_text("tools: []\n" if key == "tool_config" else "interaction: []\n")
            out.append(f'rollout.multi_turn.{key}="{stand}"')
    return out


def _model_dir(tmp: Path, moe: bool) -> Path:
    """A stand-in model (config.json only: validation reads the shape) as large as the scripts'
    models, so that their layouts (tensor, pipeline, expert parallelism) fit it as they fit theirs:
    64 heads, 8 KV heads, 96 layers, 128 experts when the job is MoE."""
    import json

    path = tmp / ("model-moe" if moe else "model-dense")
    if not path.exists():
        path.mkdir()
        config = dict(model_type="qwen3_moe" if moe else "qwen2", architectures=["Qwen3MoeForCausalLM" if moe else "Qwen2ForCausalLM"],
                      hidden_size=8192, intermediate_size=29568, num_hidden_layers=96, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, vocab_size=152064, max_position_embeddings=131072,
                      rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16")
        if moe:
            config.update(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536)
        (path / "config.json").write_text(json.dumps(config))
        # a Qwen2.5-style template: it writes hermes tool calls, as the scripts' Qwen models do
        template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<tool_call>\n<|im_end|>\n{% endfor %}"
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return path


def run_one(path: Path, tmp: Path) -> tuple[str, str]:
    """(row, detail) for one input."""
    from mrl.cli import main

    out = tmp / (path.stem + ".toml")
    buf_out, buf_err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(buf_out), redirect_stderr(buf_err):
            rc = main(["convert", str(path), "-o", str(out)])
    except SystemExit as e:
        rc = e.code
    except BaseException:
        return "traceback", traceback.format_exc().strip().splitlines()[-1]
    err = buf_err.getvalue()
    if "Traceback" in err:
        return "traceback", err.strip().splitlines()[-1]
    if not out.exists():
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        return ("refused" if rc == 2 and len(lines) == 1 else "traceback"), " | ".join(lines) or err.strip()[-200:]
    buf_out, buf_err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(buf_out), redirect_stderr(buf_err):
            rc = main(["validate", str(out), *_stand_ins(out, tmp)])
    except SystemExit as e:
        rc = e.code
    except BaseException:
        return "traceback", "validate: " + traceback.format_exc().strip().splitlines()[-1]
    if rc == 0:
        return "converted+valid", ""
    problems = [ln for ln in buf_err.getvalue().splitlines() if ln.startswith("error:")]
    return "converted-invalid", " | ".join(dict.fromkeys(problems))


# Why a converted job does not validate yet: a capability mrl lacks (docs/verl.md's table), or a
# value the user has to supply or change.
INVALID_KINDS = (
    ("needs the sglang engine (branch sglang)", "'sglang' is not one of"),
    ("each data-parallel rank trains whole prompts", "do not split evenly over data-parallel size"),
    ("a generative reward model: judge prompt or server to supply", "reward.judge"),
)


def invalid_kind(detail: str) -> str:
    return next((kind for kind, words in INVALID_KINDS if words in detail), "a value to supply or change")


def run(corpus: str, listing: bool) -> dict[str, int]:
    from mrl.platform.quiet import quiet_known_warnings

    quiet_known_warnings()
    rows = ("converted+valid", "converted-invalid", "refused", "traceback")
    counts: dict[str, dict[str, int]] = {}
    kinds: dict[str, int] = {}
    inputs = sorted(p for p in Path(corpus).rglob("*") if p.suffix in (".sh", ".yaml", ".yml"))
    with tempfile.TemporaryDirectory() as tmp:
        for path in inputs:
            group = path.parent.name
            row, detail = run_one(path, Path(tmp))
            counts.setdefault(group, dict.fromkeys(rows, 0))[row] += 1
            if row == "converted-invalid":
                kind = invalid_kind(detail)
                kinds[kind] = kinds.get(kind, 0) + 1
            if listing and row != "converted+valid":
                print(f"{row:18} {group}/{path.name}: {detail[:400]}")
    total = {r: sum(c[r] for c in counts.values()) for r in rows}
    print(f"\n| inputs | {' | '.join(rows)} |\n| --- |{' --- |' * len(rows)}")
    for group, c in sorted(counts.items()):
        print(f"| {group} ({sum(c.values())}) | " + " | ".join(str(c[r]) for r in rows) + " |")
    print(f"| all ({sum(total.values())}) | " + " | ".join(str(total[r]) for r in rows) + " |")
    print("\n| converted-invalid: why | inputs |\n| --- | --- |")
    for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {n} |")
    return total


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "gather" and len(sys.argv) == 6:
        gather(*sys.argv[2:6])
    elif len(sys.argv) >= 3 and sys.argv[1] == "run":
        run(sys.argv[2], "--list" in sys.argv)
    else:
        print(__doc__)
        sys.exit(2)
