"""`mrl keys`: every job-spec key with its type, default and meaning; `--verl`: verl's keys and their mrl names."""
from __future__ import annotations

import sys

from mrl.errors import UserError


def cmd_keys(args) -> int:
    """Every key with its type, default and help, optionally under a prefix: a table sized to the
    terminal (wide when piped), or `--json` for scripts."""
    import dataclasses
    import json

    from rich.console import Console
    from rich.table import Table

    from mrl.schema.section import fields_of, section_of
    from mrl.schema.value import describe
    from mrl.config.job import JobSpec
    from mrl.config.paths import PATHS_HELP

    if args.verl:
        return _verl_keys(args.prefix, args.json)
    rows: list[dict] = []

    def walk(cls, prefix: str):
        for f in dataclasses.fields(cls):
            info = fields_of(cls)[f.name]
            dotted = prefix + f.name
            sub = section_of(info.type)
            if sub is not None:
                walk(sub, dotted + ".")
                continue
            if args.prefix and not dotted.startswith(args.prefix):
                continue
            if info.required:
                default = None
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = f.default
            rows.append({"key": dotted, "type": describe(info.type), "required": info.required,
                         "default": list(default) if isinstance(default, tuple) else default,
                         "meaning": info.meta.get("help", "")})

    walk(JobSpec, "")
    from mrl.sft.config import SFTConfig

    walk(SFTConfig, "sft.")   # the section of SFT jobs (`mrl sft`); the other sections are shared
    if not rows:
        from mrl.config.verl_table import verl_table

        hint = (f"; it is a verl name: `mrl keys --verl {args.prefix}` shows the mrl keys it maps to"
                if verl_table().rows(args.prefix) else "")
        raise UserError(f"{args.prefix}: no mrl key starts with this{hint}")
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = Table("key", "type", "default", "meaning", show_lines=False, caption=PATHS_HELP.capitalize() + ".")
    for r in rows:
        default = "(required)" if r["required"] else repr(tuple(r["default"]) if isinstance(r["default"], list)
                                                          else r["default"])
        table.add_row(r["key"], r["type"], default, r["meaning"])
    console = Console() if sys.stdout.isatty() else Console(width=200)   # the terminal's width; wide in pipes
    console.print(table)
    return 0


def _verl_keys(prefix: str, as_json: bool) -> int:
    """`mrl keys --verl`: the verl key table (mrl/config/verl_keys.toml)."""
    import json

    from rich.console import Console
    from rich.table import Table

    from mrl.config.verl_table import verl_table

    rows = verl_table().rows(prefix)
    if not rows:
        raise UserError(f"{prefix}: no verl key in mrl's table starts with this (`mrl keys --verl` lists them all)")
    if as_json:
        print(json.dumps([{"verl": v, "mrl": m, "how": h} for v, m, h in rows], indent=1))
        return 0
    table = Table("verl key", "mrl key", "value translation, or why there is none",
                  caption="mrl convert translates a verl config with this table (mrl/config/verl_keys.toml).")
    for row in rows:
        table.add_row(*row)
    (Console() if sys.stdout.isatty() else Console(width=220)).print(table)
    return 0


def add(sub) -> None:
    """The parser of `mrl keys`."""
    p = sub.add_parser("keys", help="list every job-spec key with its type, default and meaning")
    p.add_argument("prefix", nargs="?", default="", help="only keys starting with this (e.g. rollout.)")
    p.add_argument("--json", action="store_true", help="a JSON list of {key, type, required, default, meaning}")
    p.add_argument("--verl", action="store_true", help="list verl's keys instead: each with its mrl key and value "
                                                      "translation, or why mrl has none (the table mrl convert uses)")
    p.set_defaults(func=cmd_keys)


EXAMPLES: dict[str, tuple[str, ...]] = {   # under each command's --help
    "keys": ("mrl keys rollout.", "mrl keys --verl actor_rollout_ref.rollout", "mrl keys --json > keys.json"),
}
