"""`mrl data`: verl-format parquet files from local datasets, the equivalent of verl's
`examples/data_preprocess/{gsm8k,math_dataset}.py` and of a reasoning-gym task.

Every row written has verl's columns, which `mrl train` reads as they are (`data.answer_key`
defaults to `reward_model.ground_truth` on such files, and `reward.builtin = "auto"` routes by
`data_source` to verl's scorers):

| column | gsm8k | math | geo3k | gym |
| --- | --- | --- | --- | --- |
| `data_source` | `openai/gsm8k` | `DigitalLearningGmbH/MATH-lighteval` | `hiyouga/geometry3k` | `reasoning_gym/<task>` |
| `prompt` | question + verl's "####" instruction, one user message | problem + verl's `\\boxed{}` instruction | problem (with its `<image>` mark) + verl's think/boxed instruction | reasoning-gym's default system prompt, then the question |
| `images` | - | - | the row's images, as the source holds them (`{bytes, path}`) | - |
| `ability` | `math` | `math` | `math` | `reasoning` |
| `reward_model` | `{style: rule, ground_truth: the number after "#### "}` | `{style: rule, ground_truth: the last boxed answer}` | `{style: rule, ground_truth: the answer}` | `{style: rule, ground_truth: the task's answer}` |
| `extra_info` | `{split, index, answer, question}` | `{split, index}` | `{split, index, answer, question}` | `{split, index, reasoning_gym: JSON of {task, entry}}` |

geo3k is verl's `examples/data_preprocess/geo3k.py` (geometry3k: `problem`, `answer`, `images`);
a row whose `<image>` marks do not pair up with its images is an error naming the row, since
training would drop it (`mrl.data.images`).

Inputs are read without the `datasets` package: a `.parquet`, `.jsonl`/`.json` or `.arrow` file,
or a directory holding such files in the layouts Hugging Face uses (`save_to_disk`'s
`<split>/data-*.arrow`, the hub's `<config>/<split>-*.parquet` or `data/<split>-*.parquet`,
`<split>.jsonl`). Each split found becomes `<out>/<split>.parquet`, as verl's scripts write.
Columns of the input other than the question and answer are kept, as `datasets.map` keeps them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq

from mrl.errors import UserError

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
GEO3K_INSTRUCTION = ("You FIRST think about the reasoning process as an internal monologue and then provide the final "
                     "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
                     "MUST BE put in \\boxed{}.")
GSM8K_SOURCE = "openai/gsm8k"
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"  # verl's mirror of lighteval/MATH
GEO3K_SOURCE = "hiyouga/geometry3k"   # what verl's geo3k scorer (`reward.builtin = "auto"`) routes on
DATA_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json")
_GSM8K_SOLUTION = re.compile(r"#### (\-?[0-9\.\,]+)")


# ---------------------------------------------------------------- reading local datasets
def _read_file(path: Path) -> pa.Table:
    try:
        if path.suffix == ".parquet":
            return pq.read_table(path)
        if path.suffix in (".jsonl", ".json"):
            return pajson.read_json(path)
        with pa.memory_map(str(path)) as source:   # datasets' save_to_disk writes the IPC stream format
            try:
                return pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                return pa.ipc.open_file(source).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{path}: cannot read it as {path.suffix[1:]}: {e}") from None


def _split_of(path: Path, root: Path) -> str:
    """A data file's split: its directory under `root` (save_to_disk), else its name before the
    first "-" or "." ("train-00000-of-00001.parquet", "test.jsonl")."""
    if path.name.startswith("data-") and path.parent != root:
        return path.parent.name
    return re.split(r"[-.]", path.name, maxsplit=1)[0]


def read_splits(source: str | Path, subset: str | None = None) -> dict[str, list[dict]]:
    """Records per split of a local dataset (a file: one split named after its stem; a directory:
    every data file under it, grouped by `_split_of`). `subset` keeps files under a directory of
    that name (the hub's dataset configs, e.g. gsm8k's "main" and "socratic")."""
    root = Path(source)
    if root.is_file():
        if root.suffix not in DATA_SUFFIXES:
            raise UserError(f"{root}: not a data file ({', '.join(DATA_SUFFIXES)})")
        return {_split_of(root, root.parent): _read_file(root).to_pylist()}
    if not root.is_dir():
        raise UserError(f"{root}: no such file or directory")
    files = sorted(p for p in root.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file()
                   and p.name not in ("dataset_info.json", "state.json", "dataset_dict.json"))
    if subset is not None:
        chosen = [p for p in files if subset in p.relative_to(root).parts[:-1]]
        if not chosen:
            dirs = sorted({p.relative_to(root).parts[0] for p in files if len(p.relative_to(root).parts) > 1})
            raise UserError(f"{root}: no data files under a directory named {subset!r} (--subset); "
                            f"directories: {', '.join(dirs) or 'none'}")
        files = chosen
    if not files:
        raise UserError(f"{root}: no data files ({', '.join(DATA_SUFFIXES)}) in it")
    splits: dict[str, list[dict]] = {}
    for path in files:
        splits.setdefault(_split_of(path, root), []).extend(_read_file(path).to_pylist())
    return splits


# ---------------------------------------------------------------- rows
@dataclass(frozen=True)
class Shape:
    """How one kind of dataset becomes verl rows."""

    question: str  # input column with the question
    answer: str  # input column with the worked solution
    data_source: str
    instruction: str
    ground_truth: Callable[[str], str | None]  # the answer from the solution text; None when it has none
    keep_raw: bool  # extra_info gets the raw question and answer (verl's gsm8k script does)
    check: Callable[[dict], str | None] | None = None  # why a record cannot be used (None: it can)


def gsm8k_ground_truth(solution: str) -> str | None:
    """The number after the first `#### ` of a GSM8K solution, commas removed (verl's extraction)."""
    found = _GSM8K_SOLUTION.search(solution)
    return found.group(1).replace(",", "") if found else None


def math_ground_truth(solution: str) -> str | None:
    """The last boxed answer of a MATH solution (verl's `remove_boxed(last_boxed_only_string(...))`)."""
    from mrl.reward.verl_scores import hendrycks_last_boxed, unbox

    boxed = hendrycks_last_boxed(solution)
    try:
        return unbox(boxed) if boxed is not None else None
    except ValueError:
        return None


def geo3k_images(record: dict) -> str | None:
    """Why a geometry3k record's images cannot be used: no `images` column, or `<image>` marks in
    the problem that do not pair up with its images (None: they pair up)."""
    from mrl.data.images import IMAGE_COLUMN, PLACEHOLDER, image_cells

    if IMAGE_COLUMN not in record:
        return f"no column {IMAGE_COLUMN!r}"
    marks, images = str(record["problem"]).count(PLACEHOLDER), len(image_cells(record[IMAGE_COLUMN]))
    return None if marks == images else f"{marks} {PLACEHOLDER} mark(s) in 'problem' for {images} image(s)"


SHAPES = {
    "gsm8k": Shape("question", "answer", GSM8K_SOURCE, GSM8K_INSTRUCTION, gsm8k_ground_truth, keep_raw=True),
    "math": Shape("problem", "solution", MATH_SOURCE, MATH_INSTRUCTION, math_ground_truth, keep_raw=False),
    # geometry3k's answer is the ground truth as it stands; its images column is kept as the source holds it
    "geo3k": Shape("problem", "answer", GEO3K_SOURCE, GEO3K_INSTRUCTION, lambda a: a.strip() or None, keep_raw=True,
                   check=geo3k_images),
}


def shaped_rows(records: list[dict], shape: Shape, split: str, where: str, data_source: str | None = None) -> list[dict]:
    """verl rows of `records` (one split). A record without the shape's columns, or a solution
    with no answer to extract, is a `UserError` naming the row."""
    rows = []
    for i, rec in enumerate(records):
        missing = [c for c in (shape.question, shape.answer) if c not in rec]
        if missing:
            raise UserError(f"{where} row {i}: no column {', '.join(map(repr, missing))}; columns: {', '.join(rec)}")
        problem = shape.check(rec) if shape.check is not None else None
        if problem is not None:
            raise UserError(f"{where} row {i}: {problem}")
        question, solution = rec[shape.question], rec[shape.answer]
        truth = shape.ground_truth(str(solution))
        if truth is None:
            raise UserError(f"{where} row {i}: no answer in {shape.answer!r} ({str(solution)[-80:]!r})")
        extra = {"split": split, "index": i}
        if shape.keep_raw:
            extra.update(answer=solution, question=question)
        rest = {k: v for k, v in rec.items() if k not in (shape.question, shape.answer)}
        rows.append({**rest, "data_source": data_source or shape.data_source,
                     "prompt": [{"role": "user", "content": f"{question} {shape.instruction}"}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": extra})
    return rows


def gym_rows(task: str, size: int, seed: int, split: str, options: dict[str, Any] | None = None,
             system_prompt: str | None = "default") -> list[dict]:
    """`size` verl rows of reasoning-gym `task` (deterministic in `seed`); the entry travels in
    `extra_info.reasoning_gym` so the `reasoning_gym` / `auto` rewards call the task's own scorer."""
    from mrl.data import gym

    records = gym.gym_records(task, size, seed, **(options or {}))
    prefix = []
    if system_prompt is not None:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if system_prompt not in SYSTEM_PROMPTS:
            raise UserError(f"--system-prompt: reasoning-gym has no prompt {system_prompt!r} ({', '.join(SYSTEM_PROMPTS)})")
        prefix = [{"role": "system", "content": SYSTEM_PROMPTS[system_prompt]}]
    rows = []
    for i, rec in enumerate(records):
        info = rec[gym.EXTRA_KEY]
        rows.append({"data_source": rec["data_source"], "prompt": prefix + [{"role": "user", "content": rec["prompt"]}],
                     "ability": "reasoning", "reward_model": {"style": "rule", "ground_truth": str(rec["answer"])},
                     "extra_info": {"split": split, "index": i, gym.EXTRA_KEY: json.dumps(info, default=str)}})
    return rows


def write_rows(rows: list[dict], path: Path) -> Path:
    """`rows` as a parquet file at `path` (parents created)."""
    if not rows:
        raise UserError(f"{path}: no rows to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def prepare_shaped(kind: str, source: str, out: str, *, subset: str | None = None, splits: tuple[str, ...] = (),
                   data_source: str | None = None, force: bool = False) -> list[Path]:
    """`mrl data gsm8k|math`: every split of `source` (or those named) as `<out>/<split>.parquet`,
    after `mrl.outputs.check_output` (never over a file of `source`; existing files only with `force`)."""
    from mrl.outputs import check_output

    found = read_splits(source, subset=subset if subset is not None or kind != "gsm8k" else _gsm8k_subset(source))
    unknown = [s for s in splits if s not in found]
    if unknown:
        raise UserError(f"{source}: no split {', '.join(map(repr, unknown))} (--split); splits: {', '.join(found)}")
    check_output(out, what="mrl data: OUT", kind="dir", sources=[source], force=force,
                 writes=[f"{s}.parquet" for s in (splits or tuple(found))])
    return [write_rows(shaped_rows(found[s], SHAPES[kind], s, f"{source} split {s!r}", data_source), Path(out) / f"{s}.parquet")
            for s in (splits or tuple(found))]


def _gsm8k_subset(source: str) -> str | None:
    """GSM8K's hub copy holds two configs; verl uses "main" (None when the layout has no such directory)."""
    root = Path(source)
    return "main" if root.is_dir() and (root / "main").is_dir() else None
