"""Write train.jsonl and heldout.jsonl for the reverse-the-word-order task (deterministic).

Each row is {"words": "cat sun tree", "answer": "tree sun cat"}: 3 different words
from WORDS, no sentence in both files. Run: python make_data.py  (a second or less)
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORDS = ("cat dog sun moon tree leaf rock sand fish bird lamp door road rain snow wind fire ice "
         "milk bread salt rice corn bean").split()


def main(n_train: int = 4000, n_heldout: int = 500, seed: int = 0) -> None:
    rng = random.Random(seed)
    rows: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    while len(rows) < n_train + n_heldout:
        words = rng.sample(WORDS, 3)
        if tuple(words) not in seen:
            seen.add(tuple(words))
            rows.append(words)
    for name, part in (("train.jsonl", rows[:n_train]), ("heldout.jsonl", rows[n_train:])):
        with open(HERE / name, "w") as f:
            for words in part:
                f.write(json.dumps({"words": " ".join(words), "answer": " ".join(reversed(words))}) + "\n")


if __name__ == "__main__":
    main()
