"""Reward and held-out metric of the reverse-the-word-order task.

score(prompt, response, sample): 1 for the exact answer (words compared), else 0.
exact(prompt, response, answer): the held-out metric, exact match of the words.
"""


def score(prompt: str, response: str, sample: dict) -> float:
    return float(response.split() == sample["answer"].split())


def exact(prompt: str, response: str, answer: str) -> float:
    return float(response.split() == answer.split())
