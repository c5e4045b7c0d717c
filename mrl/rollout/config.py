"""The `rollout` section: the generation engine, its sampling, lengths, memory and weight sync.

It covers every field of verl's RolloutConfig that applies to vLLM, under clearer names
(CONTRIBUTING.md has the verl -> mrl table).
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from mrl.schema.section import SEED_MAX, option, section


@section
class ValidationSampling:
    """Sampling used for validation generations (verl: val_kwargs)."""

    responses_per_prompt: int = option(1, ge=1, help="responses per validation prompt")
    do_sample: bool = option(False, help="sample (True) or decode greedily (False)")
    temperature: float = option(1.0, gt=0, help="sampling temperature when do_sample")
    top_k: int = option(-1, ge=-1, help="top-k; -1 disables")
    top_p: float = option(1.0, gt=0, le=1, help="nucleus sampling mass")


@section
class ToolServerConfig:
    """One `[[rollout.multi_turn.servers]]` table: a tool server whose tools are listed at start."""

    name: str = option(help="names the server in errors, logs and docs; unique among the servers")
    kind: Literal["http", "mcp_stdio", "mcp_http"] = option(
        help="http: mrl's JSON tool protocol (GET <url>/tools, POST <url>/call; docs/tools.md); mcp_stdio: an MCP "
             "server started as a subprocess (command, args, env); mcp_http: an MCP server at a streamable-HTTP url")
    url: Optional[str] = option(None, help="http: the protocol's base URL; mcp_http: the MCP endpoint (e.g. http://host:8000/mcp)")
    command: Optional[str] = option(None, help="mcp_stdio: the executable that serves MCP on its stdin/stdout")
    args: tuple[str, ...] = option((), help="mcp_stdio: the command's arguments")
    env: dict[str, str] = option(factory=dict, help="mcp_stdio: environment of the server process, over a minimal "
                                                    "default (HOME, PATH, ...); the trainer's environment is not passed")
    cwd: Optional[str] = option(None, help="mcp_stdio: working directory of the server process (default: the trainer's)")
    headers: dict[str, str] = option(factory=dict, help="http, mcp_http: extra HTTP headers sent with every request "
                                                        "(recorded with the run's spec: put secrets in header_env)")
    header_env: dict[str, str] = option(factory=dict, help="http, mcp_http: headers whose values come from environment "
                                                           "variables at start, e.g. {Authorization = \"TOOLS_AUTH\"}; never recorded")
    tools: tuple[str, ...] = option((), help="allowlist: the server's tools the model may call (default: all it lists); "
                                             "a name the server does not list is an error at start")
    timeout_s: float = option(30.0, gt=0, help="one call running longer is abandoned; the model sees a timeout error")
    connect_timeout_s: float = option(30.0, gt=0, help="connecting and listing the tools at start; longer is an error naming the server")
    concurrency: int = option(8, ge=1, help="calls in flight to this server at once")


@section
class MultiTurnConfig:
    """Multi-turn / tool-calling rollouts. Tool observations are masked out of the loss."""

    enable: bool = option(False, help="generate multi-turn conversations with tool calls")
    max_assistant_turns: Optional[int] = option(None, ge=1, help="cap on assistant turns")
    max_user_turns: Optional[int] = option(None, ge=1, help="cap on tool-response turns")
    tools: tuple[str, ...] = option((), help="tool functions, 'path/file.py:function' or 'module:function'; "
                                                 "called with the tool call's arguments as keywords")
    tool_timeout_s: float = option(10.0, gt=0, help="a tool call running longer is killed; the model sees a timeout error")
    servers: tuple[ToolServerConfig, ...] = option((), help="tool servers ([[rollout.multi_turn.servers]] tables): HTTP "
                                                            "and MCP, their tools listed at start (docs/tools.md)")
    tool_config: Optional[str] = option(None, help="verl's tool file (YAML `tools:` list): its mcp entries become servers; "
                                                   "a native class entry is refused, one line each (docs/tools.md)")
    max_tool_result_bytes: int = option(65536, ge=1, help="longest tool answer read, in bytes; a longer one is cut and "
                                                          "counted (tools/truncated) before max_tool_response_tokens applies")
    interaction_config: Optional[str] = option(None, help="verl's simulated-user definitions: not supported")
    max_parallel_calls: int = option(1, ge=1, help="tool calls executed (in parallel) per assistant turn; later calls are ignored")
    max_tool_response_tokens: int = option(256, ge=1, help="longest tool response kept, in tokens")
    tool_response_truncate_side: Literal["left", "middle", "right"] = option("middle", help="where a long tool response is cut")
    agent: Optional[str] = option(None, help="rollout.mode = 'server': the agent loop, 'path/file.py:function', an "
                                             "`async def agent(ctx) -> Trajectory` run once per trajectory "
                                             "(docs/multi_turn.md); default: the built-in tool loop")
    format: Literal["auto", "hermes", "llama3_json", "mistral"] = option(
        "hermes", help="tool-call format the model writes: hermes <tool_call>{json}</tool_call> (Qwen), llama3_json "
                       "(Llama 3.1+), mistral [TOOL_CALLS]; auto: the one the chat template writes. Tool turns are "
                       "the chat template's own tokens; the template must write this format")


@section
class WeightSyncConfig:
    """How trainer weights reach the engine each step (mrl's weight-mapping stream)."""

    bucket_mb: int = option(512, ge=1, help="size bound of one bucket of HF-named tensors")
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = option(None, help="dtype sent to the engine (default: rollout.dtype)")
    mode: Literal["full", "delta"] = option("full", help="full: every tensor every sync; delta: only what changed since "
                                                         "the engine's last version, compared bit for bit in the export "
                                                         "dtype (a host copy of the model per engine; full after the "
                                                         "engine lost its weights); the hf, vllm and sglang engines, "
                                                         "colocated or on separate rollout ranks (vllm: changed "
                                                         "tensors go whole, with their fused module; sglang: whole)")
    sparse_fraction: float = option(0.25, ge=0, le=1, help="delta: a tensor with fewer than this fraction of its elements "
                                                           "changed goes as index/value pairs, else whole")
    verify_every_steps: int = option(10, ge=0, help="every N syncs, check that each tensor the engine holds hashes to "
                                                    "the trainer's, read back from the engine (vllm: from its sharded, "
                                                    "fused parameters); 0: never; every bucket is checksummed regardless")


@section
class Fp8Config:
    """`rollout.quantization = "fp8"`: blockwise FP8 weights on the wire and in the engine (mrl/weights/fp8.py)."""

    power_of_two_scales: bool = option(False, help="round each 128x128 block's scale up to a power of two (UE8M0)")
    matmul: Literal["auto", "dequantized", "scaled_mm"] = option(
        "auto", help="hf engine: linear layers as FP8 GEMMs (torch._scaled_mm, activations per 1x128) or on the "
                     "dequantized weights; auto: FP8 GEMMs on CUDA GPUs of capability >= 8.9 (vllm: its own kernels)")
    skip: tuple[str, ...] = option(("embed_tokens", "lm_head", "norm", r"\.mlp\.gate\.weight$", "shared_expert_gate"),
                                   help="regular expressions (re.search) of tensor names kept in the export dtype; "
                                        "only 2-D *.weight tensors are ever quantized")


@section
class SGLangConfig:
    """`rollout.engine = "sglang"`: how the SGLang server (pinned 0.5.23) is launched and fed (docs/sglang.md)."""

    python: Optional[str] = option(None, help="Python interpreter that has sglang 0.5.23 installed and runs "
                                              "`-m sglang.launch_server` (default: the trainer's own)")
    server_args: dict[str, Any] = option(factory=dict, help="extra server flags by ServerArgs field name, e.g. "
                                                            "{attention_backend = \"fa3\"}: x_y becomes --x-y, true a bare "
                                                            "flag; they win over the flags mrl derives from [rollout]")
    port_base: int = option(0, ge=0, le=65535, help="HTTP port of the server of local rank 0 (local rank r: "
                                                    "port_base + r); 0: any free port")
    launch_timeout_s: float = option(600.0, gt=0, help="a server not answering /health_generate this long after its "
                                                       "launch is an error naming its log")
    weight_transport: Literal["auto", "tensor", "distributed"] = option(
        "auto", help="tensor: update_weights_from_tensor (CUDA IPC / shared memory, same node); distributed: "
                     "update_weights_from_distributed (a process group with the server, NCCL on GPUs); auto: tensor "
                     "colocated, distributed for separate rollout ranks")


@section
class RolloutConfig:
    """Generation engine and sampling. Colocated: engines sleep while the trainer runs."""

    engine: Literal["vllm", "hf", "sglang"] = option("vllm", help="vllm on GPU clusters; hf (transformers generate) "
                                                                "anywhere; sglang: an SGLang 0.5.23 server per engine "
                                                                "(docs/sglang.md)")
    mode: Literal["spmd", "server"] = option(
        "spmd", help="spmd: the engine runs inside the trainer's ranks, every rank of an engine group generating in "
                     "lockstep; server: each generating leader runs one continuously batching engine (vllm: an AsyncLLM "
                     "with its engine core in processes of its own; hf: a deterministic scheduler over transformers) "
                     "and every trajectory is its own coroutine "
                     "(docs/multi_turn.md, docs/async.md)")
    router: Literal["leader", "driver"] = option(
        "leader", help="rollout.mode = 'server': leader: each generating leader runs its own data-parallel shards' "
                       "trajectories on its own engine; driver: one router on the driver (colocated: rank 0; separate: "
                       "the first rollout rank) runs every shard's trajectories over every leader's engine (least "
                       "outstanding work, sticky per trajectory), the other leaders serving theirs over a local HTTP "
                       "channel (docs/async.md)")
    over_sample_rate: float = option(
        0.0, ge=0, le=4, help="rollout.mode = 'server': submit ceil((1 + rate) x the groups a step needs); once enough "
                              "groups have finished the rest are aborted and carried to the next step as partial "
                              "rollouts (rollout.max_staleness applies); 0: off")
    placement: Literal["colocated", "separate"] = option(
        "colocated", help="colocated: engines share the trainer's ranks and sleep while it trains; separate: the "
                          "last rollout.ranks ranks only generate, the others only train (docs/async.md)")
    ranks: int = option(0, ge=0, help="ranks that only generate when placement = 'separate' (the last ones of the world)")
    max_staleness: int = option(0, ge=0, le=64, help="policy versions a trained response may lag: 0 on-policy, 1 one-step "
                                                     "off-policy (generation of step t+1 overlaps training of step t)")
    partial_rollout_tokens: int = option(0, ge=0, help="partial rollouts: tokens an unfinished response advances per "
                                                       "generation round; a step trains the groups finished when it has "
                                                       "enough and carries the rest over to the next step (0: off)")
    responses_per_prompt: Optional[int] = option(
        None, ge=1, help="responses sampled per prompt (verl: n); default: 8 for an estimator that compares the "
                         "responses of a group (grpo, rloo, ...), else 1")
    max_response_tokens: int = option(512, ge=1, help="longest response, in tokens (verl: response_length)")
    do_sample: bool = option(True, help="sample (True) or decode greedily (False)")
    temperature: float = option(1.0, gt=0, help="sampling temperature; the trainer's log-probs use the same")
    top_k: int = option(-1, ge=-1, help="top-k; -1 disables")
    top_p: float = option(1.0, gt=0, le=1, help="nucleus sampling mass")
    min_p: float = option(0.0, ge=0, le=1, help="min-p sampling threshold")
    repetition_penalty: float = option(1.0, gt=0, help="repetition penalty (1 = off)")
    ignore_eos: bool = option(False, help="keep generating past EOS up to max_response_tokens")
    stop_token_ids: tuple[int, ...] = option((), ge=0, help="extra token ids that end a response (within the model's vocabulary)")
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = option("processed_logprobs", help="reported log-probs: of the sampled distribution (after penalty, temperature, top-k/p, min-p) or of the raw model output (mrl/rollout/README.md)")
    seed: Optional[int] = option(None, ge=0, le=SEED_MAX, help="engine sampling seed (default: job.seed)")
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = option(None, help="engine dtype (default: model.dtype)")
    tensor_parallel: int = option(1, ge=1, help="engine tensor-parallel size")
    pipeline_parallel: int = option(1, ge=1, help="engine pipeline-parallel size")
    expert_parallel: bool = option(False, help="shard MoE experts across the engine's TP x DP ranks")
    gpu_memory_utilization: float = option(0.5, gt=0, le=1, help="fraction of GPU memory the engine may use")
    max_model_len: Optional[int] = option(None, ge=1, help="engine context length (default: prompt + response tokens)")
    max_num_seqs: int = option(1024, ge=1, help="sequences batched concurrently")
    max_num_batched_tokens: int = option(8192, ge=1, help="tokens per engine scheduler step")
    enable_chunked_prefill: bool = option(True, help="chunked prefill")
    enable_prefix_caching: bool = option(True, help="prefix caching (shared prompts across n responses)")
    enforce_eager: bool = option(False, help="disable CUDA graphs")
    cudagraph_capture_sizes: Optional[tuple[int, ...]] = option(None, ge=1, help="batch sizes captured as CUDA graphs")
    sleep_level: int = option(1, choices=(0, 1, 2), help="0 keeps the engine awake; 1 offloads weights, drops KV cache; 2 drops both")
    load_format: Literal["dummy", "auto"] = option("dummy", help="dummy: weights arrive from the trainer; auto: engine loads model.path")
    quantization: Optional[Literal["fp8"]] = option(None, help="fp8: linear weights go to the engine as blockwise "
                                                               "float8_e4m3fn with per-128x128-block scales (docs/fp8.md)")
    fp8: Fp8Config = option(factory=Fp8Config, help="blockwise FP8 rollout weights")
    disable_log_stats: bool = option(True, help="silence the engine's periodic stats")
    generate_timeout_s: float = option(3600.0, gt=0, help="a generate call that takes longer is an error")
    engine_kwargs: dict[str, Any] = option(factory=dict, help="extra engine arguments passed through verbatim")
    validation: ValidationSampling = option(factory=ValidationSampling, help="validation sampling")
    multi_turn: MultiTurnConfig = option(factory=MultiTurnConfig, help="multi-turn rollouts")
    weight_sync: WeightSyncConfig = option(factory=WeightSyncConfig, help="trainer -> engine weight stream")
    sglang: SGLangConfig = option(factory=SGLangConfig, help="the sglang engine's server (rollout.engine = 'sglang')")
