"""Write train.jsonl and heldout.jsonl for the uppercase task (deterministic).

Each row is {"word": "lamp", "upper": "LAMP"}: random lowercase "words" of 3 to 6
letters, no word in both files. Run: python make_data.py  (a second or less)
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def main(n_train: int = 4000, n_heldout: int = 500, seed: int = 0) -> None:
    rng = random.Random(seed)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n_train + n_heldout:
        w = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    for name, part in (("train.jsonl", words[:n_train]), ("heldout.jsonl", words[n_train:])):
        with open(HERE / name, "w") as f:
            for w in part:
                f.write(json.dumps({"word": w, "upper": w.upper()}) + "\n")


if __name__ == "__main__":
    main()
