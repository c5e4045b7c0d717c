"""Reward for jobs/smollm2_chainsum_cpu.toml: reasoning-gym's exact chain_sum scorer applied to the
answer in `<answer>` tags, or, when the model gives no tags, to the last integer it wrote (small
instruct models rarely use the tags at first; the tagged share is logged so the format can be
watched as it is learned)."""
import re

_INT = re.compile(r"-?\d+")


def score(prompt, response, ground_truth, extra):
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(response, tag_name="answer")
    answer = tagged if tagged is not None else (_INT.findall(response) or [None])[-1]
    correct = answer is not None and answer.strip() == str(ground_truth).strip()
    return {"score": float(correct), "tagged": float(tagged is not None)}
