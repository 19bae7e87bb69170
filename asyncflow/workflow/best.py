"""Keeping the best evaluated weights (``train.keep_best``): the run's ``checkpoint/`` is the
version with the best held-out figure, not only the last one.

A run at a constant learning rate can end below its own mid-run evaluations (a newcomer's task:
0.99-1.00 mid-run, 0.94 at the end). With ``keep_best`` every held-out evaluation of the run
(the periodic ones, beside training or pausing it, and the final one) is offered to a
:class:`BestKeeper`; one that beats every earlier figure is saved at once to
``RUN_DIR/checkpoint-best`` (written to ``checkpoint-best.tmp`` and renamed, so a crash keeps
the previous best) with ``best.json`` (version, figure). At the end, if the best beats the last
evaluation, ``checkpoint/`` becomes the best and the last goes to ``checkpoint-last/``; the
summary says which it is.

Invariants:

* ``offer`` saves only a strictly better figure (a tie keeps the earlier one: the figure is
  the same and the earlier weights had fewer updates); figures are "higher is better" (exact
  match, accuracy, mean reward: every held-out metric here);
* it may be called from the evaluator's thread and the driver's, so it holds a lock while it
  compares and saves (one save at a time);
* a resumed run reads ``best.json`` back, so the best of the part before the restart counts.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

BEST, LAST = "checkpoint-best", "checkpoint-last"


class BestKeeper:
    """The best held-out figure so far and its weights in ``run_dir/checkpoint-best``."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir) / BEST
        self._lock = threading.Lock()
        self.best: tuple[int, float] | None = None  # (version, figure)
        info = self.dir / "best.json"
        if info.is_file():  # (a resumed run)
            saved = json.loads(info.read_text())
            self.best = (int(saved["version"]), float(saved["heldout_acc"]))

    def offer(self, version: int, figure: float | None, save: Callable[[str], Any]) -> bool:
        """Save the weights of ``version`` through ``save(folder)`` if ``figure`` beats the best so
        far; True if it did."""
        if figure is None:
            return False
        with self._lock:
            if self.best is not None and figure <= self.best[1]:
                return False
            tmp = self.dir.with_name(BEST + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            save(str(tmp))
            (tmp / "best.json").write_text(json.dumps({"version": version, "heldout_acc": figure}))
            shutil.rmtree(self.dir, ignore_errors=True)
            os.replace(tmp, self.dir)
            self.best = (version, figure)
            return True

    def finish(self, run_dir: Path, version: int, figure: float | None) -> dict:
        """At the end of the run (``checkpoint/`` holds the last weights, ``version``, with the final
        held-out ``figure``): make ``checkpoint/`` the best; what it is, for the summary."""
        with self._lock:
            final, best = Path(run_dir) / "checkpoint", self.best
            if best is None or figure is None or figure >= best[1]:
                shutil.rmtree(self.dir, ignore_errors=True)
                return {"kept": "last", "version": version, "heldout_acc": figure}
            shutil.rmtree(final.with_name(LAST), ignore_errors=True)
            os.replace(final, final.with_name(LAST))
            os.replace(self.dir, final)
            return {"kept": "best", "version": best[0], "heldout_acc": best[1], "last_version": version,
                    "last_heldout_acc": figure}
