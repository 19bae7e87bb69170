"""The episode counters of a multi-turn run in the summary (``summary.json`` and its lines).

Rollout's workers count their episodes (finished, turns, environment calls, the errors that
ended one, by kind: :class:`~asyncflow.agents.episode.EpisodeRunner`) and keep the first few
failures' tracebacks; here they are summed over the workers (data-parallel ``sync``: one per
rank) into ``episodes`` / ``env_errors`` / ``env_first_error``, and said in one line each. A
single-turn run has none of them: every function returns nothing for it.
"""

from __future__ import annotations

from pathlib import Path

ENV_ERRORS = ("env_exception", "env_timeout", "env_bad_return", "env_template")


def episode_stats(stats: dict) -> dict:
    """The episode counters of every rollout worker (data-parallel ``sync``: one per rank), summed;
    their first failures, in rank order."""
    out: dict = {}
    for name, s in sorted(stats.items()):
        if name.split(".")[0] != "rollout" or "episodes" not in s:
            continue
        for k in ("episodes", "turns", "env_calls", "turns_cut_at_stop", "env_errors", *ENV_ERRORS):
            out[k] = out.get(k, 0) + s.get(k, 0)
        out["env_failures"] = out.get("env_failures", []) + s.get("env_failures", [])
    return out


def episode_counts(stats: dict) -> dict:
    """Multi-turn runs: ``episodes`` (finished, turns, environment calls, errors by kind) and
    ``env_errors`` / ``env_first_error`` (one line) beside it; nothing for a single-turn run."""
    rollout = episode_stats(stats)
    if not rollout:
        return {}
    fails = rollout["env_failures"]
    first = next((ln.strip() for ln in reversed(fails[0].splitlines()) if ln.strip()), None) if fails else None
    return {"episodes": {k: rollout.get(k, 0) for k in ("episodes", "turns", "env_calls", "turns_cut_at_stop",
                                                        *ENV_ERRORS)},
            "env_errors": rollout.get("env_errors", 0), "env_first_error": first[:200] if first else None}


def env_error_line(s: dict, log: Path | None) -> str | None:
    """One line on the episodes an environment error ended (None when none did)."""
    n = s.get("env_errors", 0)
    if not n:
        return None
    first = f"; first: {s['env_first_error']}" if s.get("env_first_error") else ""
    where = f" (tracebacks of the first few: {log})" if log is not None else ""
    return (f"asyncflow: warning: an environment error ended {n} of {s['episodes']['episodes']} episodes, "
            f"scored as env.on_error{first}{where}")


def episode_line(s: dict) -> str:
    """The summary's episodes line ("" for a single-turn run)."""
    if not s.get("episodes"):
        return ""
    e = s["episodes"]
    return (f"episodes           {e['episodes']} ({e['turns']} turns, {e['env_calls']} environment calls), "
            f"{s['env_errors']} ended by an environment error\n")
