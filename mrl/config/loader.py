"""Load a TOML job spec: `extends` chains (`files.py`), dotted overrides (`overrides.py`), paths
(`paths.py`), then the strict typed build here, all errors at once (`report.py`).

Every problem is reported as one line, `file:line: dotted.key: message`, and loading collects all
of them before failing, so a spec with three mistakes shows three lines.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mrl.config.files import display, flatten, read_spec_file
from mrl.config.overrides import apply_overrides
from mrl.config.paths import resolve_paths
from mrl.config.report import Report
from mrl.config.suggest import explain_unknown
from mrl.errors import SpecError
from mrl.schema.section import all_keys, fields_of, section_of, tables_of
from mrl.schema.value import ValueProblem, check_range, convert, describe, kind_of


def build_section(cls, raw: Any, prefix: str, report: Report, valid: list[str]):
    """Instance of section `cls` from `raw`, reporting every problem in it.

    A field with a bad value falls back to its default (its key goes in `report.bad_keys`) so that
    the cross-section checks still run and the user sees every error at once. Returns None only
    when the section cannot be built at all (a required key is missing or bad).
    """
    name = prefix[:-1] if prefix else "job spec"
    if not isinstance(raw, dict):
        report.error(name, f"must be a table, got {kind_of(raw)}")
        report.bad_keys.add(name)
        raw = {}
    fields = fields_of(cls)
    for key in raw:
        if key not in fields:
            dotted = prefix + key
            if isinstance(raw[key], dict) and raw[key]:
                _unknown_table(dotted, raw[key], report, valid, list(fields))
            else:
                report.error(dotted, explain_unknown(dotted, list(fields), valid))
    values = {}
    buildable = True
    for fname, f in fields.items():
        dotted = prefix + fname
        if fname not in raw:
            if f.required:
                report.error(dotted, f"missing required key ({f.meta.get('help') or describe(f.type)})")
                buildable = False
            continue
        sub = section_of(f.type)
        if sub is not None:
            value = build_section(sub, raw[fname], dotted + ".", report, valid)
            if value is None:
                buildable = False
            values[fname] = value
            continue
        elem = tables_of(f.type)
        if elem is not None:   # a list of tables: each built (and reported) as `key[i].field`
            if not isinstance(raw[fname], (list, tuple)):
                report.error(dotted, f"must be a list of tables ([[{dotted}]]), got {kind_of(raw[fname])}")
                report.bad_keys.add(dotted)
                continue
            built = [build_section(elem, item, f"{dotted}[{i}].", report, valid) for i, item in enumerate(raw[fname])]
            if any(b is None for b in built):
                report.bad_keys.add(dotted)
                continue
            values[fname] = tuple(built)
            continue
        try:
            value = convert(raw[fname], f.type)
            check_range(value, f.meta)
        except ValueProblem as e:
            report.error(dotted, str(e))
            report.bad_keys.add(dotted)
            buildable = buildable and not f.required
            continue
        values[fname] = value
    return cls(**values) if buildable else None


def _unknown_table(dotted: str, table: dict, report: Report, valid: list[str], siblings: list[str]) -> None:
    """An unknown table: one line for it (pointing verl sections to `mrl convert`), then one line per
    key inside it, each with its suggestion (verl's `[actor_rollout_ref.actor]` -> `actor.optim.lr`)."""
    from mrl.config.verl_table import verl_table

    if verl_table().rows(dotted + "."):
        report.error(dotted, "unknown table; it is verl's: `mrl convert` turns a verl config into an mrl job, "
                             "and each key below names its mrl counterpart")
    else:
        report.error(dotted, explain_unknown(dotted, siblings, valid).replace("unknown key", "unknown table", 1))
    for leaf, value in flatten(table, dotted + "."):
        if isinstance(value, dict) and value:
            continue
        parent = leaf.rpartition(".")[0]
        siblings = [k.rsplit(".", 1)[-1] for k in valid if k.rpartition(".")[0] == parent]
        report.error(leaf, explain_unknown(leaf, siblings, valid))


def _about(problem: str, keys: set[str]) -> bool:
    """Whether a formatted problem names one of `keys` (or a key inside one of them)."""
    return any(f" {k}" in problem or f": {k}." in problem for k in keys)


def load(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (), root=None):
    """Load and validate a job spec. Returns (spec, report); raises SpecError listing every problem."""
    from mrl.config import defaults, validate
    from mrl.config.job import JobSpec

    path = Path(path)
    report = Report(main_file=display(path.resolve()))
    raw = read_spec_file(path, report)
    if raw is None:
        raise SpecError(report.problems[0], problems=report.problems)
    from mrl.config import sft_job   # a job with an [sft] table is an SFT job (`mrl sft`)

    if root is None:
        root = sft_job.SFTJobSpec if sft_job.is_sft_table(raw) else JobSpec
    if root is sft_job.SFTJobSpec:
        resolve, check = sft_job.resolve, sft_job.check
    else:
        resolve, check = defaults.resolve, validate.check
    apply_overrides(raw, list(overrides), root, report)
    resolve_paths(raw, report)
    spec = build_section(root, raw, "", report, all_keys(root))
    if spec is not None:
        # Cross-section checks run even after field errors (bad values fell back to defaults),
        # but a check about a key whose value was rejected would only repeat that error.
        spec = resolve(spec, default_name=path.stem)
        checks = Report(main_file=report.main_file, origins=report.origins)
        check(spec, checks)
        report.problems += [p for p in checks.problems if not _about(p, report.bad_keys)]
        report.warnings += checks.warnings
    if report.problems:
        raise SpecError(report.problems[0], problems=report.problems)
    return spec, report
