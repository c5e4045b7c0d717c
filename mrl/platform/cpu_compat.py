"""CPU compatibility layer for megatron-core 0.16.1 (the cpu development platform only).

megatron-core runs on CPU with gloo process groups except for a set of hard-coded CUDA calls.
`activate()` patches exactly those call sites so that forward/backward (TP/PP/CP), DDP with the
distributed optimizer, MoE with the alltoall dispatcher (EP) and dist_checkpointing run on CPU.
It is called by `mrl.platform.setup` when `platform.device == 'cpu'`, never on cuda; it is
idempotent, and `deactivate()` undoes every patch (tests use it).

Mechanisms, narrowest first (the view and the mode are built in `cpu_torch.py`, the CPU RNG
tracker in `cpu_rng.py`; this module says where each applies and installs them):

* **view** (torch view) - the module-global name `torch` of a listed megatron module is replaced by a
  view of the real torch module that differs in two ways only: `torch.cuda` answers
  `current_device()` with the cpu device and provides no-op streams/events/synchronize, and
  factory functions (`torch.zeros(..., device="cuda")` and friends) build on cpu. Code outside the
  listed modules, including torch itself, sees the real torch.
* **mode** (tensor-method mode) - a `TorchFunctionMode` active only while a listed megatron function
  runs. It handles what the view cannot, tensor *methods*: `t.cuda()` stays on cpu, `t.type()`
  reports `torch.cuda.FloatTensor` (megatron asserts it), `t.to("cuda")` and `device=` kwargs
  map to cpu.
* **replacement** - a single function or attribute swapped for a CPU-capable one.

| # | megatron-core 0.16.1 call site | problem on CPU | patch | checked by |
| --- | --- | --- | --- | --- |
| 1 | `models/common/embeddings/rotary_pos_embedding.py` `RotaryEmbedding.get_emb` | `torch.cuda.current_device()` | view | all model tests |
| 2 | `utils.py` `GlobalMemoryBuffer.get_tensor` (TP all-gather buffer) | `device=torch.cuda.current_device()` | view | TP |
| 3 | `transformer/utils.py` `get_default_causal_mask` (used when no mask is passed) | `torch.ones(..., device="cuda")` | view | fast: forward with mask=None |
| 4 | `tensor_parallel/mappings.py` (gather/all-to-all outputs) | `device=torch.cuda.current_device()` | view | TP, EP |
| 5 | `tensor_parallel/layers.py` (weight allocation when `use_cpu_initialization=False`) | `device=torch.cuda.current_device()` | view | fast: device-init build |
| 6 | `tensor_parallel/utils.py` `split_tensor_into_1d_equal_chunks` / `gather_split_1d_tensor` (recompute with `distribute_saved_activations`) | `device=torch.cuda.current_device()` | view | TP recompute |
| 7 | `tensor_parallel/data.py` `broadcast_data` | `device='cuda'`, `current_device()`; `data[key].cuda()` | view + mode | TP |
| 8 | `tensor_parallel/random.py` `model_parallel_cuda_manual_seed` (also re-exported by `tensor_parallel`) | CUDA generator | replacement: `CpuRNGStatesTracker` on the CPU generator, same seed layout (dp seed; tp seed = seed + 2718 + tp_rank; expert seed = seed + 1024 + 100 * ep_rank + etp_rank) | fast, TP recompute |
| 9 | `tensor_parallel/random.py` `_get_cuda_rng_state` / `_set_cuda_rng_state` (activation recompute, RNG state save) | CUDA generator | replacement: CPU generator state | TP recompute with dropout |
| 10 | `pipeline_parallel/schedules.py` (`total_num_tokens`) | `device="cuda"` | view | PP |
| 11 | `pipeline_parallel/p2p_communication.py` (shape exchange, receive buffers) | `current_device()`, `torch.cuda.synchronize()` | view | PP |
| 12 | `models/common/language_module/language_module.py` `setup_embeddings_and_output_layer` (tied embeddings, PP > 1) | `weight.data.cuda()` | mode | PP tied embedding |
| 13 | `distributed/param_and_grad_buffer.py` (DDP grad/param buffers, bucket streams) | `current_device()`, `device="cuda"`, `torch.cuda.stream` | view | optimizer |
| 14 | `optimizer/optimizer.py` (`FP32Optimizer._scale`, mixed-precision `found_inf`/`_scale_one`, `ChainedOptimizer.get_loss_scale`) | `device='cuda'` | view | optimizer (plain), fast bf16 |
| 15 | `optimizer/optimizer.py` `Float16OptimizerWithFloat16Params.__init__` | `param.type()` must be `torch.cuda.*Tensor`, else `TypeError` | mode | fast bf16 |
| 16 | `optimizer/distrib_optimizer.py` `DistributedOptimizer.__init__` (and `_build_model_and_main_param_groups`) | same `param.type()` checks | mode | optimizer |
| 17 | `optimizer/clip_grads.py` `get_grad_norm_fp32`, `count_zeros_fp32` | `device='cuda'` | view | optimizer |
| 18 | `optimizer/clip_grads.py` `clip_grad_by_total_norm_fp32` (also bound in `optimizer/optimizer.py`) | `assert grad.type() == 'torch.cuda.FloatTensor'` | mode | optimizer |
| 19 | `transformer/moe/moe_utils.py` `RouterGatingLinearFunction` | `te_general_gemm` undefined without Transformer Engine (NameError; a 0.16.1 bug that hits cuda without TE too) | replacement: `None` (also `apply_megatron_fixes()`) | EP |
| 20 | `transformer/moe/router.py` (router weights, aux-loss buffers) | `current_device()` | view | EP |
| 21 | `transformer/moe/token_dispatcher.py` `MoEAlltoAllTokenDispatcher` | `torch.cuda.Stream`/`Event` for the split-size device-to-host copy | view | EP |
| 22 | `transformer/moe/token_dispatcher.py` `maybe_move_tensor_to_cpu` (imported from `moe_utils`) | skips cpu tensors, so split sizes stay tensors where `all_to_all_single` needs host lists | replacement: cpu tensors become numpy arrays, as on cuda | EP |
| 23 | `dist_checkpointing/strategies/state_dict_saver.py`, `strategies/filesystem_async.py` | `device='cuda'`, `current_device()`, `torch.cuda.synchronize()` | view | checkpoint |
| 24 | `dist_checkpointing/strategies/fully_parallel.py` | `torch.cuda.synchronize()`, `current_device()` | view | checkpoint |
| 25 | `dist_checkpointing/exchange_utils.py` `exchange_loaded_tensors_broadcast` (fully-parallel load) | `.cuda()` | mode | checkpoint |
| 26 | `transformer/multi_latent_attention.py` `MultiLatentAttention.__init__` | `HAVE_TE` is True without Transformer Engine (megatron's TE extension imports with placeholder classes), then `isinstance(linear_proj, TELinear)` on a placeholder is a TypeError (a 0.16.1 bug that hits cuda without TE too) | replacement: `HAVE_TE = False` when `transformer_engine` does not import (also `apply_megatron_fixes()`) | deepseek_v3 weights tests |
| 27 | `models/common/embeddings/yarn_rotary_pos_embedding.py` `YarnRotaryEmbedding` (MLA with yarn RoPE, DeepSeek-V3's) | `torch.cuda.current_device()` | view | deepseek_v3 yarn weights test |

Every row is necessary: removing any one patch makes the test named in the last column fail
(checked by ablation when the layer was written).

Not covered (CUDA-only or not used by mrl on cpu; they fail with megatron's own CUDA error):
megatron inference (KV-cache allocation in `transformer/attention.py`, static batching in
`gpt_model.py`), CUDA graphs (`transformer/module.py`, `transformer_layer.py`), the
`off-by-one`/`learnable` softmax variants (`dot_product_attention.py`), legacy grouped-GEMM
experts and shared-expert overlap (`moe/experts.py`, `moe/shared_experts.py`), MoE per-layer
metric tracking (`moe_utils.save_to_aux_losses_tracker(force_initialize=True)`), multi-instance
distributed optimizer streams (`distributed_data_parallel.py`), the distributed optimizer's
legacy `dp_zero`/`dp_reshardable` parameter-state formats, other fully-parallel exchange
algorithms, asynchronous checkpoint saving and fp16 loss scaling (`grad_scaler.py`).

Not patched: sequence parallelism needs the TE or apex norm (megatron's torch norm asserts it
off), so `mrl.platform.setup` refuses `parallel.sequence_parallel` on cpu with a `UserError`;
fused kernels (`*_fusion` flags, `gradient_accumulation_fusion`) are CUDA-only and must be off.

Kernels without a CPU build get torch twins in modules of this platform layer, chosen by the
tensors' device where the kernel is called: the gated delta rule of Qwen3-Next / Qwen3.5's Gated
DeltaNet layers (fla's Triton kernel on CUDA) is `mrl.platform.delta_rule.chunked_twin` on cpu
(megatron-core 0.16.1's own `ssm/gated_delta_net.py` is not used: it builds on CUDA only and takes
no packed sequences; `mrl.models.gated_deltanet`).

The patches target megatron-core 0.16.1. On another version `activate()` raises `UserError`
unless `MRL_CPU_COMPAT_FORCE=1` is set.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from mrl.errors import UserError
from mrl.platform.cpu_rng import cpu_get_rng_state, cpu_model_parallel_manual_seed, cpu_set_rng_state
from mrl.platform.cpu_torch import VIEW, in_mode

log = logging.getLogger(__name__)

TESTED_MEGATRON_VERSIONS = ("0.16.1",)
FORCE_ENV = "MRL_CPU_COMPAT_FORCE"


# --------------------------------------------------------------------------- version gate

def installed_megatron_version() -> str:
    """The installed megatron-core version (from package metadata)."""
    return importlib.metadata.version("megatron-core")


def check_megatron_version() -> str:
    """Return the installed version; raise `UserError` if untested and not forced by `FORCE_ENV`."""
    version = installed_megatron_version()
    if version in TESTED_MEGATRON_VERSIONS:
        return version
    tested = ", ".join(TESTED_MEGATRON_VERSIONS)
    if os.environ.get(FORCE_ENV, "") not in ("", "0"):
        warnings.warn(f"mrl CPU compatibility layer: megatron-core {version} is untested (tested: {tested}); "
                      f"continuing because {FORCE_ENV} is set", RuntimeWarning, stacklevel=3)
        return version
    raise UserError(
        f"the cpu platform's compatibility layer is tested with megatron-core {tested} but {version} is "
        f"installed; install megatron-core=={TESTED_MEGATRON_VERSIONS[-1]}, or set {FORCE_ENV}=1 to try "
        "anyway (patches whose megatron call site moved are skipped with a warning)"
    )


# --------------------------------------------------------------------------- the view and the mode: which megatron modules

# Megatron modules whose global `torch` is replaced by the view ("view" rows of the table).
VIEW_MODULES = (
    "megatron.core.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
)



# (module, qualified name, modules that imported the function by name) run under the mode ("mode" rows).
MODE_SCOPED = (
    ("megatron.core.tensor_parallel.data", "broadcast_data", ("megatron.core.tensor_parallel",)),
    ("megatron.core.models.common.language_module.language_module",
     "LanguageModule.setup_embeddings_and_output_layer", ()),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__", ()),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__", ()),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", ("megatron.core.optimizer.optimizer",)),
    ("megatron.core.dist_checkpointing.exchange_utils", "exchange_loaded_tensors_broadcast", ()),
)


# --------------------------------------------------------------------------- MoE

def _numpy_splits(orig):
    @functools.wraps(orig)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def apply_megatron_fixes() -> None:
    """Fix megatron-core 0.16.1 bugs that are not CPU-specific (rows 19, 26); safe on any platform.

    `moe_utils` names `te_general_gemm` only when Transformer Engine imports, then tests
    `te_general_gemm is not None`, a NameError without TE (the router's gating linear).
    `multi_latent_attention` sets `HAVE_TE` from importing megatron's TE extension, which imports
    without TE (placeholder classes), then calls `isinstance(..., TELinear)` on a placeholder.
    """
    import importlib.util

    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


# --------------------------------------------------------------------------- patch registry

@dataclass(frozen=True)
class Patch:
    """One reversible change: `apply()` returns the function that undoes it."""

    name: str
    call_site: str
    apply: Callable[[], Callable[[], None]]


def _set_attr(obj, attr: str, value) -> Callable[[], None]:
    missing = object()
    old = obj.__dict__.get(attr, missing) if isinstance(obj, type) else getattr(obj, attr, missing)

    def undo():
        if old is missing:
            delattr(obj, attr)
        else:
            setattr(obj, attr, old)

    setattr(obj, attr, value)
    return undo


def _view_patch(modname: str) -> Patch:
    def apply():
        mod = importlib.import_module(modname)
        if getattr(mod, "torch", None) is not torch:
            raise AttributeError(f"{modname} has no global 'torch' module")
        return _set_attr(mod, "torch", VIEW)

    return Patch(f"view:{modname.removeprefix('megatron.core.')}", modname, apply)


def _mode_patch(modname: str, qualname: str, importers: tuple[str, ...]) -> Patch:
    def apply():
        mod = importlib.import_module(modname)
        *owner_path, attr = qualname.split(".")
        owner = mod
        for part in owner_path:
            owner = getattr(owner, part)
        raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        if isinstance(raw, (classmethod, staticmethod)):
            wrapped = type(raw)(in_mode(raw.__func__))
            orig_fn = raw.__func__
        else:
            wrapped, orig_fn = in_mode(raw), raw
        undos = [_set_attr(owner, attr, wrapped)]
        for imp in importers:
            imod = importlib.import_module(imp)
            if getattr(imod, attr, None) is orig_fn:
                undos.append(_set_attr(imod, attr, wrapped))
        return lambda: [u() for u in reversed(undos)]

    return Patch(f"mode:{qualname}", f"{modname}.{qualname}", apply)


def _rng_patch() -> Callable[[], None]:
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    undos = [
        _set_attr(mrandom, "model_parallel_cuda_manual_seed", cpu_model_parallel_manual_seed),
        _set_attr(tensor_parallel, "model_parallel_cuda_manual_seed", cpu_model_parallel_manual_seed),
        _set_attr(mrandom, "_get_cuda_rng_state", cpu_get_rng_state),
        _set_attr(mrandom, "_set_cuda_rng_state", cpu_set_rng_state),
    ]
    return lambda: [u() for u in reversed(undos)]


def _te_gemm_patch() -> Callable[[], None]:
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return lambda: None
    return _set_attr(moe_utils, "te_general_gemm", None)


def _mla_te_patch() -> Callable[[], None]:
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is not None:
        return lambda: None
    return _set_attr(multi_latent_attention, "HAVE_TE", False)


def _splits_patch() -> Callable[[], None]:
    from megatron.core.transformer.moe import token_dispatcher

    return _set_attr(token_dispatcher, "maybe_move_tensor_to_cpu",
                     _numpy_splits(token_dispatcher.maybe_move_tensor_to_cpu))


PATCHES: tuple[Patch, ...] = (
    *(_view_patch(m) for m in VIEW_MODULES),
    *(_mode_patch(m, q, i) for m, q, i in MODE_SCOPED),
    Patch("rng:cpu-generator", "megatron.core.tensor_parallel.random", _rng_patch),
    Patch("moe:te_general_gemm", "megatron.core.transformer.moe.moe_utils.te_general_gemm", _te_gemm_patch),
    Patch("mla:have_te", "megatron.core.transformer.multi_latent_attention.HAVE_TE", _mla_te_patch),
    Patch("moe:numpy-splits", "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
          _splits_patch),
)

_UNDO: list[tuple[str, Callable[[], None]]] = []
_ACTIVE = False
_LOCK = threading.Lock()


def is_active() -> bool:
    return _ACTIVE


def activate() -> None:
    """Apply every patch (idempotent). Raises `UserError` on an untested megatron-core version."""
    global _ACTIVE
    with _LOCK:
        if _ACTIVE:
            return
        check_megatron_version()
        forced = installed_megatron_version() not in TESTED_MEGATRON_VERSIONS
        applied = []
        try:
            for patch in PATCHES:
                try:
                    applied.append((patch.name, patch.apply()))
                except (AttributeError, KeyError, ImportError) as e:
                    if not forced:
                        raise RuntimeError(f"cpu_compat patch {patch.name} ({patch.call_site}) failed: {e}") from e
                    warnings.warn(f"mrl cpu_compat: skipped {patch.name}: {e}", RuntimeWarning, stacklevel=2)
        except BaseException:
            for _, undo in reversed(applied):
                undo()
            raise
        _UNDO[:] = applied
        _ACTIVE = True
        log.debug("cpu_compat: %d patches active", len(applied))


def deactivate() -> None:
    """Undo every patch, newest first (idempotent)."""
    global _ACTIVE
    with _LOCK:
        while _UNDO:
            _, undo = _UNDO.pop()
            undo()
        _ACTIVE = False


def active_patches() -> list[str]:
    """Names of the patches currently applied."""
    return [name for name, _ in _UNDO]
