"""`python -m sglang.launch_server ...` for the contract tests (see the package docstring)."""
from tests.rollout.servers.sglang_contract import main

if __name__ == "__main__":
    main()
