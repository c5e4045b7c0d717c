"""The bash reader of `mrl convert` (mrl/convert/shell.py): the forms verl's launch scripts use,
read as bash would, without running anything; what it cannot know is asked for, never guessed;
what it cannot read is one line naming the script line."""
from __future__ import annotations

from pathlib import Path

import pytest

from mrl.convert import inputs
from mrl.convert.shell import read_script_text
from mrl.convert.shell_lex import ShellError
from mrl.errors import UserError


def _args(text: str, env: dict | None = None) -> list[str]:
    found = read_script_text(text, Path("/scripts/run.sh"), env={"HOME": "/home/u", **(env or {})})
    assert found.command is not None
    return [found.describe(a) for a in found.command.args]


def test_arrays_expand_into_one_word_per_item():
    text = """
DATA=(
    data.train_batch_size=8   # a comment inside the array
    "data.train_files=['/a b.parquet']"
)
DATA+=(data.max_prompt_length=16)
EMPTY=()
python3 -m verl.trainer.main_ppo "${DATA[@]}" "${EMPTY[@]}" "$@" trainer.total_epochs=${#DATA[@]}
"""
    assert _args(text) == ["data.train_batch_size=8", "data.train_files=['/a b.parquet']",
                           "data.max_prompt_length=16", "trainer.total_epochs=3"]


def test_parameter_expansions():
    text = """
A=${UNSET_A:-default}
B=${SET_B:-default}
C=${EMPTY_C-kept}
D=${A:+alt}
F=/x/y/model.tar.gz
python3 -m verl.trainer.main_ppo a=$A b=$B c=$C d=$D e=${F##*/} f=${F%.gz} g=${F/model/m} h=${A^^}
"""
    assert _args(text, {"SET_B": "env", "EMPTY_C": ""}) == ["a=default", "b=env", "c=", "d=alt", "e=model.tar.gz",
                                                           "f=/x/y/model.tar", "g=/x/y/m.tar.gz", "h=DEFAULT"]


def test_arithmetic_as_bash_computes_it():
    text = """
max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 8))
budget=$(((max_prompt_length + max_response_length) * 2))
neg=$(( -7 / 2 ))
rem=$(( -7 % 3 ))
python3 -m verl.trainer.main_ppo a=$budget b=$neg c=$rem d=$((2**10 >> 2)) e=$(( 3 > 2 && 1 ))
"""
    assert _args(text) == ["a=20480", "b=-3", "c=-1", "d=256", "e=1"]   # C division, as bash


def test_multi_line_strings_continuations_env_prefixes_and_export():
    text = """set -xeuo pipefail
export VLLM_USE_V1=1 MODEL=/m
echo "starting" >&2
PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 python3 -m verl.trainer.main_ppo \\
    actor_rollout_ref.model.path=$MODEL \\
    trainer.logger='["console",
        "wandb"]' \\
    data.prompt_key=prompt 2>&1 | tee log.txt
echo done
"""
    assert _args(text) == ["actor_rollout_ref.model.path=/m", 'trainer.logger=["console",\n        "wandb"]',
                           "data.prompt_key=prompt"]


def test_a_commented_line_inside_a_continued_command_continues_it():
    text = ("python3 -m verl.trainer.main_ppo \\\n    data.a=1 \\\n    # data.b=2 \\\n    data.c=3\n")
    found = read_script_text(text, Path("run.sh"), env={})
    assert found.command.args == ["data.a=1", "data.c=3"]
    assert any("line 3: a commented-out line" in n for n in found.notes)


def test_if_case_for_and_functions():
    text = """
MODE=${MODE:-fsdp}
case "$MODE" in
    fsdp|dp) ENGINE=dp ;;
    megatron) ENGINE=megatron ;;
    *) echo "unknown"; exit 1 ;;
esac
if [ "$ENGINE" = megatron ] && [ -n "$MODE" ]; then X=1; elif [[ $MODE == fs* ]]; then X=2; else X=3; fi
L=""
for k in a b; do L="$L$k"; done
add() { EXTRA+=("trainer.$1=$2"); }
add nnodes 2
if (( X % 2 == 0 )); then Y=even; fi
python3 -m verl.trainer.main_ppo model_engine=$ENGINE x=$X l=$L y=$Y "${EXTRA[@]}"
"""
    assert _args(text) == ["model_engine=dp", "x=2", "l=ab", "y=even", "trainer.nnodes=2"]
    assert _args(text, {"MODE": "megatron"})[:2] == ["model_engine=megatron", "x=1"]


def test_the_npu_probe_is_answered_no():
    text = """DEVICE=${DEVICE:-$(python3 -c 'import torch_npu' 2>/dev/null && echo npu || echo gpu)}
python3 -m verl.trainer.main_ppo trainer.device=$DEVICE
"""
    found = read_script_text(text, Path("run.sh"), env={})
    assert found.command.args == ["trainer.device=gpu"]
    assert any("never on Ascend NPUs" in n for n in found.notes)


def test_nothing_is_executed(tmp_path):
    marker = tmp_path / "ran"
    text = f"""touch {marker}
X=$(touch {marker}; echo hi)
python3 -m verl.trainer.main_ppo x=$X `touch {marker}`
"""
    found = read_script_text(text, Path("run.sh"), env={})
    assert not marker.exists()
    assert found.describe(found.command.args[0]) == f"x=<$(touch {marker})>hi"


def test_unknown_values_are_asked_for_never_defaulted(tmp_path, monkeypatch):
    """$(date ...) in a setting, an unset variable: `mrl convert` names the value to supply."""
    from mrl.convert import convert

    monkeypatch.delenv("CKPT_ROOT", raising=False)
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo trainer.default_local_dir=$CKPT_ROOT/ckpt "
                      "trainer.experiment_name=exp_$(date +%s) data.train_batch_size=$(nproc)\n")
    found = inputs([str(script)])
    conv = convert(found.yamls, found.tokens, config_name=found.config_name, describe=found.describe)
    text = " ".join(conv.problems)
    assert "trainer.default_local_dir = '<$CKPT_ROOT, which is not set (give it in the environment)>/ckpt'" in text
    assert "supply checkpoint.dir" in text and "supply data.prompts_per_step" in text and "<$(nproc)>" in text
    assert "checkpoint.dir" not in conv.values and "data.prompts_per_step" not in conv.values
    assert [k for k, _, _ in conv.not_converted if k == "trainer.experiment_name"]   # mrl names the run


@pytest.mark.parametrize("text, line, words", [
    ('X=$(hostname)\nif [ "$X" = a ]; then Y=1; fi\npython3 -m verl.trainer.main_ppo y=$Y\n', 2, "cannot know"),
    ('case "$(uname -m)" in x86_64) A=1;; esac\npython3 -m verl.trainer.main_ppo\n', 1, "`case` on"),
    ("A='never closed\npython3 -m verl.trainer.main_ppo\n", 1, "never closed"),
    ("python3 -m verl.trainer.main_ppo x=$((1 / 0))\n", 1, "division by 0"),
    ("if true; then\npython3 -m verl.trainer.main_ppo\n", 1, "expected `fi`"),
    ('X=${A@Q}\npython3 -m verl.trainer.main_ppo\n', 1, "cannot read"),
])
def test_what_cannot_be_read_is_one_line_naming_the_script_line(tmp_path, text, line, words):
    script = tmp_path / "run.sh"
    script.write_text(text)
    with pytest.raises(UserError) as e:
        inputs([str(script)])
    assert len(e.value.problems) == 1
    assert f"run.sh line {line}: " in str(e.value) and words in str(e.value)


def test_trainers_mrl_does_not_convert_are_refused_by_name(tmp_path):
    for module, words in [("verl.trainer.sft_trainer", "SFT"), ("recipe.spin.main_spin", "does not know"),
                          ("verl.experimental.fully_async_policy.fully_async_main", "asynchronous")]:
        script = tmp_path / "run.sh"
        script.write_text(f"torchrun --nproc_per_node 8 -m {module} a=1\n")
        with pytest.raises(UserError, match=words):
            inputs([str(script)])
    script.write_text("echo no trainer here\n")
    with pytest.raises(UserError, match="no verl trainer command"):
        inputs([str(script)])


def test_loops_and_sizes_are_bounded():
    with pytest.raises(ShellError, match="more than 50 deep"):
        read_script_text("f() { f; }\nf\n", Path("run.sh"), env={})
    with pytest.raises(ShellError, match="at most"):
        read_script_text("#" * 2_000_000, Path("run.sh"), env={})


def test_fuzzed_scripts_are_read_or_refused_never_a_traceback():
    """Random soups of the shell forms above: each is read or refused with a ShellError (which
    `mrl convert` prints as one line), never another exception."""
    import random

    pieces = ["python3 -m verl.trainer.main_ppo ", "a=1 ", "$((", "))", "$(", ")", "${", "}", "X", ":-", "[@]", "'",
              '"', "\\\n", "\n", "#c", " ", "(", ";", ";;", "&&", "||", "|", "if ", "then ", "fi", "else ", "case ",
              " in ", "esac", "for ", "do ", "done", "{", "A=(", "[ ", " ]", "=", "-z ", "$X", "`", "<<EOF\n", "EOF\n",
              "f() ", "f ", "1", "*", "/", "%", "$#", "$@", "2>&1", ">", "export ", "exit 1", "while ", "((", "!",
              "${#X}", "${X%%*}", "$((X/0))", "${X:1:2}", "function ", "\\"]
    rng = random.Random(3)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30)))
        try:
            read_script_text(text, Path("x.sh"), env={})
        except ShellError:
            pass
