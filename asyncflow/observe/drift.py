"""The summary's drift line: the execution-time simulator's prediction for the run's own config
beside what the run measured (``summary.json``'s ``planner``, filled by
:mod:`asyncflow.planner.check` through the api). It only formats a dict, so ``observe`` still
imports no planner code.
"""

from __future__ import annotations


def planner_line(s: dict) -> str:
    """The simulator's prediction for the run's own config beside what it measured (the summary's
    ``planner``, :mod:`asyncflow.planner.check`): a gap says the model has drifted from the code
    (or the profile from the machine). Empty without one."""
    p = s.get("planner")
    if not p:
        return ""
    if p.get("predicted_samples_per_s") is None:
        return f"planner            no prediction ({p.get('error_reason', 'unknown')})\n"
    err = f"error {p['error']:+.1%}; " if p.get("error") is not None else ""
    return (f"planner            predicted {p['predicted_samples_per_s']:.1f} samples/s, measured "
            f"{p['measured_samples_per_s']:.1f} after step 1 ({err}{p['profile']})\n")
