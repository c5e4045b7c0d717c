"""`merge`: one Megatron distributed checkpoint -> one Hugging Face model directory.

The steps: describe the checkpoint (`source.inspect`: one-line errors for anything missing),
rebuild its model in this process and load the weights at TP = PP = EP = 1 (`model.load_model`),
stream the HF-named tensors through the weight-mapping tables (`mrl.weights.Exporter`) into
size-bounded shard files as they come (`writer.ShardWriter`), add config, tokenizer and
generation config (`assets`), verify against `transformers` (`verify`), and only then move the
directory into place: a failed merge leaves `<out>.partial`, never a half-written `<out>`.

Peak memory is the model once (float32 when verifying, else the stored dtype) plus one shard;
verification adds the reloaded `transformers` model.
"""
from __future__ import annotations

import dataclasses
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

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
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

    def summary(self) -> str:
        parts = [f"merged {self.checkpoint} (step {self.step}, {self.role}) -> {self.out}:",
                 f"{self.tensors} tensors, {self.bytes / 1e6:.1f} MB {str(self.dtype).removeprefix('torch.')}"
                 f" in {self.shards} shard(s)"]
        if self.value_head:
            parts.append(f"+ {VALUE_HEAD_FILE}")
        parts.append(f"; tokenizer: {len(self.tokenizer_files)} file(s)" if self.tokenizer_files else "; no tokenizer")
        v = self.verification
        parts.append(f"; verified {v.what}: max abs diff {v.max_abs_diff:.2e} (tolerance {v.tolerance:g} x "
                     f"{max(1.0, v.scale):.3g})" if v else "; not verified")
        parts.append(f"; {self.seconds:.1f}s")
        return " ".join(parts)


def _check_out(out: Path) -> None:
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


def merge(checkpoint: str | Path, out: str | Path, *, max_shard_size: str | int = "2GB",
          dtype: Optional[str] = None, verify: Optional[bool] = None, model: Optional[str] = None,
          tolerance: float = DEFAULT_TOLERANCE) -> MergeReport:
    """Convert `checkpoint` (a checkpoint root or step directory) into the HF directory `out`.

    `dtype` defaults to the checkpoint's stored dtype; `verify` defaults to on below
    2B parameters; `model` supplies the architecture for checkpoints that do not record it.
    """
    from mrl.merge.model import load_model, single_process_platform, stored_dtypes
    from mrl.weights import Exporter, hf_buckets

    start = time.perf_counter()
    out = Path(out)
    shard_bytes = parse_size(max_shard_size)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    _check_out(out)
    info = inspect(checkpoint, model=model)
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
        for bucket in hf_buckets(_split_value_head(exporter.stream(targets=0), held, keep), shard_bytes):
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
        verification = None
        if do_verify:
            verification = run_verify(staging, megatron, info, dtype=out_dtype, tolerance=tolerance)
            if not verification.ok:
                raise UserError(f"merge: verification failed: {verification.what} of {staging} differ from the "
                                f"checkpoint's by {verification.max_abs_diff:.3e} (> {tolerance:g} x "
                                f"{max(1.0, verification.scale):.3g}); the output was left in {staging}")
        del megatron
    if out.exists():
        out.rmdir()  # empty (checked above)
    staging.rename(out)
    return MergeReport(out=out, checkpoint=info.path, step=info.step, role=info.role, dtype=config_dtype,
                       shards=len(writer.shards), tensors=len(index["weight_map"]) + n_head,
                       bytes=index["metadata"]["total_size"], value_head=info.valued,
                       tokenizer_files=tuple(tokenizer_files), generation_config=generation,
                       verification=verification, seconds=time.perf_counter() - start)


def _is_builtin(info: CheckpointInfo) -> bool:
    from mrl.models.facts import builtin_preset

    return info.model_path is not None and builtin_preset(info.model_path) is not None
