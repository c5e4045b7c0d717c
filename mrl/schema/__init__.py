"""The schema machinery every section is declared with (`section.py`) and checked by (`value.py`),
and the TOML rendering of a spec (`dump.py`). The bottom of mrl: it imports nothing of mrl above it."""
