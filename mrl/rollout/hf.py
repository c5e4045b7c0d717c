"""The `hf` rollout engine: batched sampling with a Hugging Face `transformers` model.

The embedded default on CPU. It runs its own decoding loop over the model's KV cache rather than
`model.generate`, so that the log-probability it reports is exactly the one defined in
`mrl.rollout.logprobs` and sampling is seeded per response (reproducible regardless of how
prompts are batched). Prompts are left-padded; positions count real tokens only, so a padded row
computes what it would alone. Weights arrive from the trainer's stream and are copied into the
existing parameters (no second copy of the model); block-FP8 weights (`rollout.quantization`) are
held as sent and the parameters get their dequantization (`mrl.rollout.hf_fp8`).

The n responses of a prompt share its prefill: each distinct prompt of a batch is run through
the model once and its KV cache (and last-position logits) copied to its n rows before decoding
(`share_prefill`; with 8 responses per prompt the prefill does an eighth of the work). Decoding
writes into KV buffers allocated once for the prompt width plus `max_tokens` (`static_cache`,
`mrl.rollout.hf_cache`) instead of concatenating every layer's cache at every token.
Vision-language models (Qwen2.5-VL) take each prompt's `ImageInputs` (`mrl.data.images`): the
prefill runs the tower on them, positions are the model's own 3-D mRoPE ids (`get_rope_index`,
left padding masked) and decoding continues from each row's largest id. Vision placeholder tokens
are never sampled (their logits are -inf in the sampled distribution): a sampled placeholder
would leave the next forward with more image tokens than image features (verl #3469, #7038).
`raw_logprobs` stay the model's own, over the whole vocabulary.

`stage_seconds`, when set to a dict, accumulates the wall time of each stage of `generate`
(`prefill`, `decode` forward calls, `sampling`, `logprobs`, `bookkeeping`) for benchmarks.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Optional, Sequence

import torch

from mrl.errors import UserError
from mrl.rollout.engine import RolloutEngine, WeightStream
from mrl.rollout.hf_cache import in_place_from_prefill
from mrl.rollout.logprobs import process_logits, reported_logprobs, sample_rows
from mrl.rollout.types import Response, Sampling, prompt_seed, resolve_prompt_seeds

from mrl.platform.device import DTYPES as _DTYPES


def eos_ids_of(model) -> tuple[int, ...]:
    """EOS ids from the model's generation config (or config), as a tuple."""
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()


class HFEngine(RolloutEngine):
    """Rollouts from a `transformers` causal LM held in this process."""

    def __init__(self, model: torch.nn.Module, *, seed: int = 0, eos_token_ids: Optional[Sequence[int]] = None,
                 max_num_seqs: int = 256, share_prefill: bool = True, fp8_matmul: str = "auto",
                 static_cache: bool = True, batched_sampler: bool = False, trainer_tensor_parallel: int = 1):
        """`trainer_tensor_parallel`: the trainer's `parallel.tensor`, whose row-parallel rounding a
        bf16 model on CPU follows (`hf_rounding`)."""
        self.model = model.eval()
        from mrl.rollout.hf_attention import float32_attention_on_cpu
        from mrl.rollout.hf_rounding import trainer_rounding_on_cpu

        float32_attention_on_cpu(model)   # bf16 on CPU: attention rounds as the trainer's (`hf_attention`)
        trainer_rounding_on_cpu(model, trainer_tensor_parallel)   # and norms, biases, row-parallel sums (`hf_rounding`)
        self.share_prefill = share_prefill
        self.static_cache = static_cache   # decode into KV buffers allocated once (`hf_cache`)
        # True: each row's exponential race on its own generator's uniforms, batched (`logprobs.sample_rows`:
        # torch.multinomial's algorithm without its per-row passes). Off by default: it draws other tokens
        # from the same seeds, and the slow tests' learning bounds and the jobs' documented rewards were
        # measured with multinomial's (with the race tests/lora's job misses its bound: mrl/rollout/README.md).
        # Its bf16 audit is multinomial's (the floor of bf16 decoding, which depends on the tokens drawn,
        # not on the sampler: `hf_rounding`'s docstring)
        self.batched_sampler = batched_sampler
        self.stage_seconds: Optional[dict[str, float]] = None   # a dict: per-stage wall time accumulates
        self.device = next(model.parameters()).device
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else eos_ids_of(model)
        self.max_num_seqs = max_num_seqs
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self._seeds = torch.Generator().manual_seed(seed)  # draws one seed per response
        self._set_targets()
        from mrl.rollout.hf_fp8 import Fp8Held, scaled_mm_default

        # block-FP8 weights of the stream (rollout.quantization = "fp8"), run as FP8 GEMMs or dequantized
        self._fp8 = Fp8Held(scaled_mm=fp8_matmul == "scaled_mm" or fp8_matmul == "auto" and scaled_mm_default(self.device))
        self._asleep = False
        self.vision = getattr(model.config, "vision_config", None) is not None
        # Qwen-VL: mRoPE ids from the model's get_rope_index; Gemma 3: plain ids, images marked by token_type_ids
        self.mrope = self.vision and hasattr(getattr(model, "model", None), "get_rope_index")
        from mrl.models.vlm import PLACEHOLDER_FIELDS

        banned = [getattr(model.config, n, None) for n in PLACEHOLDER_FIELDS] if self.vision else []
        self.banned = torch.tensor([b for b in banned if b is not None and b < self.vocab_size], dtype=torch.long,
                                   device=self.device)
        from mrl.rollout.hf_routes import RouteCapture

        self._capture = RouteCapture(self.model)   # MoE models: every response carries its routes

    @property
    def returns_routes(self) -> bool:
        """Whether responses carry `routes` (an MoE model: `mrl.rollout.hf_routes`)."""
        return bool(self._capture)

    def _set_targets(self) -> None:
        """Stream name -> tensor to copy into: the state dict (tied weights under both names) and,
        for MoE models, per-expert views into the fused expert tensors (`hf_experts`), with the
        parameter each view belongs to (what the completeness check counts)."""
        from mrl.rollout.hf_experts import checkpoint_name, fused_expert_views

        model_type = getattr(self.model.config, "model_type", "")
        self._targets = {checkpoint_name(k, model_type): v for k, v in self.model.state_dict(keep_vars=True).items()}
        views = fused_expert_views(self.model, model_type)
        self._targets.update({name: view for name, (view, _) in views.items()})
        self._owners = {name: owner for name, (_, owner) in views.items()}

    # --- construction --------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str = "float32", device: str | torch.device = "cpu",
                        trust_remote_code: bool = False, hf_config: Optional[dict[str, Any]] = None,
                        **kw) -> "HFEngine":
        """Load a local Hugging Face model directory; `hf_config` (a config dict) replaces its
        config.json (a Kimi-K2 directory is built as transformers' DeepSeek-V3). A config with a
        vision tower loads as transformers' image-text model."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        extra = {}
        if hf_config is not None:
            cfg = dict(hf_config)
            extra["config"] = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        auto = AutoModelForCausalLM
        if hf_config is None and getattr(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code),
                                         "vision_config", None):
            auto = AutoModelForImageTextToText
        model = auto.from_pretrained(path, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code, **extra)
        return cls(model.to(device), **kw)

    @classmethod
    def from_config(cls, hf_config: dict[str, Any], *, dtype: str = "float32", device: str | torch.device = "cpu",
                    **kw) -> "HFEngine":
        """Build the architecture from an HF config dict (e.g. a builtin preset); weights come from
        `update_weights` (until then they are transformers' random initialisation)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        from mrl.models.facts import canonical_config
        from mrl.models.vlm import hf_config_object, is_vlm

        if is_vlm(hf_config):
            model = AutoModelForImageTextToText.from_config(hf_config_object(hf_config), dtype=_DTYPES[dtype])
            return cls(model.to(device), **kw)
        cfg = canonical_config(dict(hf_config))   # kimi_k2 -> transformers' deepseek_v3
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[dtype])
        return cls(model.to(device), **kw)

    # --- generation ----------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Sampling,
                 prompt_seeds: Optional[Sequence[int]] = None, images: Optional[Sequence[Any]] = None) -> list[Response]:
        """`images[i]`: prompt i's `mrl.data.images.ImageInputs` or None (vision-language models)."""
        if self._asleep:
            raise RuntimeError("hf engine: generate() while asleep; call wake() first")
        self._fp8.flush(self._targets)   # sparse FP8 updates applied outside update_weights
        if images is not None and any(x is not None for x in images) and not self.vision:
            raise UserError("rollout: prompts carry images but the model has no vision tower")
        images = list(images) if images is not None else [None] * len(prompt_token_ids)
        per_prompt = resolve_prompt_seeds(sampling, len(prompt_token_ids), prompt_seeds)
        rows = [(i, j) for i in range(len(prompt_token_ids)) for j in range(sampling.n)]
        seeds = [self._row_seed(per_prompt[i], j) for i, j in rows]
        out: list[Response] = []
        for lo in range(0, len(rows), self.max_num_seqs):
            chunk = rows[lo:lo + self.max_num_seqs]
            out += self._generate_batch([list(prompt_token_ids[i]) for i, _ in chunk], [i for i, _ in chunk],
                                        seeds[lo:lo + self.max_num_seqs], sampling, [images[i] for i, _ in chunk])
        return out

    def _row_seed(self, seed: Optional[int], sample_index: int) -> int:
        if seed is not None:
            return prompt_seed(seed, sample_index)
        return int(torch.randint(0, 2**62, (1,), generator=self._seeds))

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], prompt_index: list[int], seeds: list[int],
                        sampling: Sampling, images: Optional[list] = None) -> list[Response]:
        dev, B = self.device, len(prompts)
        if any(len(p) == 0 for p in prompts):
            raise UserError("rollout: a prompt has no tokens")
        width = max(len(p) for p in prompts)
        ids = torch.zeros(B, width, dtype=torch.long, device=dev)
        mask = torch.zeros(B, width, dtype=torch.long, device=dev)
        for r, p in enumerate(prompts):  # left padding: the last column is every row's newest token
            ids[r, width - len(p):] = torch.tensor(p, device=dev)
            mask[r, width - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if self.mrope:   # [3, B, width]: the model's own mRoPE ids (text-only rows: the same id thrice)
            positions = self._mrope_positions(ids, mask, images or [None] * B)
        gens = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
        seen = None
        if sampling.repetition_penalty != 1.0:
            seen = torch.zeros(B, self.vocab_size, dtype=torch.bool, device=dev)
            seen.scatter_(1, ids, mask.bool())
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids))
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)

        routes = self._capture.__enter__() if self._capture else None
        try:
            return self._decode(ids, mask, positions, prompts, prompt_index, gens, seen, stop, sampling, routes,
                                images or [None] * B)
        finally:
            if routes is not None:
                routes.__exit__(None, None, None)

    @contextmanager
    def _stage(self, name: str):
        """Accumulate the wall time of a stage into `stage_seconds` (when it is a dict)."""
        if self.stage_seconds is None:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + time.perf_counter() - t0

    def _mrope_positions(self, ids, mask, images):
        grids = [x.image_grid_thw for x in images if x is not None]
        types = (ids == self.model.config.image_token_id).to(torch.int32)
        pos, _ = self.model.model.get_rope_index(ids, types, image_grid_thw=torch.cat(grids).to(ids.device)
                                                 if grids else None, attention_mask=mask)
        return pos

    def _vision_kwargs(self, images, rows, ids) -> dict:
        """The model's image inputs for batch rows `rows` (their ids `ids`), in row order (none when
        no row has images). Gemma 3 takes its images' `token_type_ids` (each image's tokens attend
        to each other both ways) in the prefill only, as its `generate` does."""
        chosen = [images[r] for r in rows if images[r] is not None]
        if not chosen:
            return {}
        if not self.mrope:
            dtype = next(self.model.model.vision_tower.parameters()).dtype
            return dict(pixel_values=torch.cat([x.pixel_values for x in chosen]).to(self.device, dtype),
                        token_type_ids=(ids == self.model.config.image_token_id).long())
        dtype = next(self.model.model.visual.parameters()).dtype
        return dict(pixel_values=torch.cat([x.pixel_values for x in chosen]).to(self.device, dtype),
                    image_grid_thw=torch.cat([x.image_grid_thw for x in chosen]).to(self.device))

    def _position_arg(self, pos):
        """`pos` [B, S] (or [3, B, S] already) as the model takes it."""
        return pos.unsqueeze(0).expand(3, -1, -1) if self.mrope and pos.dim() == 2 else pos

    def _prefill(self, ids, mask, positions, prompt_index, routes, images, max_tokens):
        """The prompts' forward pass: (last-position logits [B, 1, V], KV cache, prefill routes or
        None). With `share_prefill`, each distinct prompt runs once and its cache rows are copied to
        the rows that share it (a row's numbers are those of its prompt alone either way: left
        padding to the same width, positions counting real tokens only)."""
        B, width = ids.shape
        first: dict[int, int] = {}
        inverse = [first.setdefault(i, len(first)) for i in prompt_index]
        if not self.share_prefill or len(first) == B:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             logits_to_keep=1, **self._vision_kwargs(images, range(B), ids))
            return out.logits, self._decoding_cache(out.past_key_values, None, width + max_tokens), \
                (routes.take(B, width) if routes is not None else None)
        rows = torch.tensor([inverse.index(u) for u in range(len(first))], device=ids.device)
        expand = torch.tensor(inverse, device=ids.device)
        out = self.model(input_ids=ids[rows], attention_mask=mask[rows], position_ids=positions[..., rows, :],
                         use_cache=True, logits_to_keep=1, **self._vision_kwargs(images, rows.tolist(), ids[rows]))
        cache = self._decoding_cache(out.past_key_values, expand, width + max_tokens)   # row r: its prompt's cache
        taken = routes.take(len(first), width) if routes is not None else None
        return out.logits[expand], cache, (taken[expand.to(taken.device)] if taken is not None else None)

    def _decoding_cache(self, cache, rows: Optional[torch.Tensor], max_len: int):
        """The prefill's cache, batch rows `rows` (None: all), as decoding uses it: in buffers of
        `max_len` positions allocated once (`hf_cache.in_place_from_prefill`) when `static_cache`
        and the model's layers allow, else the dynamic cache (its rows selected in place)."""
        if self.static_cache:
            moved = in_place_from_prefill(cache, rows, max_len)
            if moved is not None:
                return moved
        if rows is not None:
            cache.reorder_cache(rows)   # index_select on the batch dimension
        return cache

    def _decode(self, ids, mask, positions, prompts, prompt_index, gens, seen, stop, sampling, routes, images):
        """The decoding loop of `_generate_batch`; with `routes` (a `RouteCapture`) each response
        gets the experts of its prompt tokens (prefill) and of each response token (the call that
        fed it; one extra call feeds the last sampled tokens)."""
        dev, B, width = self.device, ids.shape[0], ids.shape[1]
        tokens = torch.zeros(B, sampling.max_tokens, dtype=torch.long, device=dev)
        logps = torch.zeros(B, sampling.max_tokens, dtype=torch.float32, device=dev)
        lengths = torch.zeros(B, dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        stopped = torch.zeros(B, dtype=torch.bool, device=dev)

        with self._stage("prefill"):
            last_logits, cache, prefill_routes = self._prefill(ids, mask, positions, prompt_index, routes, images,
                                                               sampling.max_tokens)
        fed = [prefill_routes] if routes is not None else []   # [B, tokens, L, k] per call
        # the next id: one past the row's largest (mRoPE: an image's ids do not count its tokens)
        next_pos = positions.amax(dim=(0, 2)) + 1 if positions.dim() == 3 else positions[:, -1] + 1
        for t in range(sampling.max_tokens):
            with self._stage("sampling"):
                logits = last_logits[:, -1, :self.vocab_size]
                z = process_logits(logits, sampling, seen)
                if len(self.banned):   # vision placeholders are never sampled
                    z = z.index_fill(-1, self.banned, float("-inf"))
                logp_all = torch.log_softmax(z, dim=-1)
                if sampling.greedy:
                    tok = z.argmax(dim=-1)
                else:
                    probs = logp_all.exp()
                    tok = sample_rows(probs, gens) if self.batched_sampler else torch.cat(
                        [torch.multinomial(probs[r], 1, generator=gens[r]) for r in range(B)])
            with self._stage("logprobs"):
                if sampling.logprobs_mode == "raw_logprobs":
                    lp = reported_logprobs(logits, tok, sampling, seen)
                else:
                    lp = logp_all.gather(-1, tok[:, None]).squeeze(-1)
            with self._stage("bookkeeping"):
                stop_now = self._record(t, tok, lp, tokens, logps, lengths, done, stopped, stop, sampling)
            if stop_now:
                break
            if seen is not None:
                seen[torch.arange(B, device=dev), tok] = True
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=dev)], dim=1)
            with self._stage("decode"):
                out = self.model(input_ids=tok[:, None], attention_mask=mask,
                                 position_ids=self._position_arg(next_pos[:, None]), past_key_values=cache, use_cache=True)
            if routes is not None:
                fed.append(routes.take(B, 1))
            last_logits, cache, next_pos = out.logits, out.past_key_values, next_pos + 1
        if routes is not None:   # the last sampled tokens, fed once for their routes alone
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=dev)], dim=1)
            self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=self._position_arg(next_pos[:, None]),
                       past_key_values=cache, use_cache=True, logits_to_keep=1)
            fed.append(routes.take(B, 1))
        decoded = torch.cat(fed[1:], dim=1) if routes is not None else None   # [B, calls, L, k]

        responses = []
        for r in range(B):
            n = int(lengths[r])
            responses.append(Response(prompt_index=prompt_index[r], token_ids=tokens[r, :n].tolist(),
                                      logprobs=logps[r, :n].tolist(),
                                      finish_reason="stop" if bool(stopped[r]) else "length",
                                      routes=None if routes is None else
                                      torch.cat([fed[0][r, width - len(prompts[r]):], decoded[r, :n]])))
        return responses

    @staticmethod
    def _record(t, tok, lp, tokens, logps, lengths, done, stopped, stop, sampling) -> bool:
        """Store step `t`'s tokens and log-probs for the rows still live; True when decoding ends."""
        live = ~done
        tokens[:, t] = torch.where(live, tok, tokens[:, t])
        logps[:, t] = torch.where(live, lp, logps[:, t])
        lengths += live.long()
        hit = live & torch.isin(tok, stop)
        stopped |= hit
        done |= hit
        return bool(done.all()) or t + 1 == sampling.max_tokens

    @torch.no_grad()
    def sequence_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        self._fp8.flush(self._targets)
        out = []
        for seq in token_ids:   # one row at a time: no padding in the numbers
            ids = torch.tensor([list(seq)], device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1, :self.vocab_size].float()
            if len(self.banned):   # the trainer's VLM policy: placeholders at -1e9 (`VisionLanguageGPT`)
                logits = logits.index_fill(-1, self.banned, -1e9)
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist())
        return out

    # --- weights and memory --------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, weights: WeightStream, *, partial: bool = False) -> int:
        loaded, filled = 0, set()
        for name, tensor in weights:
            if self._fp8.claims(name, tensor):   # a block-FP8 weight or its scales: held, dequantized below
                weight = self._fp8.put(name, tensor, self.device)
                if weight not in self._targets:
                    raise KeyError(f"hf engine: the weight stream names {name!r}, which the model does not have")
                filled.add(id(self._owners.get(weight, self._targets[weight])))
                loaded += 1
                continue
            target = self._targets.get(name)
            if target is None:
                raise KeyError(f"hf engine: the weight stream names {name!r}, which the model does not have")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"hf engine: {name} has shape {tuple(tensor.shape)} in the stream, "
                                 f"{tuple(target.shape)} in the model")
            target.data.copy_(tensor)  # casts dtype and moves device in place
            filled.add(id(self._owners.get(name, target)))
            loaded += 1
        self._fp8.flush(self._targets)
        self._fp8.route(self.model)
        missing = [n for n, p in self.model.named_parameters() if id(p) not in filled]  # tied: one name
        if missing and not partial:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            raise RuntimeError(f"hf engine: the weight sync ({loaded} tensors) loaded nothing into {len(missing)} "
                               f"parameter(s): {shown}")
        return loaded

    accepts_sparse = True

    @torch.no_grad()
    def apply_sparse(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> None:
        if self._fp8.claims(name):   # dequantized when the sync's update_weights ends (or before generating)
            self._fp8.put_sparse(name, indices, values)
            return
        target = self._targets.get(name)
        if target is None:
            raise KeyError(f"hf engine: the weight stream names {name!r}, which the model does not have")
        flat = target.data.view(-1)
        flat[indices.to(flat.device, torch.int64)] = values.to(flat.device, flat.dtype)  # casts as copy_ does

    def held_weights(self, names):
        for name in names:
            if self._fp8.claims(name):   # the FP8 bytes and scales as received (the matmul reads their dequantization)
                yield name, self._fp8.tensors[name]
            elif name in self._targets:
                yield name, self._targets[name].data

    def sleep(self, level: Optional[int] = None) -> None:
        """On a GPU, moves the weights to host memory (levels 1 and 2 alike: rotary and other
        buffers are not part of the weight stream, so they are kept). On CPU nothing is freed."""
        if self.device.type != "cpu" and (level is None or level > 0):
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = True

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        if self.device.type != "cpu" and (tags is None or "weights" in tags):
            self.model.to(self.device)
            self._set_targets()  # buffers are new tensors after .to()
        if tags is None or "kv_cache" in tags:
            self._asleep = False

    def shutdown(self) -> None:
        self._targets = {}
        self.model = None
