"""Reward functions written for verl (`compute_score(data_source, solution_str, ground_truth, extra_info)`)
and their mrl-convention twins, for the signature tests and the quickstart equivalence."""


def _correct(data_source, text, truth, index):
    if data_source not in ("chain_sum", "quickstart", "openai/gsm8k"):
        raise NotImplementedError(f"Reward function is not implemented for {data_source=}")
    ok = text.strip().endswith(str(truth).strip())
    return {"score": float(ok), "acc": ok, "index": float(index), "pred": text[-8:]}


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """verl's custom reward shape: dispatch on the data source, a dict with score and extras."""
    return _correct(data_source, solution_str, ground_truth, (extra_info or {}).get("index", -1))


def score(prompt, response, ground_truth, extra):
    """The same reward in mrl's convention."""
    return _correct(extra["data_source"], response, ground_truth, (extra.get("extra_info") or {}).get("index", -1))


def no_extra_info(data_source, solution_str, ground_truth):
    return float(solution_str.strip() == ground_truth)


def keyword_only(*, solution_str, ground_truth, scale=1.0):
    return scale * float(solution_str.strip() == ground_truth)
