"""Scores for a batch of responses: every source, isolated user code, weights, errors by policy.

`Rewarder.score(samples)` runs rule sources (builtins and user functions) in the `RewardPool`
and the reward model (if any) through its `RewardModelScorer`, then sums `weight x score` per
response. A failed call (exception, timeout, crash, out of memory, NaN, infinity, a number beyond
float32, a non-number) is logged with its sample id, counted by kind in `stats`, and handled by
`reward.on_error`: "zero" scores it 0, "drop" marks the sample invalid (`valid[i] = False`; the
trainer leaves it out), "fail" raises a `UserError` for the step. Counts in `stats` (see
`is_count`) add up over batches and data-parallel ranks; the other entries are means.

A source's extra numbers (a dict's keys beside the score) are logged as `reward/<source>/<key>`,
at most `MAX_METRIC_KEYS` (64) distinct keys per source over a run; a response with keys beyond
them is counted in `reward/<source>/metrics_cut_calls` and the first such is said once.

Functions receive `extra` = the row's extra columns plus "data_source"; a verl-convention function
(`mrl.reward.signature`) receives verl's `data_source, solution_str, ground_truth, extra_info` by name.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from mrl.errors import UserError
from mrl.reward.config import RewardConfig
from mrl.reward.model import RewardModelScorer
from mrl.reward.outcome import BadScore, read_score
from mrl.reward.pool import Call, RewardPool, batch_budget_s
from mrl.reward.services import SERVICE_KINDS, service_scorers, services_budget_s
from mrl.reward.signature import verl_call_kwargs
from mrl.reward.sources import RewardSource, reward_sources

log = logging.getLogger(__name__)

OnError = Literal["zero", "drop", "fail"]
LOGGED_ERRORS_PER_BATCH = 10  # individual warnings per batch; the rest are summarized
MAX_METRIC_KEYS = 64  # extra metric keys logged per reward source over a run; the rest counted, said once


def is_count(key: str) -> bool:
    """Whether a reward metric counts things (sum it over batches and ranks) rather than averages them."""
    return key.startswith("reward/") and (key == "reward/errors" or "/errors/" in key
                                          or key.endswith(("_responses", "_calls", "workers_replaced")))


def scoring_budget_s(cfg: RewardConfig, responses: int) -> float:
    """The longest `Rewarder.score` of `responses` responses can take under `cfg` when every call
    runs up to `reward.timeout_s` (the pool enforces it); 0 without rule sources. Ranks waiting
    for a leader that scores wait this long plus the collective timeout."""
    sources = reward_sources(cfg, check_files=False)
    rule = sum(s.kind in ("function", "builtin") for s in sources)
    pool = batch_budget_s(responses * rule, cfg.workers, cfg.timeout_s) if rule else 0.0
    return pool + services_budget_s(cfg, sources, responses)


@dataclass(frozen=True)
class RewardSample:
    """One response to score."""

    sample_id: Any  # shown in error messages, e.g. "step 12 prompt 3 response 1"
    prompt: Any
    response: str
    ground_truth: Any
    data_source: str = ""
    extra: dict = field(default_factory=dict)
    token_ids: Sequence[int] | None = None  # prompt + response tokens; needed by a reward model


@dataclass(frozen=True)
class ScoreError:
    sample_id: Any
    source: str
    kind: str  # exception, timeout, crash, memory, unpicklable, non_finite, out_of_range, not_a_number, missing_score_key
    message: str


@dataclass
class RewardResult:
    """Per-response rewards plus what to log. Lists are aligned with the input samples."""

    scores: list[float]  # weighted sum over sources
    valid: list[bool]  # False: a source failed and reward.on_error = "drop"
    source_scores: dict[str, list[float]]  # each source's unweighted score; NaN where it failed
    metrics: dict[str, list[float]]  # "<source>/<key>" extra numbers from dict returns; NaN where absent
    errors: list[ScoreError]
    stats: dict[str, float]  # batch summary for the tracker (means over valid responses, error counts)


def _mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _log_service_errors(errors: list[ScoreError]) -> None:
    """One line per distinct failure of a service or judge (a down service fails every sample the
    same way: one line naming its URL, not one per sample)."""
    groups: dict[tuple, list[ScoreError]] = {}
    for e in errors:
        groups.setdefault((e.source, e.kind, e.message), []).append(e)
    for (source, kind, message), group in list(groups.items())[:LOGGED_ERRORS_PER_BATCH]:
        log.warning("reward %s failed on %s: %s: %s", source,
                    f"sample {group[0].sample_id}" if len(group) == 1 else f"{len(group)} samples (first {group[0].sample_id})",
                    kind, message)
    if len(groups) > LOGGED_ERRORS_PER_BATCH:
        log.warning("... and %d more distinct reward service errors in this batch", len(groups) - LOGGED_ERRORS_PER_BATCH)


def _call(src: RewardSource, smp: RewardSample) -> Call:
    """The pool call scoring `smp` with rule source `src`, in the source's calling convention."""
    if src.convention == "verl":
        return Call(src.ref, (), verl_call_kwargs(src.verl_params, smp.response, smp.ground_truth, smp.data_source,
                                                 smp.extra, src.kwargs))
    return Call(src.ref, (smp.prompt, smp.response, smp.ground_truth, {**smp.extra, "data_source": smp.data_source}),
                src.kwargs)


class Rewarder:
    """Scores batches with a fixed set of sources; owns the worker pool (close it, or use `with`)."""

    def __init__(self, sources: Sequence[RewardSource], *, on_error: OnError = "zero", workers: int = 4,
                 timeout_s: float = 30.0, model_scorer: RewardModelScorer | None = None,
                 start_method: str = "spawn", memory_mb: int = 0, max_output_bytes: int | None = None,
                 env_allow: Sequence[str] = (), protect_dirs: Sequence[str] = (),
                 services: dict | None = None, services_budget: Any = None):
        self.sources = tuple(sources)
        self.on_error = on_error
        self.model_scorer = model_scorer
        self.services = dict(services or {})   # source name -> scorer, for remote and judge sources
        self._services_budget = services_budget   # responses -> seconds the services may take
        if any(s.kind == "model" for s in self.sources) and model_scorer is None:
            raise ValueError("a model reward source needs a RewardModelScorer")
        missing = [s.name for s in self.sources if s.kind in SERVICE_KINDS and s.name not in self.services]
        if missing:
            raise ValueError(f"reward sources {', '.join(missing)} need a scorer in `services`")
        for isolation in {s.kwargs["isolation"] for s in self.sources if "isolation" in (s.kwargs or {})}:
            from mrl.reward.code_sandbox import require

            require(isolation)   # untrusted programs run in a real sandbox, or the job does not start
        refs = [s.ref for s in self.sources if s.kind in ("function", "builtin")]
        self.pool = RewardPool(refs, workers=workers, timeout_s=timeout_s, start_method=start_method,
                               memory_mb=memory_mb, max_output_bytes=max_output_bytes, env_allow=tuple(env_allow),
                               protect_dirs=tuple(protect_dirs)) if refs else None
        self._replaced = self._truncated = 0
        self._renamed: set[str] = set()   # reward metrics renamed apart from mrl's own (said once each)
        self._metric_keys: dict[str, set[str]] = {}   # the extra metric keys logged, per source (MAX_METRIC_KEYS)
        self._cut_said: set[str] = set()

    def scoring_budget_s(self, responses: int) -> float:
        """The longest `score` of `responses` responses takes (every call up to its timeout)."""
        rule = sum(s.kind in ("function", "builtin") for s in self.sources)
        pool = self.pool.batch_budget_s(responses * rule) if self.pool is not None else 0.0
        return pool + (self._services_budget(responses) if self._services_budget is not None else 0.0)

    @classmethod
    def from_config(cls, cfg: RewardConfig, model_scorer: RewardModelScorer | None = None, *, device="cpu",
                    seed: int = 0, **kw) -> "Rewarder":
        """`device` and `seed`: where a local judge's engine runs and what it samples from."""
        sources = reward_sources(cfg)
        return cls(sources, on_error=cfg.on_error, workers=cfg.workers, timeout_s=cfg.timeout_s,
                   model_scorer=model_scorer, memory_mb=cfg.memory_mb, max_output_bytes=cfg.max_output_bytes,
                   env_allow=cfg.env_allow, services=service_scorers(cfg, sources, device=device, seed=seed),
                   services_budget=lambda n: services_budget_s(cfg, sources, n), **kw)

    def __enter__(self) -> "Rewarder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        for scorer in {id(s): s for s in self.services.values()}.values():   # a judge serves several sources once
            if hasattr(scorer, "close"):
                scorer.close()

    def _rule_outcomes(self, samples: Sequence[RewardSample]) -> dict[str, list]:
        rule = [s for s in self.sources if s.kind in ("function", "builtin")]
        calls = [_call(src, smp) for src in rule for smp in samples]
        outcomes = self.pool.run(calls) if calls else []
        n = len(samples)
        out = {src.name: outcomes[i * n:(i + 1) * n] for i, src in enumerate(rule)}
        for src in self.sources:
            if src.kind in SERVICE_KINDS:
                out[src.name] = list(self.services[src.name](samples)) if n else []
        return out

    def score(self, samples: Sequence[RewardSample]) -> RewardResult:
        """Score every sample with every source; see the module docstring for errors."""
        n = len(samples)
        before = (self.pool.replacements, self.pool.truncated_calls) if self.pool is not None else (0, 0)
        outcomes = self._rule_outcomes(samples)
        after = (self.pool.replacements, self.pool.truncated_calls) if self.pool is not None else (0, 0)
        self._replaced, self._truncated = after[0] - before[0], after[1] - before[1]
        source_scores: dict[str, list[float]] = {}
        metrics: dict[str, list[float]] = {}
        errors: list[ScoreError] = []
        cut: Counter = Counter()   # responses whose metrics passed MAX_METRIC_KEYS, per source
        for src in self.sources:
            scores = [math.nan] * n
            if src.kind == "model":
                if any(s.token_ids is None for s in samples):
                    raise ValueError("the reward model needs RewardSample.token_ids")
                for i, v in enumerate(self.model_scorer([s.token_ids for s in samples])):
                    try:
                        scores[i], _ = read_score(v)
                    except BadScore as e:
                        errors.append(ScoreError(samples[i].sample_id, src.name, e.kind, f"reward model {e}"))
            else:
                for i, out in enumerate(outcomes[src.name]):
                    if out.error is not None:
                        errors.append(ScoreError(samples[i].sample_id, src.name, out.error, out.message))
                        continue
                    try:
                        scores[i], extra = read_score(out.value, src.score_key)
                    except BadScore as e:
                        errors.append(ScoreError(samples[i].sample_id, src.name, e.kind, str(e)))
                        continue
                    if self._keep_metrics(src.name, extra, metrics, i, n):
                        cut[src.name] += 1
            source_scores[src.name] = scores
        result = self._combine(samples, source_scores, metrics, errors)
        for name, c in cut.items():
            result.stats[f"reward/{name}/metrics_cut_calls"] = float(c)
        return result

    def _keep_metrics(self, source: str, extra: dict[str, float], metrics: dict, i: int, n: int) -> bool:
        """Put response `i`'s extra numbers into `metrics`, within `MAX_METRIC_KEYS` distinct keys per
        source over the run (the first ones seen); True when some were left out (said once per source)."""
        kept = self._metric_keys.setdefault(source, set())
        left_out = []
        for k, v in extra.items():
            if k not in kept:
                if len(kept) >= MAX_METRIC_KEYS:
                    left_out.append(k)
                    continue
                kept.add(k)
            metrics.setdefault(f"{source}/{k}", [math.nan] * n)[i] = v
        if left_out and source not in self._cut_said:
            self._cut_said.add(source)
            log.warning("reward %s returned more than %d metric keys (e.g. %r); only the first %d are logged, the "
                        "responses with more are counted in reward/%s/metrics_cut_calls", source, MAX_METRIC_KEYS,
                        str(left_out[0])[:80], MAX_METRIC_KEYS, source)
        return bool(left_out)

    def _combine(self, samples, source_scores, metrics, errors) -> RewardResult:
        n = len(samples)
        services = {s.name for s in self.sources if s.kind in SERVICE_KINDS}
        _log_service_errors([e for e in errors if e.source in services])
        rule_errors = [e for e in errors if e.source not in services]
        for e in rule_errors[:LOGGED_ERRORS_PER_BATCH]:
            log.warning("reward %s failed on sample %s: %s: %s", e.source, e.sample_id, e.kind, e.message)
        if len(rule_errors) > LOGGED_ERRORS_PER_BATCH:
            log.warning("... and %d more reward errors in this batch", len(rule_errors) - LOGGED_ERRORS_PER_BATCH)
        if self._truncated:
            log.warning("%d reward calls printed more than reward.max_output_bytes = %d bytes; the rest was dropped",
                        self._truncated, self.pool.max_output_bytes)
        if errors and self.on_error == "fail":
            e = errors[0]
            raise UserError(f"reward {e.source} failed on sample {e.sample_id}: {e.kind}: {e.message} "
                            f"({len(errors)} errors in the batch; reward.on_error = 'fail')")
        failed = {i for i in range(n) for name in source_scores if math.isnan(source_scores[name][i])}
        weights = {s.name: s.weight for s in self.sources}
        totals = [sum(weights[name] * (0.0 if math.isnan(v[i]) else v[i]) for name, v in source_scores.items())
                  for i in range(n)]
        valid = [not (self.on_error == "drop" and i in failed) for i in range(n)]
        counts = Counter((e.source, e.kind) for e in errors)
        stats: dict[str, float] = {"reward/mean": _mean([t for t, ok in zip(totals, valid) if ok]),
                                   "reward/errors": float(len(errors)),
                                   "reward/failed_responses": float(len(failed)),
                                   "reward/dropped_responses": float(valid.count(False))}
        for name, values in source_scores.items():
            stats[f"reward/{name}/mean"] = _mean(values)
        for (name, kind), c in counts.items():
            stats[f"reward/{name}/errors/{kind}"] = float(c)
        for key, values in metrics.items():
            name = f"reward/{key}"
            if name in stats:   # a reward's own metric named like mrl's (`mean`, `errors/...`): kept apart
                name = f"reward/{key}_metric"
                if key not in self._renamed:
                    self._renamed.add(key)
                    log.warning("reward metric %r is named like mrl's %r; logged as %r", key, f"reward/{key}", name)
            stats[name] = _mean(values)
        stats["reward/workers_replaced"] = float(self._replaced)
        stats["reward/output_truncated_calls"] = float(self._truncated)
        return RewardResult(scores=totals, valid=valid, source_scores=source_scores, metrics=metrics,
                            errors=errors, stats=stats)
