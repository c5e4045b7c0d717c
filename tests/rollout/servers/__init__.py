"""Tool servers the tool-server tests, the multi-turn job test and tools/bench/tool_servers.py start."""
