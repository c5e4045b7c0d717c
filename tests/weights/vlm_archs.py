"""A tiny random Qwen2.5-VL or Qwen3-VL (the `builtin:tiny-qwen2.5-vl` / `tiny-qwen3-vl` shapes) saved as
safetensors, and image prompts."""
from __future__ import annotations

from pathlib import Path

import torch

from mrl.models.facts import BUILTIN_PRESETS


def right_padded(rows: list[list[int]], pad: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as `[n, width]` ids right-padded with `pad` (the byte tokenizer's end) and the mask."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


def one_rank_platform():
    """A one-rank CPU platform (one thread, seed 11) for a test module: use as
    `platform = pytest.fixture(scope="module")(one_rank_platform)`."""
    from mrl import platform as plat
    from mrl.platform.config import ParallelConfig, PlatformConfig

    ctx = plat.setup(PlatformConfig(device="cpu", ranks_per_node=1, cpu_threads=1), ParallelConfig(), seed=11)
    yield ctx
    plat.teardown()


def megatron_from_dir(d: Path, dtype: str = "float32"):
    """(completed hf config, the actor built at one rank with `d`'s checkpoint loaded, in eval mode)."""
    import json

    from mrl.models.megatron import complete_hf_config
    from mrl.models.roles import build_role_model
    from mrl.platform.config import ParallelConfig
    from mrl.weights import load_hf_checkpoint

    hf = complete_hf_config(json.loads((Path(d) / "config.json").read_text()))
    model = build_role_model("actor", hf, ParallelConfig(), dtype=dtype, device="cpu")
    load_hf_checkpoint([model], d, hf)
    return hf, model.eval()


def packed_logits(model, ref: dict, dtype=torch.float32) -> torch.Tensor:
    """The model's logits on a reference's packed row (`row`, `position_ids`, `lengths`, the images'
    `pixel_values` and, for Qwen-VL, `image_grid_thw`)."""
    from mrl.engine.packing import _thd_params

    extra = {"image_grid_thw": ref["image_grid_thw"]} if ref.get("image_grid_thw") is not None else {}
    with torch.no_grad():
        return model(ref["row"], ref["position_ids"], None, packed_seq_params=_thd_params(ref["lengths"], "cpu"),
                     pixel_values=ref["pixel_values"].to(dtype), **extra)[0]


def open_columns(hf: dict) -> torch.Tensor:
    """Vocabulary columns other than the vision placeholders (which the model's policy bans: -1e9)."""
    from mrl.models.vlm import PLACEHOLDER_FIELDS

    keep = torch.ones(hf["vocab_size"], dtype=torch.bool)
    keep[[hf[f] for f in PLACEHOLDER_FIELDS if hf.get(f) is not None]] = False
    return keep


def packed_logits_gap(model, hf: dict, ref: dict) -> float:
    """The max difference of the model's fp32 packed logits from the reference's on the open
    columns (the caller bounds it), after checking what every VLM's packed row must show: the
    placeholders banned at -1e9, the tower frozen, and blank images moving the logits by > 1e-2."""
    keep = open_columns(hf)
    got = packed_logits(model, ref)[:, : hf["vocab_size"]]
    assert (got[:, ~keep] == -1e9).all()
    assert model.vision is not None and not any(p.requires_grad for p in model.vision.parameters())
    blank = dict(ref, pixel_values=torch.zeros_like(ref["pixel_values"]))
    assert (packed_logits(model, blank)[:, : hf["vocab_size"]][:, keep] - ref["logits"][:, keep]).abs().max().item() > 1e-2
    return (got[:, keep] - ref["logits"][:, keep]).abs().max().item()


def assert_bf16_logits_close(got: torch.Tensor, want: torch.Tensor, ref: dict, keep: torch.Tensor) -> None:
    """bf16 on both sides (`got` mrl's, `want` transformers', open columns): each within bf16
    rounding (5% of the fp32 logits' largest magnitude) of the fp32 logits, and of each other."""
    scale = ref["logits"].abs().max().item()
    assert (got - ref["logits"][:, keep]).abs().max().item() <= 0.05 * scale
    assert (got - want).abs().max().item() <= 0.05 * scale


def trainer_audit(model, hf: dict, prompts, responses, items) -> tuple[float, dict]:
    """The step-1 audit by hand: the trainer's own path (a `Batch` whose prompt items carry their
    images, packed by the `Engine`) scores an engine's `responses`; (max |engine - trainer| log-prob,
    the trainer's outputs)."""
    from mrl.batch import Batch
    from mrl.engine.engine import Engine
    from mrl.engine.objectives import actor_outputs

    batch = Batch.from_sequences([prompts[r.prompt_index] for r in responses], [r.token_ids for r in responses],
                                 pad_id=256)
    batch = Batch(batch.tensors, {"prompt_item": [items[r.prompt_index] for r in responses]})
    out = Engine([model], name="actor").forward_only(
        batch, actor_outputs(1.0, entropy=True, vocab_size=hf["vocab_size"]), micro_batch_tokens=80)
    worst = max((out["logprobs"][i, :len(r.token_ids)] - torch.tensor(r.logprobs)).abs().max().item()
                for i, r in enumerate(responses))
    return worst, out


def make_vlm(out_dir: str | Path, seed: int = 0, preset: str = "tiny-qwen2.5-vl"):
    """The preset's architecture with random weights (norms and biases perturbed), saved; the model."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    model_type = BUILTIN_PRESETS[preset]["model_type"]
    cfg = {k: v for k, v in BUILTIN_PRESETS[preset].items() if k != "model_type"}
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.normal_(0.0, 0.08, generator=g)
    model.save_pretrained(out_dir)
    return model


def image_prompts(hf: dict, seed: int = 3):
    """Two prompts `[2, S]` (the second right-padded) with 1 and 2 images of different grids:
    (input_ids, attention_mask, pixel_values, image_grid_thw), the images in prompt order."""
    g = torch.Generator().manual_seed(seed)
    merge = hf["vision_config"]["spatial_merge_size"]
    grids = torch.tensor([[1, 4, 4], [1, 4, 6], [1, 2, 4]])
    patch_dim = 3 * hf["vision_config"]["temporal_patch_size"] * hf["vision_config"]["patch_size"] ** 2
    pixels = torch.randn(int(grids.prod(-1).sum()), patch_dim, generator=g)
    start, pad, end = hf["vision_start_token_id"], hf["image_token_id"], hf["vision_end_token_id"]

    def image(grid):
        return [start] + [pad] * int(grid.prod() // merge ** 2) + [end]

    def text(n):
        return torch.randint(0, 256, (n,), generator=g).tolist()

    rows = [text(3) + image(grids[0]) + text(5),
            text(2) + image(grids[1]) + text(4) + image(grids[2]) + text(3)]
    ids, mask = right_padded(rows)
    return ids, mask, pixels, grids


def image_prompt_inputs(hf: dict, seed: int = 3):
    """`image_prompts` as an engine takes them: (prompt id lists, one `ImageInputs` per prompt
    with its images' pixel rows, grids and merged token counts)."""
    from mrl.data.images import ImageInputs

    ids, mask, pixels, grids = image_prompts(hf, seed)
    cut = grids.prod(-1).cumsum(0).tolist()
    merge = hf["vision_config"]["spatial_merge_size"]
    inputs = [ImageInputs(pixels[:cut[0]], grids[:1], (int(grids[0].prod()) // merge ** 2,)),
              ImageInputs(pixels[cut[0]:], grids[1:], tuple(int(g.prod()) // merge ** 2 for g in grids[1:]))]
    return [ids[i, :int(n)].tolist() for i, n in enumerate(mask.sum(1))], inputs


def gemma3_image_prompts(hf: dict, seed: int = 3):
    """The multimodal Gemma 3's `image_prompts`: two prompts `[2, S]` (the second right-padded), with
    1 and 2 images of `vision_config.image_size` pixels each `mm_tokens_per_image` tokens between
    the start and end specials, long enough (22 and 27 tokens) that the 16-token sliding window
    cuts: (input_ids, attention_mask, pixel_values `[3, 3, S, S]`, None)."""
    g = torch.Generator().manual_seed(seed)
    size = hf["vision_config"]["image_size"]
    pixels = torch.randn(3, 3, size, size, generator=g)
    start, pad, end = hf["boi_token_index"], hf["image_token_index"], hf["eoi_token_index"]
    image = [start] + [pad] * hf["mm_tokens_per_image"] + [end]

    def text(n):
        return torch.randint(0, 256, (n,), generator=g).tolist()

    rows = [text(9) + image + text(7), text(5) + image + text(6) + image + text(4)]
    ids, mask = right_padded(rows)
    return ids, mask, pixels, None


def gemma3_image_prompt_inputs(hf: dict, seed: int = 3):
    """`gemma3_image_prompts` as an engine takes them: (prompt id lists, one `ImageInputs` per prompt)."""
    from mrl.data.images import ImageInputs

    ids, mask, pixels, _ = gemma3_image_prompts(hf, seed)
    per = hf["mm_tokens_per_image"]
    inputs = [ImageInputs(pixels[:1], None, (per,)), ImageInputs(pixels[1:], None, (per, per))]
    return [ids[i, :int(n)].tolist() for i, n in enumerate(mask.sum(1))], inputs


def save_gemma3_checkpoint(d: Path, preset: str = "tiny-gemma3-vl") -> Path:
    """A saved tiny multimodal Gemma 3 in `d` and `reference.pt` (as `test_vlm.save_checkpoint`):
    one packed row of the two image prompts with plain position ids, `transformers`' logits for
    its real tokens (the images' `token_type_ids` given, so each image attends to itself both ways),
    and the batched logits."""
    import json

    from mrl.models.megatron import complete_hf_config

    model = make_vlm(d, preset=preset)
    hf = complete_hf_config(json.loads((Path(d) / "config.json").read_text()))
    ids, mask, pixels, _ = gemma3_image_prompts(hf)
    types = (ids == hf["image_token_id"]).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, pixel_values=pixels, token_type_ids=types).logits
        causal = model(input_ids=ids, attention_mask=mask, pixel_values=pixels).logits
    lens = mask.sum(1).tolist()
    torch.save(dict(ids=ids, mask=mask, batched_logits=logits, lengths=lens, pixel_values=pixels, image_grid_thw=None,
                    row=torch.cat([ids[i, :n] for i, n in enumerate(lens)]).unsqueeze(0),
                    position_ids=torch.cat([torch.arange(n) for n in lens]).unsqueeze(0),
                    logits=torch.cat([logits[i, :n] for i, n in enumerate(lens)]),
                    causal_logits=torch.cat([causal[i, :n] for i, n in enumerate(lens)])), Path(d) / "reference.pt")
    return Path(d)


def save_qwen3_5_checkpoint(d: Path, preset: str = "tiny-qwen3.5-vl") -> Path:
    """A saved tiny multimodal Qwen3.5 in `d` and `reference.pt`: one packed row of two image prompts
    (3 images) with its mRoPE ids, and `transformers`' logits for its real tokens (each prompt run alone)."""
    import json

    from mrl.models.megatron import complete_hf_config
    from mrl.models.vlm import mrope_position_ids

    model = make_vlm(d, preset=preset)
    hf = complete_hf_config(json.loads((Path(d) / "config.json").read_text()))
    ids, mask, pixels, grids = image_prompts(hf)
    types = (ids == hf["image_token_id"]).int()
    lens, cut = mask.sum(1).tolist(), int(grids[0].prod())
    with torch.no_grad():   # each prompt alone (no padding through the DeltaNet recurrence)
        logits = [model(input_ids=ids[i:i + 1, :n], pixel_values=p, image_grid_thw=g,
                        mm_token_type_ids=types[i:i + 1, :n]).logits[0]
                  for i, n, p, g in ((0, lens[0], pixels[:cut], grids[:1]), (1, lens[1], pixels[cut:], grids[1:]))]
    pos = mrope_position_ids(hf, ids, grids, mask)
    torch.save(dict(ids=ids, mask=mask, lengths=lens, pixel_values=pixels, image_grid_thw=grids,
                    row=torch.cat([ids[i, :n] for i, n in enumerate(lens)]).unsqueeze(0),
                    position_ids=torch.cat([pos[:, i, :n] for i, n in enumerate(lens)], 1).unsqueeze(1),
                    logits=torch.cat(logits)), Path(d) / "reference.pt")
    return Path(d)
