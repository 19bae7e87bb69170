"""Reward and held-out metric of the uppercase task.

score(prompt, response, sample) is the reward RL maximises: 1 for the exact answer, else
half the share of letters in the right place (a denser signal than exact match).
exact(prompt, response, answer) is the held-out metric (eval.metric): exact match.
"""


def score(prompt: str, response: str, sample: dict) -> float:
    answer, got = sample["answer"], response.strip()
    if got == answer:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(got, answer)) / max(len(answer), len(got), 1)


def exact(prompt: str, response: str, answer: str) -> float:
    return float(response.strip() == answer)
