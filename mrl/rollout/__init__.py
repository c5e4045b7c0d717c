"""mrl.rollout: generation engines (vllm, hf, sglang) fed by the trainer's weight stream.

- `RolloutEngine` (engine.py): `generate(prompt_token_ids, Sampling) -> [Response]`,
  `update_weights(stream)`, `sleep(level)`, `wake(tags)`, `shutdown()`; `build_engine` (factory.py)
  picks the backend: `HFEngine` (hf.py), `VLLMEngine` (vllm_engine.py) or `SGLangRolloutEngine`
  (sglang_sync.py, over `SGLangEngine`, sglang_engine.py: an SGLang 0.5.23 server, docs/sglang.md).
- `Sampling`, `Response`, `sampling_from_config` (types.py).
- logprobs.py: the reported log-probability (`logprobs_mode`), shared by engines and trainer.
- audit.py: `logprob_audit` (train/inference mismatch metrics), `teacher_forced_logprobs`.
- multi_turn.py, tools.py: tool-calling conversations, tool output masked out of the loss;
  tool_servers/: HTTP and MCP tool servers, verl's tool file (docs/tools.md).
See README.md in this directory. Names are imported lazily: the spec loader reads
`mrl.rollout.config` and must not pay for importing torch.
"""
import importlib

_EXPORTS = {
    "RolloutEngine": "engine", "buckets": "engine", "build_engine": "factory",
    "Sampling": "types", "Response": "types", "sampling_from_config": "types",
    "logprob_audit": "audit", "teacher_forced_logprobs": "audit", "pack_sequences": "audit", "hf_logits_fn": "audit",
    "MultiTurnRollout": "multi_turn", "ToolRunner": "tools", "ToolCall": "tools", "ToolResult": "tools",
    "HFEngine": "hf", "VLLMEngine": "vllm_engine", "SGLangEngine": "sglang_engine",
    "SGLangRolloutEngine": "sglang_sync",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
