"""The `mrl` parser, built from the command modules in the order `mrl --help` lists them; every
subcommand's `--help` gets a description and its examples (the module's `EXAMPLES`)."""
from __future__ import annotations

import argparse

from mrl.cli import compare, convert, data, keys, launch, merge, offline, plan, run, spec, track

COMMANDS = (spec, plan, run, offline, compare, track, launch, keys, convert, data, merge)

# shown under each subcommand's --help (a test runs every command's --help and checks each has some)
EXAMPLES: dict[str, tuple[str, ...]] = {name: lines for module in COMMANDS for name, lines in module.EXAMPLES.items()}


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with the lines of an "Examples:" epilog kept as written (not re-wrapped)."""

    def _fill_text(self, text, width, indent):
        if text.startswith("Examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def build_parser() -> argparse.ArgumentParser:
    from mrl import __version__
    from mrl.config.paths import PATHS_HELP

    parser = argparse.ArgumentParser(prog="mrl", description="Megatron-centric RL post-training for LLMs.",
                                     epilog=f"Job specs: {PATHS_HELP}.")
    parser.add_argument("--version", action="version", version=f"mrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.add(sub)
    for name, command in sub.choices.items():   # every subcommand's --help: what it does, and examples
        if not command.description:
            help_text = next(a.help for a in sub._choices_actions if a.dest == name)
            command.description = help_text[0].upper() + help_text[1:] + "."
        command.epilog = "Examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[name])
        command.formatter_class = _HelpFormatter
    return parser
