"""`merge`: one Megatron distributed checkpoint -> one Hugging Face model directory.

The steps: describe the checkpoint (`source.inspect`: one-line errors for anything missing),
rebuild its model in this process and load the weights at TP = PP = EP = 1 (`model.load_model`),
stream the HF-named tensors through the weight-mapping tables (`mrl.weights.Exporter`) into
size-bounded shard files as they come (`writer.ShardWriter`), add config, tokenizer and
generation config (`assets`), verify against `transformers` (`verify`), and only then move the
directory into place: a failed merge leaves `<out>.partial`, never a half-written `<out>`.
`format="peft"` writes a LoRA checkpoint's adapters as a PEFT adapter directory instead (`peft`).

Peak memory is the model once (float32 when verifying, else the stored dtype) plus one shard;
verification adds the reloaded `transformers` model.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import shutil
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

from mrl.errors import UserError
from mrl.merge import assets
from mrl.merge.source import CheckpointInfo, inspect
from mrl.merge.verify import VALUE_HEAD_FILE, VALUE_HEAD_NAME, DEFAULT_TOLERANCE, Verification, verify as run_verify
from mrl.merge.writer import ShardWriter, parse_size, save_tensors
from mrl.weights.stacked import stack_experts

log = logging.getLogger(__name__)

from mrl.platform.device import DTYPES
# Verification is on by default below this many parameters (it holds a second, float32 model).
VERIFY_DEFAULT_MAX_PARAMS = 2_000_000_000


@dataclasses.dataclass(frozen=True)
class MergeReport:
    out: Path
    checkpoint: Path
    step: int
    role: str
    dtype: torch.dtype
    shards: int
    tensors: int
    bytes: int
    value_head: bool
    tokenizer_files: tuple[str, ...]
    generation_config: bool
    verification: Optional[Verification]
    seconds: float
    peft_base: Optional[str] = None   # `--format peft`: the base model the adapter directory names

    def summary(self) -> str:
        size = f"{self.bytes / 1e6:.1f} MB {str(self.dtype).removeprefix('torch.')}"
        parts = [f"merged {self.checkpoint} (step {self.step}, {self.role}) -> {self.out}:"]
        if self.peft_base is not None:
            parts.append(f"PEFT adapter, {self.tensors} tensors, {size}, base {self.peft_base}")
        else:
            parts.append(f"{self.tensors} tensors, {size} in {self.shards} shard(s)")
        if self.value_head:
            parts.append(f"+ {VALUE_HEAD_FILE}")
        if self.peft_base is None:
            parts.append(f"; tokenizer: {len(self.tokenizer_files)} file(s)" if self.tokenizer_files else "; no tokenizer")
        v = self.verification
        parts.append(f"; verified {v.what}: max abs diff {v.max_abs_diff:.2e} (tolerance {v.tolerance:g} x "
                     f"{max(1.0, v.scale):.3g})" if v else "; not verified")
        parts.append(f"; {self.seconds:.1f}s")
        return " ".join(parts)


def _check_out(out: Path) -> None:
    from mrl.checkpoint.store import root_containing

    root = root_containing(out)
    if root is not None:
        raise UserError(f"merge: output {out} is inside the checkpoint root {root} (checkpoint retention would delete "
                        "it, or it would take a checkpoint's place); write the merged model outside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"merge: output {out} already exists and is not empty")


def _prepare_out(out: Path) -> Path:
    """The staging directory `<out>.partial`, fresh (a failed earlier merge's is replaced)."""
    _check_out(out)
    staging = out.with_name(out.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def _hf_dtypes(exporter, stored: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """HF tensor name -> the stored dtype of the Megatron parameter it comes from."""
    out = {}
    for p in exporter.placements:
        dtype = stored.get(p.name.split("/", 1)[1])
        if dtype is not None:
            out.update({n: dtype for n in p.hf_names})
    return out


def _split_value_head(stream, held: dict, dtypes: dict[str, torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream, each tensor in its `dtypes` entry, without the value head (set aside in `held`)."""
    for name, t in stream:
        if name in dtypes and t.dtype != dtypes[name]:
            t = t.to(dtypes[name])
        if name == VALUE_HEAD_NAME:
            held[name] = t
        else:
            yield name, t


FORMATS = ("hf", "peft")


def merge(checkpoint: str | Path, out: str | Path, *, max_shard_size: str | int = "2GB",
          dtype: Optional[str] = None, verify: Optional[bool] = None, model: Optional[str] = None,
          tolerance: float = DEFAULT_TOLERANCE, format: str = "hf") -> MergeReport:
    """Convert `checkpoint` (a checkpoint root or step directory) into the HF directory `out`.

    `dtype` defaults to the checkpoint's stored dtype; `verify` defaults to on below
    2B parameters; `model` supplies the architecture for checkpoints that do not record it.
    `format="peft"` (LoRA checkpoints only) writes the adapters as a PEFT adapter directory
    over the job's base model instead of merging them into full weights.
    """
    from mrl.merge.model import load_model, single_process_platform, stored_dtypes
    from mrl.weights import Exporter, hf_buckets

    start = time.perf_counter()
    out = Path(out)
    shard_bytes = parse_size(max_shard_size)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if format not in FORMATS:
        raise UserError(f"--format: {format!r} is not one of {', '.join(FORMATS)}")
    _check_out(out)
    info = inspect(checkpoint, model=model)
    if format == "peft":
        return _merge_peft(info, out, dtype=dtype, verify=verify, tolerance=tolerance, start=start)
    out_dtype = DTYPES[dtype] if dtype else None   # None: each tensor as stored
    config_dtype = out_dtype or info.stored_dtype
    do_verify = info.num_params < VERIFY_DEFAULT_MAX_PARAMS if verify is None else verify
    staging = _prepare_out(out)
    log.info("merging %s (%s, step %d, saved at %s) into %s", info.path, info.role, info.step, info.layout, out)

    with single_process_platform(seed=info.seed):
        megatron = load_model(info, torch.float32 if do_verify else info.stored_dtype)
        writer = ShardWriter(staging)
        held: dict[str, torch.Tensor] = {}
        n_head = 0
        exporter = Exporter([megatron], info.hf_config, dtype=out_dtype)
        # without --dtype every tensor keeps its stored dtype (a lossless merge), even when the
        # model was loaded in float32 for verification
        keep = {} if dtype else _hf_dtypes(exporter, stored_dtypes(megatron, info))
        # gpt-oss' per-expert rows stacked into its checkpoint's tensors (weights.stacked)
        stream = stack_experts(_split_value_head(exporter.stream(targets=0), held, keep), info.hf_config)
        for bucket in hf_buckets(stream, shard_bytes):
            writer.write(bucket)
            del bucket
        index = writer.finish()
        if info.valued:
            if VALUE_HEAD_NAME not in held:
                raise RuntimeError(f"merge: the {info.role} model exported no {VALUE_HEAD_NAME}")
            save_tensors(held.items(), staging / VALUE_HEAD_FILE)
        n_head = len(held)
        held.clear()
        special = assets.builtin_special_ids() if _is_builtin(info) else None
        assets.write_config(staging, info.hf_config, dtype=config_dtype, valued=info.valued, special_ids=special)
        tokenizer_files = assets.write_tokenizer(staging, info.tokenizer or info.model_path)
        if not tokenizer_files:
            log.warning("merge: no tokenizer found at %r; the output has no tokenizer files",
                        info.tokenizer or info.model_path)
        generation = assets.write_generation_config(staging, info.model_path, special)
        processor = assets.write_processor(staging, info.model_path, info.hf_config)
        if not processor and info.hf_config.get("vision_config") is not None:
            log.warning("merge: no processor files found at %r; the output has no preprocessor_config.json",
                        info.model_path)
        verification = None
        if do_verify:
            verification = run_verify(staging, megatron, info, dtype=out_dtype, tolerance=tolerance)
            _require(verification, f"{verification.what} of {staging}", staging)
        del megatron
    _publish(staging, out)
    return MergeReport(out=out, checkpoint=info.path, step=info.step, role=info.role, dtype=config_dtype,
                       shards=len(writer.shards), tensors=len(index["weight_map"]) + n_head,
                       bytes=index["metadata"]["total_size"], value_head=info.valued,
                       tokenizer_files=tuple(tokenizer_files), generation_config=generation,
                       verification=verification, seconds=time.perf_counter() - start)


def _require(verification, subject: str, staging: Path) -> None:
    """A failed verification is a one-line `UserError` naming what differs; the output stays in
    `staging` for inspection."""
    if not verification.ok:
        raise UserError(f"merge: verification failed: {subject} differ from the checkpoint's by "
                        f"{verification.max_abs_diff:.3e} (> {verification.tolerance:g} x "
                        f"{max(1.0, verification.scale):.3g}); the output was left in {staging}")


def _publish(staging: Path, out: Path) -> None:
    """Move the finished output into place (`out` is absent or empty, checked up front)."""
    if out.exists():
        out.rmdir()
    staging.rename(out)


def _is_builtin(info: CheckpointInfo) -> bool:
    from mrl.models.facts import builtin_preset

    return info.model_path is not None and builtin_preset(info.model_path) is not None


def _merge_peft(info: CheckpointInfo, out: Path, *, dtype: Optional[str], verify: Optional[bool],
                tolerance: float, start: float) -> MergeReport:
    """`merge(..., format="peft")`: the adapters of a LoRA checkpoint as a PEFT adapter directory;
    verified (default on below 2B base parameters) by loading it with `peft` over the base model
    and comparing logits with the adapted Megatron model's."""
    from mrl.merge.model import load_model, single_process_platform, stored_dtypes
    from mrl.merge.peft import ADAPTER_WEIGHTS, peft_base, peft_logits, write_adapter
    from mrl.merge.verify import probe_tokens

    if not info.lora:
        raise UserError(f"merge --format peft: checkpoint {info.path} was not trained with LoRA adapters "
                        "(rank 0: full weights); merge it with --format hf")
    if info.valued:
        raise UserError(f"merge --format peft: checkpoint {info.path} is a {info.role} (a value head); "
                        "PEFT adapter directories are written for language models only")
    base = peft_base(info.model_path)
    out_dtype = DTYPES[dtype] if dtype else None
    do_verify = info.num_params < VERIFY_DEFAULT_MAX_PARAMS if verify is None else verify
    if do_verify and verify is None and importlib.util.find_spec("peft") is None:
        log.warning("merge: the peft package is not installed; the adapter directory is not verified")
        do_verify = False
    staging = _prepare_out(out)
    with single_process_platform(seed=info.seed):
        megatron = load_model(info, torch.float32 if do_verify else info.stored_dtype)
        n = write_adapter([megatron], info.hf_config, info.lora, staging, base=base, dtype=out_dtype,
                          stored=None if dtype else stored_dtypes(megatron, info))
        verification = None
        if do_verify:
            from mrl.merge.model import forward
            from mrl.merge.verify import Verification

            if out_dtype is not None and out_dtype != torch.float32:   # the adapters as written
                with torch.no_grad():
                    for name, p in megatron.named_parameters():
                        if ".lora." in name:
                            p.copy_(p.to(out_dtype))
            vocab = info.hf_config["vocab_size"]
            tokens = probe_tokens(vocab)
            want = forward(megatron, tokens).float()[..., :vocab]
            got = peft_logits(staging, base, tokens)
            verification = Verification(what="logits",
                                        max_abs_diff=(got.double() - want.double()).abs().max().item(),
                                        scale=want.abs().max().item(), tolerance=tolerance, tokens=tokens.numel())
            _require(verification, f"the logits of {base} with the adapter {staging}", staging)
        del megatron
    _publish(staging, out)
    nbytes = (out / ADAPTER_WEIGHTS).stat().st_size
    return MergeReport(out=out, checkpoint=info.path, step=info.step, role=info.role,
                       dtype=out_dtype or info.stored_dtype, shards=1, tensors=n, bytes=nbytes, value_head=False,
                       tokenizer_files=(), generation_config=False, verification=verification,
                       seconds=time.perf_counter() - start, peft_base=base)
