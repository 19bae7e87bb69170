"""``asyncflow bench``: sync vs stream vs async on the same resources, against their bounds.

For each workload the same job (same model, prompts, seeds) runs for a fixed number of
samples in every mode, one after another on one launcher, and then each role runs alone
(:mod:`asyncflow.bench.solo`) to give every mode its *bound*. ``sync`` runs as the
strongest synchronous baseline a user would run, in two variants with a row each:
``sync`` (one colocated worker on every core) and ``sync:dp`` (``train.dp`` = the CPUs,
capped by the prompts of a step: that many colocated ranks of one thread each, each
generating its share of the step, all training together; its bound is the 1-thread
solo phases' sum divided among the ranks). ``vs sync`` divides by the *faster* of the two.
The table (:mod:`asyncflow.bench.table`) prints measured samples/s and tokens/s, the ratio
to ``sync``, the bound and what limits it, the efficiency (measured / bound), each role's
busy fraction (a data-parallel role's ranks averaged), and the CPU the machine used
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
from typing import Any

from asyncflow.bench.solo import bound, measure_roles
from asyncflow.bench.table import SYNCS, WORKLOAD_TEXT, format_quality, format_table
from asyncflow.config import ConfigError, RunConfig
from asyncflow.launch.registry import get_launcher
from asyncflow.tasks.models import prepare_model
from asyncflow.workflow.cores import pinnable_cores
from asyncflow.workflow.driver import train
from asyncflow.workflow.launcher import Launcher
from asyncflow.workflow.plan import plan_workers

WORKLOADS: dict[str, dict[str, dict[str, Any]]] = {
    "a": {"rollout": {"gen_len": "longtail"}},
    "b": {"rollout": {"gen_len": "longtail"}, "reward": {"latency_ms": (100.0, 300.0), "concurrency": 256}},
}
PROMPTS_PER_STEP = 32  # the bench preset (see the module docstring)
SAMPLES = 4096  # per run: 16 steps of the preset, 15 timed




def parse_mode(spec: str) -> tuple[str, int | None]:
    """``"async:2"`` -> ``("async", 2)``: a mode, optionally with its staleness bound;
    ``"sync:dp"`` -> ``("sync", None)`` (the data-parallel sync variant)."""
    mode, _, k = spec.partition(":")
    if mode not in ("sync", "stream", "async") or (k and spec != "sync:dp" and (mode != "async" or not k.isdigit())):
        raise ConfigError(f"unknown bench mode {spec!r} (modes: sync, sync:dp, stream, async, async:K with K "
                          f"the staleness)")
    return mode, int(k) if k.isdigit() else None


def sync_dp(cfg: RunConfig, cpus: int) -> int:
    """``sync:dp``'s ranks: one per CPU, at most one per prompt of a step and per row of a micro-batch."""
    return max(1, min(cpus, cfg.train.prompts_per_step, cfg.train.micro_prompts * cfg.rollout.group_size))


def _variant(cfg: RunConfig, workload: str, spec: str, steps: int, run_dir: str, cpus: int = 1) -> RunConfig:
    mode, staleness = parse_mode(spec)
    data = cfg.model_dump()
    for section, values in WORKLOADS[workload].items():
        data[section].update(values)
    data.update(mode=mode, progress=False, run_dir=run_dir)
    if staleness is not None:
        data["staleness"] = staleness
    data["train"].update(steps=steps, eval_every=0)
    if spec == "sync:dp":  # one colocated rank of one thread per CPU
        data["train"]["dp"] = sync_dp(cfg, cpus)
        data["resources"]["sync_threads"] = 1
    return RunConfig.model_validate(data)


def run_bench(cfg: RunConfig, config: str | None = None, overrides: Sequence[str] = (), samples: int | None = None,
              workloads: Sequence[str] = ("a", "b"),
              modes: Sequence[str] = ("sync", "sync:dp", "stream", "async", "async:2"),
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
                train_cfg = cfg.train.model_copy(update={"prompts_per_step": PROMPTS_PER_STEP})
                cfg = cfg.model_copy(update={"train": train_cfg})
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


def _workload(cfg: RunConfig, w: str, modes: Sequence[str], steps: int, model_dir: str, launcher: Launcher,
              root: Path, train: Callable[..., dict], repeat: int = 1) -> list[dict]:
    """Every round of workload ``w``, then its rows (:func:`_rounds` driven to the end)."""
    return _finish(_rounds(cfg, w, modes, steps, model_dir, launcher, root, train, repeat))


def _finish(rounds: Generator[int, None, list[dict]]) -> list[dict]:
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
        self.cfg, self.w, self.modes, self.steps = cfg, w, modes, steps
        self.model_dir, self.launcher = model_dir, launcher
        # modes: specs, e.g. "async:2" or "sync:dp"
        self.vcfgs = {mode: _variant(cfg, w, mode, steps, str(root), launcher.cpus) for mode in modes}
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
        alone = vcfg.model_copy(update={"train": vcfg.train.model_copy(update={"dp": 1})})  # sync:dp: one rank
        self.solos.setdefault(key, []).append(measure_roles(alone, self.model_dir, self.steps, key[0], key[1],
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
            b, limit = _bound(vcfg, seconds, samples)
            row.update(solo_s=seconds, solo_runs=self.solos[key], bound=b, bound_limit=limit,
                       efficiency=row["samples_per_s"] / b)
            # each round's run against that round's own bound: the spread shows the machine's drift
            row["round_efficiency"] = [
                run["samples_per_s"] / _bound(vcfg, {role: self.in_round(role, key, i)
                                                     for role in self.solos[key][i]}, samples)[0]
                for i, run in enumerate(runs)]
            if vcfg.mode != "sync" and key[0] == 1:  # one thread per role: its thread's CPU is the role's
                row["gap"] = gap_factors(row, limit, *picked[limit], samples)
            rows.append(row)
        syncs = [r for r in rows if r["mode"] in SYNCS]
        sync = max(syncs, key=lambda r: r["samples_per_s"]) if syncs else None
        for row in rows:
            row["vs_sync"] = row["samples_per_s"] / sync["samples_per_s"] if sync else None
            row["vs"] = sync["mode"] if sync else None  # the sync variant vs_sync divides by
        return rows


def _bound(vcfg: RunConfig, seconds: dict[str, float], samples: int) -> tuple[float, str]:
    """:func:`~asyncflow.bench.solo.bound`; data-parallel sync: N ranks, each the solo phases on 1/N of the rows."""
    b, limit = bound(vcfg.mode, seconds, samples)
    n = vcfg.train.dp if vcfg.mode == "sync" else 1
    return (b * n, f"phases/{n} ranks") if n > 1 else (b, limit)


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


def _quality(cfg: RunConfig, launcher: Launcher, root: Path, train: Callable[..., dict], seeds: list[int]) -> dict:
    report: dict[str, Any] = {"quality": []}
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
