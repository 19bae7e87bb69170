"""``asyncflow bench``: sync vs stream vs async on the same resources, against their bounds.

For each workload the same job (same model, prompts, seeds) runs for a fixed number of
samples in every mode, one after another on one launcher, and then each role runs alone
(:mod:`asyncflow.bench.solo`) to give every mode its *bound*. The table prints measured
samples/s and tokens/s, the ratio to ``sync``, the bound and what limits it, the
efficiency (measured / bound), each role's busy fraction, and the CPU the machine used
(``cores``; ``other``: cores not spent in the role processes: data plane, weight store,
driver, Ray), which explain the ratios.

Workloads:

* ``a``: compute-bound, long-tailed answer lengths (most answers short, a few long, as in
  reasoning RL: ``rollout.gen_len=longtail``);
* ``b``: ``a`` plus a reward that waits on a remote service (verifier, judge), emulated at
  the edge with a uniform 100-300 ms latency per call and enough calls in flight that the
  service itself is never the bottleneck.

Both run the bench preset: steps of ``PROMPTS_PER_STEP`` prompts (unless the config sets
``train.prompts_per_step``), so that a step outlasts one answer group's reward round trip
(decode, then the slowest of its 8 calls: ~0.4 s here). With the default job's 16 prompts a
step takes ~0.3 s on this CPU, shorter than that chain, and ``async`` at staleness 1
cannot hide the latency whatever the code does; real RL steps take minutes against
rewards of seconds. ``train.prompts_per_step=16`` shows that latency-bound case.

The bench runs ``repeat`` rounds; a round runs every mode, each followed by its roles
alone (this machine's speed drifts by +-15% over minutes: runs and solos measured in the
same round share it). The workloads take turns mode by mode ((a)'s ``sync``, (b)'s
``sync``, (a)'s ``stream``, ...), so the line of (b)/(a) per round compares runs about
a minute apart. A row shows the mode's fastest run against a bound from the
fastest solo runs (interference only ever adds time, and each mode and each kind of solo
run gets the same number of tries). Every role but rollout gets its fastest solo run on
the same threads (and pinned cores) in any round: only rollout's work depends on how the
mode feeds it. A line under the table divides each round's run by the bound from
that round's solo runs alone (same rule), so drift between rounds cancels there: the
spread of a mode's figures is the noise on its efficiency. A role pinned to cores of its
own in a mode's runs (``resources.pin_cores``, on by default with the local Ray instance
the bench starts) is pinned to them alone too.

Under the table, each ``stream``/``async`` row's efficiency is split into four measured
factors of its limiting role (:func:`gap_factors`; their product is the efficiency):
how much of the run it was busy (the rest it waited on the pipeline), how much of that
busy time its thread was on a core (the rest other threads and processes ran there),
its CPU per sample alone over in the run (the same work costing more or less CPU: a
neighbour on the shared caches, the order rows arrive in, the machine's own drift), and
its solo run's wall over CPU. On 2 cores the first says whether the pipeline waits, the
second what the services and helper threads take from the role's core.

``--quality`` instead trains the default example in ``sync`` and ``async`` for the same
number of samples and reports held-out accuracy before and after each; ``--seeds 0,1,2``
does so for each seed (each its own warm-start) and prints the mean of each mode and of
``async`` minus ``sync``: one seed's RL gain is not the example's (they differ by 10 points).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path

from asyncflow.bench.solo import bound, measure_roles
from asyncflow.config import ConfigError, RunConfig
from asyncflow.launch.registry import get_launcher
from asyncflow.tasks.models import prepare_model
from asyncflow.workflow.cores import pinnable_cores
from asyncflow.workflow.driver import train
from asyncflow.workflow.launcher import Launcher
from asyncflow.workflow.plan import plan_workers

WORKLOADS = {
    "a": {"rollout": {"gen_len": "longtail"}},
    "b": {"rollout": {"gen_len": "longtail"}, "reward": {"latency_ms": (100.0, 300.0), "concurrency": 256}},
}
PROMPTS_PER_STEP = 32  # the bench preset (see the module docstring)
SAMPLES = 4096  # per run: 16 steps of the preset, 15 timed
WORKLOAD_TEXT = {
    "a": "compute-bound, long-tailed answers",
    "b": "long-tailed answers + remote reward 100-300 ms/call",
}


def parse_mode(spec: str) -> tuple[str, int | None]:
    """``"async:2"`` -> ``("async", 2)``: a mode, optionally with its staleness bound."""
    mode, _, k = spec.partition(":")
    if mode not in ("sync", "stream", "async") or (k and (mode != "async" or not k.isdigit())):
        raise ConfigError(f"unknown bench mode {spec!r} (modes: sync, stream, async, async:K with K the staleness)")
    return mode, int(k) if k else None


def _variant(cfg: RunConfig, workload: str, spec: str, steps: int, run_dir: str) -> RunConfig:
    mode, staleness = parse_mode(spec)
    data = cfg.model_dump()
    for section, values in WORKLOADS[workload].items():
        data[section].update(values)
    data.update(mode=mode, progress=False, run_dir=run_dir)
    if staleness is not None:
        data["staleness"] = staleness
    data["train"].update(steps=steps, eval_every=0)
    return RunConfig.model_validate(data)


def run_bench(cfg: RunConfig, config: str | None = None, overrides: Sequence[str] = (), samples: int | None = None,
              workloads: Sequence[str] = ("a", "b"), modes: Sequence[str] = ("sync", "stream", "async", "async:2"),
              out: str | None = None,
              quality: bool = False, repeat: int = 2, seeds: list[int] | None = None) -> dict:
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise ConfigError(f"unknown workload {bad} (workloads: a, b)")
    for spec in modes:
        parse_mode(spec)
    if repeat < 1:
        raise ConfigError(f"bench --repeat must be >= 1, got {repeat}")
    if cfg.algorithm.name == "ppo" and not quality:
        raise ConfigError("asyncflow bench has no solo timing of the PPO critic role yet: bench another "
                          "algorithm.name, or compare learning with --quality")
    root = Path(cfg.run_dir).expanduser() / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True, exist_ok=True)
    model_dir, _ = prepare_model(cfg, root)  # warm-start once (cached), before any timing
    launcher = get_launcher(cfg.launcher)
    try:
        if quality:
            report = _quality(cfg, launcher, root, train, seeds or [cfg.seed])
        else:
            if "prompts_per_step" not in cfg.train.model_fields_set:  # the preset, unless the config chose
                cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"prompts_per_step": PROMPTS_PER_STEP})})
            steps = max(2, (samples or SAMPLES) // cfg.batch_size)
            report = {"samples": steps * cfg.batch_size, "cpus": launcher.cpus, "rows": [], "repeat": repeat,
                      "prompts_per_step": cfg.train.prompts_per_step, "group_size": cfg.rollout.group_size,
                      "device": cfg.resources.device}
            # the workloads take turns mode by mode: (b)'s run of a mode sits beside (a)'s, at
            # the machine's speed of the moment, so (b)/(a) per round is not drift
            measuring = [_rounds(cfg, w, modes, steps, model_dir, launcher, root, train, repeat) for w in workloads]
            for _ in range(repeat * len(modes)):
                for m in measuring:
                    next(m)
            for m in measuring:
                report["rows"] += _finish(m)
            print(format_table(report))
    finally:
        launcher.shutdown()
    path = Path(out) if out else root / "bench.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"written {path}")
    return report


def _workload(cfg, w, modes, steps, model_dir, launcher, root, train, repeat: int = 1) -> list[dict]:
    """Every round of workload ``w``, then its rows (:func:`_rounds` driven to the end)."""
    return _finish(_rounds(cfg, w, modes, steps, model_dir, launcher, root, train, repeat))


def _finish(rounds) -> list[dict]:
    """Run a :func:`_rounds` generator's remaining rounds; return its rows."""
    try:
        while True:
            next(rounds)
    except StopIteration as done:
        return done.value


def _rounds(cfg: RunConfig, w: str, modes: Sequence[str], steps: int, model_dir: str, launcher: Launcher,
            root: Path, train: Callable[..., dict], repeat: int = 1) -> Generator[int, None, list[dict]]:
    """Measure workload ``w`` one mode per ``next`` (its run, then its roles alone unless
    this round already ran that kind of solo); after the last round, return
    (``StopIteration.value``) its rows.

    Each round runs every mode, each followed by its roles alone (once per round and
    kind): this machine's speed drifts by +-15% over minutes, so a bound measured minutes
    away from its runs would be off by as much; interleaved, each round's runs and solos
    share the machine's speed of the moment."""
    wl = _Workload(cfg, w, modes, steps, model_dir, launcher, root)
    for i in range(repeat):
        solo_done: set[tuple] = set()
        for mode in modes:
            wl.measure(mode, i, repeat, train, solo_done)
            yield i
    return wl.rows()


class _Workload:
    """One workload's runs and solo runs across the rounds, and the rows they make."""

    def __init__(self, cfg: RunConfig, w: str, modes: Sequence[str], steps: int, model_dir: str,
                 launcher: Launcher, root: Path):
        self.cfg, self.w, self.modes, self.steps, self.model_dir, self.launcher = cfg, w, modes, steps, model_dir, launcher
        self.vcfgs = {mode: _variant(cfg, w, mode, steps, str(root)) for mode in modes}  # modes: specs, e.g. "async:2"
        self.runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        self.solos: dict[tuple, list[dict]] = {}
        self.solo_cpu: dict[tuple, list[dict]] = {}  # CPU seconds of each role's thread in the same solo runs

    def role_cores(self, vcfg: RunConfig) -> dict[str, tuple[int, ...]]:
        """Each role's cores in the mode's runs (if pinned)."""
        specs = plan_workers(vcfg, self.launcher.cpus, pinnable_cores(vcfg, self.launcher))
        return {role: spec.cores for spec in specs[::-1] for role in spec.roles if spec.cores}  # rank 0 last: wins

    def solo_key(self, vcfg: RunConfig) -> tuple[int, bool, tuple]:
        """(threads per role, continuous rollout, pinned cores): what makes two solo runs alike."""
        cpus = self.launcher.cpus
        threads = (vcfg.resources.sync_threads or cpus) if vcfg.mode == "sync" else vcfg.resources.threads_per_role
        return threads, vcfg.mode == "async", tuple(sorted(self.role_cores(vcfg).items()))

    def measure(self, mode: str, i: int, repeat: int, train: Callable[..., dict], solo_done: set[tuple]) -> None:
        """Round ``i``'s run of ``mode``, then its roles alone (unless this round ran that kind)."""
        vcfg, w = self.vcfgs[mode], self.w
        of = f" (round {i + 1} of {repeat})" if repeat > 1 else ""
        print(f"[bench] workload {w} ({WORKLOAD_TEXT[w]}): {mode}{of} ...", flush=True)
        s = train(vcfg, launcher=self.launcher, evaluate=False)
        self.runs[mode].append({"workload": w, "mode": mode, "samples_per_s": s["steady_samples_per_s"],
                                "tokens_per_s": s["steady_tokens_per_s"], "wall_s": s["wall_s"], "busy": s["busy"],
                                "on_cpu": s.get("on_cpu", {}), "cpu_per_sample": _per_sample(s),
                                "cpu": s["cpu"], "max_staleness": s["max_staleness"], "run_dir": s["run_dir"]})
        key = self.solo_key(vcfg)
        if key in solo_done:
            return
        solo_done.add(key)
        print(f"[bench] workload {w}: roles alone on {key[0]} thread(s), "
              f"{'continuous' if key[1] else 'step-by-step'} rollout{', pinned' if key[2] else ''}{of} ...", flush=True)
        used: dict[str, float] = {}
        self.solos.setdefault(key, []).append(measure_roles(vcfg, self.model_dir, self.steps, key[0], key[1],
                                                            dict(key[2]), cpu=used))
        self.solo_cpu.setdefault(key, []).append(used)

    def bounding(self, role: str, key: tuple) -> list[tuple]:
        """The solo kinds whose runs may bound ``role`` in a mode of solo kind ``key``: its
        own for rollout, every kind on the same threads and cores for the others."""
        return [key] if role == "rollout" else [k for k in self.solos if (k[0], k[2]) == (key[0], key[2])]

    def fastest(self, role: str, key: tuple) -> tuple[float, float | None]:
        """(seconds, CPU seconds) of ``role``'s fastest solo run that may bound a mode of
        solo kind ``key``. Only rollout's work depends on how it is fed (step by step or
        continuously); every other role takes its fastest run on the same threads and cores,
        whichever way rollout was fed. (Before the padding split the continuous solo trainer
        was 20-65% slower on the same steps, rows in completion order making costlier
        micro-batches; a bound from it alone flattered async.) The fastest, because other
        load only ever adds time and every mode and kind got as many tries."""
        return min(((r[role], used.get(role)) for k in self.bounding(role, key)
                    for r, used in zip(self.solos[k], self.solo_cpu[k]) if role in r), key=lambda t: t[0])

    def in_round(self, role: str, key: tuple, i: int) -> float:
        """``role``'s solo seconds in round ``i`` alone, by the rule of :meth:`fastest`."""
        return min(self.solos[k][i][role] for k in self.bounding(role, key) if role in self.solos[k][i])

    def rows(self) -> list[dict]:
        """One row per mode: its fastest run against the bound of the fastest solo runs."""
        samples = (self.steps - 1) * self.cfg.batch_size
        rows = []
        for mode in self.modes:
            runs, vcfg = self.runs[mode], self.vcfgs[mode]
            key = self.solo_key(vcfg)
            row = {**max(runs, key=lambda r: r["samples_per_s"]), "runs": [r["samples_per_s"] for r in runs],
                   "max_staleness": max(r["max_staleness"] for r in runs)}
            picked = {role: self.fastest(role, key) for role in self.solos[key][0]}
            seconds = {role: t for role, (t, _) in picked.items()}
            b, limit = bound(vcfg.mode, seconds, samples)
            row.update(solo_s=seconds, solo_runs=self.solos[key], bound=b, bound_limit=limit,
                       efficiency=row["samples_per_s"] / b)
            # each round's run against that round's own bound: the spread shows the machine's drift
            row["round_efficiency"] = [
                run["samples_per_s"] / bound(vcfg.mode, {role: self.in_round(role, key, i)
                                                         for role in self.solos[key][i]}, samples)[0]
                for i, run in enumerate(runs)]
            if vcfg.mode != "sync" and key[0] == 1:  # one thread per role: its thread's CPU is the role's
                row["gap"] = gap_factors(row, limit, *picked[limit], samples)
            rows.append(row)
        sync = next((r for r in rows if r["mode"] == "sync"), None)
        for row in rows:
            row["vs_sync"] = row["samples_per_s"] / sync["samples_per_s"] if sync else None
        return rows


def _per_sample(summary: dict) -> dict[str, float]:
    """CPU seconds per sample each role's thread spent computing (steady window)."""
    n = summary.get("steady_samples") or 0
    return {role: c / n for role, c in summary.get("busy_cpu_s", {}).items()} if n else {}


def gap_factors(row: dict, role: str, solo_s: float, solo_cpu_s: float | None, samples: int) -> dict | None:
    """Why a mode's run falls short of its bound, as four measured factors whose product is
    its efficiency (up to the role's wall clock against the run's, ~1):

    * ``busy``: the limiting ``role``'s busy fraction in the run (the rest it waited);
    * ``on_cpu``: the share of its busy time its thread was on a core (the rest: preempted);
    * ``work``: CPU seconds per sample alone / in the run (below 1: the same work cost more
      CPU in the pipeline: caches shared with a neighbour, micro-batches in completion order
      against the solo run's, weight export);
    * ``solo``: the solo run's wall / its CPU (above 1: the solo run was preempted too).

    None when a figure is missing (a role on several threads, a solo run without CPU)."""
    busy, on, run_cpu = row["busy"].get(role), row.get("on_cpu", {}).get(role), row.get("cpu_per_sample", {}).get(role)
    if not (busy and on and run_cpu and solo_cpu_s and samples):
        return None
    return {"role": role, "busy": busy, "on_cpu": on, "work": solo_cpu_s / samples / run_cpu,
            "solo": solo_s / solo_cpu_s}


def _quality(cfg, launcher, root, train, seeds: list[int]) -> dict:
    report = {"quality": []}
    for seed in seeds:
        for mode in ("sync", "async"):
            data = cfg.model_dump()
            data.update(mode=mode, progress=False, run_dir=str(root), seed=seed)
            print(f"[bench] quality: seed {seed}, {mode} ...", flush=True)
            s = train(RunConfig.model_validate(data), launcher=launcher)
            report["quality"].append({"seed": seed, **{k: s[k] for k in (
                "mode", "samples", "heldout_acc_before", "heldout_acc_after", "samples_per_s", "wall_s",
                "max_staleness")}})
    print(format_quality(report))
    return report


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


def format_table(report: dict) -> str:
    roles = sorted({k for r in report["rows"] for k in r["busy"]}, key=["rollout", "reward", "reference", "actor"].index)
    head = (f"{'wl':<3}{'mode':<8}{'samples/s':>10}{'tokens/s':>10}{'vs sync':>9}{'bound':>9}  {'limited by':<14}"
            f"{'eff.':>6}  " + "  ".join(f"{r[:7]:>7}" for r in roles) + f"{'cores':>7}{'other':>7}")
    shape = (f", steps of {report['prompts_per_step']} prompts x {report['group_size']} answers"
             if "prompts_per_step" in report else "")
    best = f", each mode's fastest of {report['repeat']} runs" if report.get("repeat", 1) > 1 else ""
    lines = [f"\n== asyncflow bench: {report['samples']} samples per run{shape} (timed after the first step)"
             f"{best}, {report['cpus']} CPUs ==",
             *(f"workload {w}: {t}" for w, t in WORKLOAD_TEXT.items() if any(r["workload"] == w for r in report["rows"])),
             "busy = fraction of the run each role spent computing; cores = CPU the machine used "
             "(of {0}), other = outside the role processes".format(report["cpus"]), head, "-" * len(head)]
    for r in report["rows"]:
        ratio = f"{r['vs_sync']:.2f}x" if r["vs_sync"] is not None else "-"
        busy = "  ".join(f"{r['busy'].get(k, 0):>7.0%}" if k in r["busy"] else f"{'-':>7}" for k in roles)
        cpu = r.get("cpu") or {}
        cores = "".join(f"{cpu[k]:>7.2f}" if cpu.get(k) is not None else f"{'-':>7}" for k in ("cores", "other"))
        lines.append(f"{r['workload']:<3}{r['mode']:<8}{r['samples_per_s']:>10.1f}{r['tokens_per_s']:>10.0f}{ratio:>9}"
                     f"{r['bound']:>9.1f}  {r['bound_limit']:<14}{r['efficiency']:>6.0%}  {busy}{cores}")
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
        pairs = [(r["mode"], a[r["mode"]], r["runs"]) for r in report["rows"] if r["workload"] == "b" and r["mode"] in a]
        if pairs:
            lines.append("(b) / (a) in each round (run side by side): " + "; ".join(
                f"{mode} " + " ".join(f"{y / x:.0%}" for x, y in zip(ra, rb)) for mode, ra, rb in pairs))
    return "\n".join(lines)
