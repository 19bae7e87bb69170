"""Reward and held-out metric of the reverse-the-word-order task.

score(prompt, response, sample): 1 for the exact answer, else half the share of words in
the right place. exact(prompt, response, answer): the held-out metric, exact match.
"""


def score(prompt: str, response: str, sample: dict) -> float:
    answer, got = sample["answer"].split(), response.split()
    if got == answer:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(got, answer)) / max(len(answer), len(got), 1)


def exact(prompt: str, response: str, answer: str) -> float:
    return float(response.split() == answer.split())
