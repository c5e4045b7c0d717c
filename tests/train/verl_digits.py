"""The quickstart's reward (jobs/tasks/digits.py:score) written as a verl reward function, with
verl's usual dispatch on the data source (the quickstart generator's rows come from "prompts")."""
WINDOW = 8


def score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if data_source != "prompts":
        raise NotImplementedError(f"Reward function is not implemented for {data_source=}")
    head = solution_str[:WINDOW].ljust(WINDOW)
    digits = sum(ch.isdigit() for ch in head)
    return {"score": digits / WINDOW, "all_digits": float(digits == WINDOW)}
