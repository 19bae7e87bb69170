"""The bench's printed reports: the throughput table (:func:`format_table`) and the
learning-quality lines (:func:`format_quality`); :mod:`asyncflow.bench.run` fills the rows."""

from __future__ import annotations

WORKLOAD_TEXT = {
    "a": "compute-bound, long-tailed answers",
    "b": "long-tailed answers + remote reward 100-300 ms/call",
}
SYNCS = ("sync", "sync:dp")  # the synchronous baseline's variants: vs_sync takes the faster


def format_quality(report: dict) -> str:
    """One line per run; with several seeds, each mode's mean and ``async - sync`` per seed."""
    q = report["quality"]
    lines = ["", "seed  mode    samples  held-out before -> after   samples/s"]
    lines += [f"{r['seed']:>4}  {r['mode']:<7} {r['samples']:>7}  {r['heldout_acc_before']:>14.1%} -> "
              f"{r['heldout_acc_after']:.1%}   {r['samples_per_s']:>9.1f}" for r in q]
    seeds = sorted({r["seed"] for r in q})
    if len(seeds) > 1:
        after = {(r["seed"], r["mode"]): r["heldout_acc_after"] for r in q}
        gain = {(r["seed"], r["mode"]): r["heldout_acc_after"] - r["heldout_acc_before"] for r in q}
        for mode in ("sync", "async"):
            lines.append(f"mean  {mode:<7} after {sum(after[s, mode] for s in seeds) / len(seeds):.1%}, "
                         f"gain {sum(gain[s, mode] for s in seeds) / len(seeds) * 100:+.1f} points "
                         f"(seeds {', '.join(f'{gain[s, mode] * 100:+.1f}' for s in seeds)})")
        diff = [(after[s, "async"] - after[s, "sync"]) * 100 for s in seeds]
        lines.append(f"async - sync after: {', '.join(f'{d:+.1f}' for d in diff)} points "
                     f"(mean {sum(diff) / len(diff):+.1f})")
    return "\n".join(lines)


# Measured on one H100 (2026-11-22): `async` read 121% and `async:2` 157% of a "bound" on
# workload (a), rollout spending 1.3-1.7x less CPU per sample in the run than alone.
GPU_BOUND_NOTE = (
    "NOTE resources.device={0}: the roles share the GPU and each role's cost per sample depends on how many rows\n"
    "it batches, so the solo runs are not a bound here (eff. above 100% shows it); read samples/s and vs sync.")


def _by_role(busy: dict[str, float]) -> dict[str, float]:
    """Busy fractions per role: a data-parallel role's ranks (``actor``, ``actor.1``...) averaged."""
    ranks: dict[str, list[float]] = {}
    for k, x in busy.items():
        ranks.setdefault(k.split(".")[0], []).append(x)
    return {k: sum(xs) / len(xs) for k, xs in ranks.items()}


def format_table(report: dict) -> str:
    busies = [_by_role(r["busy"]) for r in report["rows"]]
    roles = sorted({k for b in busies for k in b}, key=["rollout", "reward", "reference", "critic", "actor"].index)
    head = (f"{'wl':<3}{'mode':<8}{'samples/s':>10}{'tokens/s':>10}{'vs sync':>9}{'bound':>9}  {'limited by':<14}"
            f"{'eff.':>6}  " + "  ".join(f"{r[:7]:>7}" for r in roles) + f"{'cores':>7}{'other':>7}")
    shape = (f", steps of {report['prompts_per_step']} prompts x {report['group_size']} answers"
             if "prompts_per_step" in report else "")
    best = f", each mode's fastest of {report['repeat']} runs" if report.get("repeat", 1) > 1 else ""
    lines = [f"\n== asyncflow bench: {report['samples']} samples per run{shape} (timed after the first step)"
             f"{best}, {report['cpus']} CPUs ==",
             *(f"workload {w}: {t}" for w, t in WORKLOAD_TEXT.items()
               if any(r["workload"] == w for r in report["rows"])),
             "busy = fraction of the run each role spent computing; cores = CPU the machine used "
             f"(of {report['cpus']}), other = outside the role processes", head, "-" * len(head)]
    for r, b in zip(report["rows"], busies):
        ratio = f"{r['vs_sync']:.2f}x" if r["vs_sync"] is not None else "-"
        busy = "  ".join(f"{b[k]:>7.0%}" if k in b else f"{'-':>7}" for k in roles)
        cpu = r.get("cpu") or {}
        cores = "".join(f"{cpu[k]:>7.2f}" if cpu.get(k) is not None else f"{'-':>7}" for k in ("cores", "other"))
        lines.append(f"{r['workload']:<3}{r['mode']:<8}{r['samples_per_s']:>10.1f}{r['tokens_per_s']:>10.0f}{ratio:>9}"
                     f"{r['bound']:>9.1f}  {r['bound_limit']:<14}{r['efficiency']:>6.0%}  {busy}{cores}")
    syncs = {r["mode"] for r in report["rows"]} & set(SYNCS)
    if len(syncs) > 1:
        vs = sorted({(r["workload"], r["vs"]) for r in report["rows"] if r.get("vs")})
        lines.append("vs sync = against the faster sync variant (sync: one worker on every core; sync:dp: one "
                     "1-thread rank per CPU): " + ", ".join(f"{w} {m}" for w, m in vs))
    gaps = [r for r in report["rows"] if r.get("gap")]
    if gaps:
        lines.append("efficiency = busy x on a core x CPU/sample alone/in the run x solo wall/CPU "
                     "(the limiting role's; see asyncflow.bench.run.gap_factors):")
        for r in gaps:
            g = r["gap"]
            lines.append(f"  {r['workload']} {r['mode']:<8}{r['efficiency']:>4.0%} ~ {g['role']} busy {g['busy']:.0%} "
                         f"x on a core {g['on_cpu']:.0%} x work {g['work']:.0%} x solo {g['solo']:.0%}")
    if report.get("device", "cpu") != "cpu":
        lines.append(GPU_BOUND_NOTE.format(report["device"]))
    if any(len(r.get("runs", ())) > 1 for r in report["rows"]):
        lines.append("every run (samples/s): " + "; ".join(
            f"{r['workload']} {r['mode']} " + " ".join(f"{x:.1f}" for x in r["runs"]) for r in report["rows"]))
        lines.append("each round's run / that round's bound (the spread is the machine's drift): " + "; ".join(
            f"{r['workload']} {r['mode']} " + " ".join(f"{x:.0%}" for x in r["round_efficiency"])
            for r in report["rows"] if r.get("round_efficiency")))
        a = {r["mode"]: r["runs"] for r in report["rows"] if r["workload"] == "a"}
        pairs = [(r["mode"], a[r["mode"]], r["runs"]) for r in report["rows"]
                 if r["workload"] == "b" and r["mode"] in a]
        if pairs:
            lines.append("(b) / (a) in each round (run side by side): " + "; ".join(
                f"{mode} " + " ".join(f"{y / x:.0%}" for x, y in zip(ra, rb)) for mode, ra, rb in pairs))
    return "\n".join(lines)
