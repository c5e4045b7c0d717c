"""A synthetic image task drawn at run time: which colour fills the picture?

Each prompt is one 56x56 image (4 vision tokens for the tiny Qwen2.5-VL) filled with red or blue,
with a few random grey squares on it, and the question "<image>Colour? 1 = red, 2 = blue:". The
answer is only in the image. The reward: 0.5 when the response starts with "1" or "2" (the format,
learned first), plus 0.5 when that digit is the right one (which needs the image). A random policy
scores about 0.004; guessing the format alone 0.75; reading the image 1.0.

`conversations` is the same task for `mrl sft` (jobs/sft_vlm_cpu.toml): two-turn chats, an image
in each user turn (a chat image part, then an `<image>` mark), the answer digit in each assistant
turn, so the second image comes after the first trained token.
"""
import io
import random

COLOURS = {"1": (200, 30, 30), "2": (30, 30, 200)}


def _image(rng: random.Random, colour) -> bytes:
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (56, 56), colour)
    draw = ImageDraw.Draw(im)
    for _ in range(rng.randint(0, 3)):
        x, y, s = rng.randint(0, 44), rng.randint(0, 44), rng.randint(4, 12)
        draw.rectangle([x, y, x + s, y + s], fill=(128, 128, 128))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def prompts(size: int, seed: int) -> list[dict]:
    """`size` rows in verl's multimodal layout: `<image>` in the prompt, the PNG in `images`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        answer = rng.choice(sorted(COLOURS))
        rows.append({"prompt": "<image>Colour? 1 = red, 2 = blue:", "answer": answer,
                     "images": [{"bytes": _image(rng, COLOURS[answer]), "path": None}]})
    return rows


def conversations(size: int, seed: int) -> list[dict]:
    """`size` two-turn chats in verl's multimodal layout (`messages` and `images` columns)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.choice(sorted(COLOURS)), rng.choice(sorted(COLOURS))
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour? 1 = red, 2 = blue:"}]},
            {"role": "assistant", "content": a},
            {"role": "user", "content": "<image>And this one?"},
            {"role": "assistant", "content": b},
        ], "images": [{"bytes": _image(rng, COLOURS[a]), "path": None}, {"bytes": _image(rng, COLOURS[b]), "path": None}]})
    return rows


def score(prompt, response: str, ground_truth, extra) -> dict:
    first = response[:1]
    fmt = first in COLOURS
    right = first == ground_truth
    return {"score": 0.5 * fmt + 0.5 * right, "correct": float(right)}
