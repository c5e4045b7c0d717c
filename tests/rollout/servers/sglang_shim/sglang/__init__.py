"""Test shim: `python -m sglang.launch_server` starts the contract server (tests/rollout/servers/
sglang_contract.py) when this directory leads the child's PYTHONPATH. Never on mrl's own path."""
__version__ = "0.5.23"
