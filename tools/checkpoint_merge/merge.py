"""Script form of `mrl merge` (for checkouts without the installed `mrl` command):

    python tools/checkpoint_merge/merge.py CKPT OUT [--max-shard-size 2GB] [--dtype ...] [--no-verify] [--format hf|peft]
"""
from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from mrl.cli import main

    sys.exit(main(["merge", *sys.argv[1:]]))
