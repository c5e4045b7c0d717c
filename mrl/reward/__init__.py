"""mrl.reward: scoring responses.

Entry points for the trainer: `mrl.reward.compose.Rewarder.from_config(cfg.reward, model_scorer=)`
and `Rewarder.score([RewardSample, ...]) -> RewardResult`. Pieces: `builtins` (rule verifiers),
`function` (user function references), `pool` (isolated calls with timeouts), `outcome` (return
values to scores), `sources` (the job's weighted sources and their checks), `model` (reward-model
call path).
"""
