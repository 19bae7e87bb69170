"""Progress bar, busy fractions, CPU use and the end-of-run summary.

Busy fraction of a role = seconds it spent computing / wall seconds of the RL phase,
from two snapshots of the workers' counters (so warm-up and evaluation before the first
step are not counted). *On a core* (``on_cpu``): the share of that computing time the
role's thread actually ran (CPU seconds / wall seconds of its compute sections); the rest
it was preempted by other threads and processes on its core.

CPU use (``cpu`` in the summary, same window): ``cores`` = cores the whole machine kept
busy (``/proc/stat``: every process, not only this job's; ``None`` where it is absent),
``roles`` = CPU of the worker processes (each worker reports its process's CPU time;
roles sharing a process are counted once, under their joined names), ``other`` =
``cores`` minus ``roles``: the data plane, the weight store, the driver, Ray's own
processes and anything else running. With two cores, ``cores`` near 2 says no idle CPU
was left for a mode to use.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from asyncflow.observe.drift import planner_line
from asyncflow.observe.episodes import episode_counts, episode_line
from asyncflow.observe.ttrl import VoteMeter, vote_line, vote_summary

if TYPE_CHECKING:
    from asyncflow.config import RunConfig

PERCENT = ("exact match", "accuracy")  # held-out metrics that are fractions of problems right


def fmt_metric(name: str | None, value: float) -> str:
    """A held-out figure as its metric reads: a percentage for exact match / accuracy, else 3 decimals."""
    return f"{value:.1%}" if name in PERCENT else f"{value:.3f}"


class Progress:
    """The warm-start and the RL steps: tqdm bars on a terminal; without one (a file, a CI log)
    one plain line every ``every_s`` seconds and at the last step, instead of carriage-return
    updates; silent when disabled. ``metric`` names the held-out figure (exact match,
    accuracy, mean reward or a user metric)."""

    bar: Any  # tqdm bars, None until started
    _ws: Any

    def __init__(self, steps: int, enabled: bool = True, metric: str = "exact match", tty: bool | None = None,
                 every_s: float = 10.0):
        self.steps, self.enabled, self.bar, self._ws = steps, enabled, None, None
        self.metric = metric
        self._acc: float | None = None
        self._ws_acc: tuple[int, float] | None = None  # (SFT step, held-out metric) of the last evaluation
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.every_s, self._last = every_s, -every_s

    def _line(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.every_s:
            self._last = now
            print(text, file=sys.stderr, flush=True)

    def warmstart(self, step: int, acc: float | None, loss: float) -> None:
        """SFT step ``step`` (the model's count: it goes back at a landing rewind, see :meth:`note`)."""
        if not self.enabled:
            return
        if acc is not None:
            self._ws_acc = (step, acc)
        if not self.tty:
            held = ""
            if self._ws_acc is not None:
                at, last = self._ws_acc
                held = f", held-out {self.metric} {fmt_metric(self.metric, last)}" + (f" (at step {at})" if at != step
                                                                                        else "")
            self._line(f"warm-start (SFT) step {step}: loss {loss:.3f}{held}", force=acc is not None)
            return
        if self._ws is None:
            self._ws = tqdm(desc="warm-start (SFT)", unit="step", leave=False, file=sys.stderr)
        self._ws.update(step - self._ws.n)
        post = {"loss": f"{loss:.3f}"}
        if self._ws_acc is not None:
            post["heldout"] = fmt_metric(self.metric, self._ws_acc[1])
        self._ws.set_postfix(post)

    def note(self, text: str) -> None:
        """One line that explains a jump (a warm-start rewind), above the bars on a terminal."""
        if not self.enabled:
            return
        if self.tty and (self._ws is not None or self.bar is not None):
            tqdm.write(text, file=sys.stderr)
        else:
            self._line(text, force=True)

    def start(self, acc0: float | None) -> None:
        if self._ws is not None:
            self._ws.close()
        self._acc = acc0
        if not self.enabled:
            return
        if not self.tty:
            held = f", held-out {self.metric} {fmt_metric(self.metric, acc0)}" if acc0 is not None else ""
            self._line(f"RL: {self.steps} steps{held}", force=True)
            return
        from tqdm import tqdm  # lazy: only with a terminal (the plain-line progress needs none)

        self.bar = tqdm(total=self.steps, desc="RL", unit="step", file=sys.stderr)
        if acc0 is not None:
            self.bar.set_postfix({self.metric: fmt_metric(self.metric, acc0)})

    def update(self, m: dict) -> None:
        if not self.enabled:
            return
        fresh = m.get("heldout_acc")
        self._acc = fresh if fresh is not None else self._acc
        post = {"reward": f"{m['reward']:.2f}", "samples/s": f"{m['samples_per_s']:.1f}",
                "tokens/s": f"{m['tokens_per_s']:.0f}", "stale": m.get("max_staleness", 0)}
        if "value_loss" in m:  # PPO's critic
            post.update(vf_loss=f"{m['value_loss']:.3f}", ev=f"{m['explained_var']:.2f}")
        if self._acc is not None:
            post[self.metric] = fmt_metric(self.metric, self._acc)
        if not self.tty:
            step = m.get("step", 0)
            self._line(f"RL step {step}/{self.steps}: " + ", ".join(f"{k} {v}" for k, v in post.items()),
                       force=fresh is not None or step in (1, self.steps))
        elif self.bar is not None:
            self.bar.set_postfix(post)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def busy_fractions(before: dict, after: dict) -> dict[str, float]:
    out = {}
    for role, s in after.items():
        b = before.get(role, {"busy_s": 0.0, "wall_s": 0.0})
        wall = s["wall_s"] - b["wall_s"]
        out[role] = (s["busy_s"] - b["busy_s"]) / wall if wall > 0 else 0.0
    return out


def on_cpu(before: dict, after: dict) -> dict[str, float]:
    """Per role: the fraction of its computing time its thread was on a core (CPU seconds
    in its compute sections / their wall seconds; below 1: others ran there meanwhile)."""
    busy = {role: s.get("busy_s", 0.0) - before.get(role, {}).get("busy_s", 0.0) for role, s in after.items()}
    return {role: cpu / busy[role] for role, cpu in busy_cpu_seconds(before, after).items() if busy[role] > 0}


def busy_cpu_seconds(before: dict, after: dict) -> dict[str, float]:
    """Per role: CPU seconds its thread got in its compute sections between two snapshots."""
    return {role: s["busy_cpu_s"] - before.get(role, {}).get("busy_cpu_s", 0.0)
            for role, s in after.items() if "busy_cpu_s" in s}


def machine_cpu_s() -> float | None:
    """CPU seconds the machine has spent busy since boot (all cores), or None."""
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = f[3] + (f[4] if len(f) > 4 else 0)  # idle + iowait
    guest = sum(f[8:10])  # guest time is already counted in user / nice
    return (sum(f) - idle - guest) / os.sysconf("SC_CLK_TCK")


def cpu_use(before: dict, after: dict, machine: tuple, wall: float) -> dict:
    """Cores used between two snapshots: the machine's, per worker process, and the rest."""
    procs: dict = {}
    for role, s in after.items():
        if "cpu_s" in s and role in before:
            procs.setdefault(s.get("pid"), ([], s["cpu_s"] - before[role].get("cpu_s", 0.0)))[0].append(role)
    roles = {"+".join(names): d / wall for names, d in procs.values()} if wall > 0 else {}
    m0, m1 = machine
    cores = (m1 - m0) / wall if m0 is not None and m1 is not None and wall > 0 else None
    return {"cores": cores, "roles": roles,
            "other": cores - sum(roles.values()) if cores is not None else None}


class RunMeter:
    """Counts samples and tokens per step and times the run, whole and after step 1.

    Step 1 warms up kernels, allocators and caches of every process, so the *steady*
    figures (samples/s, tokens/s, busy fractions) start at its end; both are reported.
    ``stats`` returns the workers' counters (``role -> {busy_s, wall_s, ...}``). With
    ``drops`` (dynamic sampling) every step also reads rollout's group counters and reports
    ``groups_dropped`` / ``drop_rate``: groups dropped (all rewards equal) over groups
    scored since the previous step. With ``stragglers`` (``rollout.overprovision``) every step
    reports ``groups_carried`` / ``groups_restarted`` since the previous step likewise. With
    ``votes`` (``reward.mode=majority``) every step reports the majority-vote figures of
    :mod:`asyncflow.observe.ttrl` (``majority_ratio``, ``pseudo_label_acc``...). A
    resumed run's counters continue the checkpoint's: ``since`` (rollout's counters there, as
    :func:`~asyncflow.workflow.rollout.inflight.capture` saved them) is where its first step counts from.
    """

    def __init__(self, stats: Callable[[], dict], drops: bool = False, stragglers: bool = False,
                 since: dict[str, int] | None = None, votes: bool = False):
        c = since or {}
        self.stats, self.drops, self._groups = stats, drops, (c.get("scored", 0), c.get("dropped", 0))
        self.stragglers, self._stragglers = stragglers, (c.get("carried", 0), c.get("stalls", 0))
        self.votes = VoteMeter() if votes else None  # reward.mode=majority: each step's vote figures
        # the clock and the machine's CPU are read together, before the workers' stats (a round trip
        # to every worker): CPU spent in between would fall outside the wall-clock window
        self.t0, self.cpu0 = time.perf_counter(), machine_cpu_s()
        self.stats0 = stats()
        self.steps = self.samples = self.tokens = 0
        # (time, stats, samples, tokens, machine cpu) at the end of step 1
        self.steady0: tuple[float, dict, int, int, float | None] | None = None

    def step(self, m: dict) -> dict:
        """Add one step's metrics (``samples``, ``tokens``); return them with rates added."""
        self.steps += 1
        self.samples, self.tokens = self.samples + m["samples"], self.tokens + m["tokens"]
        elapsed = time.perf_counter() - self.t0
        if self.steady0 is None:
            t, cpu = time.perf_counter(), machine_cpu_s()
            self.steady0 = (t, self.stats(), self.samples, self.tokens, cpu)
        every = self.stats() if self.drops or self.stragglers or self.votes else {}
        r = every.get("rollout", {})
        if self.votes is not None:
            m = {**m, **self.votes.step(every)}
        if self.stragglers:
            carried, restarted = r.get("groups_carried", 0), r.get("groups_restarted", 0)
            m = {**m, "groups_carried": carried - self._stragglers[0],
                 "groups_restarted": restarted - self._stragglers[1]}
            self._stragglers = (carried, restarted)
        if self.drops:
            scored, dropped = r.get("groups_scored", 0), r.get("groups_dropped", 0)
            d_scored, d_dropped = scored - self._groups[0], dropped - self._groups[1]
            self._groups = (scored, dropped)
            m = {**m, "groups_dropped": d_dropped, "drop_rate": d_dropped / d_scored if d_scored else 0.0}
        return {**m, "step": self.steps, "elapsed_s": elapsed, "samples_per_s": self.samples / max(elapsed, 1e-9),
                "tokens_per_s": self.tokens / max(elapsed, 1e-9)}

    def finish(self) -> dict:
        """Totals for :func:`summarize`: whole run, and steady state (after step 1)."""
        wall, cpu = time.perf_counter() - self.t0, machine_cpu_s()
        stats = self.stats()
        t1, stats1, s1, k1, c1 = (self.steady0 if self.steps > 1 and self.steady0 is not None
                                  else (self.t0, self.stats0, 0, 0, self.cpu0))
        steady_wall = wall - (t1 - self.t0)
        return {"samples": self.samples, "tokens": self.tokens, "wall_s": wall, "stats": stats,
                "steady_samples": self.samples - s1, "steady_tokens": self.tokens - k1,
                "steady_wall_s": steady_wall, "busy": busy_fractions(stats1, stats),
                "on_cpu": on_cpu(stats1, stats), "busy_cpu_s": busy_cpu_seconds(stats1, stats),
                "cpu": cpu_use(stats1, stats, (c1, cpu), steady_wall)}


def summarize(cfg: RunConfig, init: dict, acc0: float | None, acc1: float | None, totals: dict, run_dir: Path,
              ckpt: str) -> dict:
    """The end-of-run summary (``summary.json``) from :meth:`RunMeter.finish` totals."""
    actor = totals["stats"].get("actor", {})
    rollout = totals["stats"].get("rollout", {})
    dyn = {}
    if "groups_dropped" in rollout:  # dynamic sampling
        n, d = rollout["groups_scored"], rollout["groups_dropped"]
        dyn = {"dynamic_sampling": {"groups_scored": n, "groups_dropped": d, "drop_rate": d / n if n else 0.0}}
    if cfg.rollout.overprovision:  # stragglers carried into a later step / restarted from the prompt
        dyn["overprovision"] = {"extra_groups": cfg.rollout.overprovision,
                                "groups_carried": rollout.get("groups_carried", 0),
                                "groups_restarted": rollout.get("groups_restarted", 0),
                                "answers_discarded": rollout.get("discarded", 0),
                                "decode_steps": rollout.get("decode_steps", 0)}
    samples, tokens, wall, s_wall = totals["samples"], totals["tokens"], totals["wall_s"], totals["steady_wall_s"]
    return {
        "mode": cfg.mode, "staleness_bound": cfg.effective_staleness, "steps": cfg.train.steps,
        "device": cfg.resources.device,
        "init": init, "heldout_metric": totals.get("heldout_metric"), "heldout_acc_before": acc0,
        "heldout_acc_after": acc1,
        "samples": samples, "tokens": tokens, "wall_s": wall,
        "samples_per_s": samples / wall if wall else 0.0, "tokens_per_s": tokens / wall if wall else 0.0,
        "steady_samples_per_s": totals["steady_samples"] / s_wall if s_wall else 0.0,
        "steady_tokens_per_s": totals["steady_tokens"] / s_wall if s_wall else 0.0,
        "steady_samples": totals["steady_samples"],
        "busy": totals["busy"], "on_cpu": totals.get("on_cpu", {}), "busy_cpu_s": totals.get("busy_cpu_s", {}),
        "cpu": totals["cpu"], "max_staleness": actor.get("max_staleness", 0),
        "staleness_hist": actor.get("staleness_hist", {}), "dropped_stale": actor.get("dropped_stale", 0),
        "rollout_decode_steps": rollout.get("decode_steps", 0), "rollout_swaps": rollout.get("swaps", 0),
        **reward_counts(totals["stats"]), **vote_summary(totals["stats"]), **episode_counts(totals["stats"]),
        "run_dir": str(run_dir), "checkpoint": ckpt, "pinned": totals.get("pinned", {}), **dyn,
        # task.on_bad_row=skip: bad dataset rows skipped, and the first of them (file:line: what is wrong)
        "skipped_rows": totals.get("skipped_rows", 0), "skipped_first": totals.get("skipped_first"),
    }


FN_ERRORS = ("reward_exception", "reward_timeout", "reward_non_number", "reward_wrong_length")


def _reward_source(stats: dict) -> dict:
    """The stats that carry the reward function's counters: the reward role's, else rollout's."""
    return stats.get("reward") or stats.get("rollout", {})


def reward_counts(stats: dict) -> dict:
    """``reward_errors``: answers whose reward failed and scored ``reward.on_error``, one figure = a
    configured reward.fn's counters by kind (``reward_fn``) + failures of a task's own reward;
    ``reward_first_error``: what the first failure was (one line), or None."""
    src, rollout = _reward_source(stats), stats.get("rollout", {})
    fn = {k: v for k, v in src.items() if k.startswith(("reward_", "score_")) and k != "reward_errors"}
    own = stats.get("reward", {}).get("errors", 0) + rollout.get("reward_errors", 0)
    fails = reward_failures(stats)  # a traceback's last line says what was raised
    first = next((ln.strip() for ln in reversed(fails[0].splitlines()) if ln.strip()), None) if fails else None
    # a configured reward.fn: calls, errors by kind (exception/timeout/non_number), named score means
    return {"reward_errors": own + sum(fn.get(k, 0) for k in FN_ERRORS),
            "reward_first_error": first[:200] if first else None, "reward_fn": fn}


def reward_failures(stats: dict) -> list[str]:
    """The first few failures of a configured reward.fn: each a traceback, or what went wrong."""
    return list(_reward_source(stats).get("failures", []))


def reward_error_line(s: dict, log: Path | None) -> str | None:
    """One line on the rewards that failed (None when none did): count, the first error, the log."""
    n = s.get("reward_errors", 0)
    if not n:
        return None
    calls = s["reward_fn"].get("reward_calls")
    of = f" of {calls}" if calls else ""
    first = f"; first: {s['reward_first_error']}" if s.get("reward_first_error") else ""
    where = f" (tracebacks of the first few: {log})" if log is not None else ""
    return f"asyncflow: warning: the reward failed on {n}{of} answers, scored as reward.on_error{first}{where}"


def format_summary(s: dict) -> str:
    acc = ""
    if s["heldout_acc_before"] is not None:
        name, a, b = s.get("heldout_metric") or "accuracy", s["heldout_acc_before"], s["heldout_acc_after"]
        d = f"{(b - a) * 100:+.1f} points" if name in PERCENT else f"{b - a:+.3f}"
        acc = f"{'held-out ' + name:<18} {fmt_metric(name, a)} -> {fmt_metric(name, b)} ({d})\n"
    if s.get("heldout_evals"):  # (train.eval_overlap: evaluations beside training)
        e = s["heldout_evals"]
        acc += (f"evaluations        {e['done']} beside training ({e.get('skipped', 0)} skipped while one ran, "
                f"{e.get('late', 0)} late, {e['failed']} failed, {e['abandoned']} unfinished at the end)\n")
    acc += episode_line(s)  # (multi-turn)
    if s.get("skipped_rows"):
        acc += f"bad rows skipped   {s['skipped_rows']} (task.on_bad_row=skip); first: {s['skipped_first']}\n"
    busy = "  ".join(f"{k} {v:.0%}" for k, v in s["busy"].items())
    oncpu = "  ".join(f"{k} {v:.0%}" for k, v in s.get("on_cpu", {}).items())
    oncpu = f"on a core          {oncpu} of the busy time (the rest: preempted)\n" if oncpu else ""
    cpu, cores = s["cpu"], ""
    if cpu["cores"] is not None:
        cores = (f"cpu (cores)        {cpu['cores']:.2f} used on the machine: "
                 + ", ".join(f"{k} {v:.2f}" for k, v in cpu["roles"].items()) + f", other {cpu['other']:.2f} "
                 "(after step 1)\n")
    if s.get("pinned"):  # resources.pin_cores: where each compute role's compute thread ran
        cores += "pinned cores       " + ", ".join(f"{k} {v}" for k, v in s["pinned"].items()) + "\n"
    ws = s["init"]
    init = ""
    if ws.get("source") == "warmstart":
        how = "cached" if ws["cached"] else f"{ws['seconds']:.0f} s"
        name = s.get("heldout_metric") or "accuracy"  # the same metric, in the same unit, as the held-out line
        again = f", {ws['replayed']} more replayed to land near the target" if ws.get("replayed") else ""
        init = (f"warm-start         SFT to held-out {name} {fmt_metric(name, ws['accuracy'])} in {ws['steps']} steps"
                f"{again} ({how})\n")
    acc += vote_line(s)
    if "dynamic_sampling" in s:
        d = s["dynamic_sampling"]
        acc += (f"dynamic sampling   dropped {d['groups_dropped']} of {d['groups_scored']} groups "
                f"({d['drop_rate']:.1%}: all rewards equal)\n")
    if "overprovision" in s:
        o = s["overprovision"]
        acc += (f"over-provisioning  {o['extra_groups']} extra groups: {o['groups_carried']} stragglers carried "
                f"over, {o['groups_restarted']} restarted ({o['answers_discarded']} answers thrown away)\n")
    if s.get("checkpoint_pause_s") or s.get("resumed_from"):
        p = sorted(s.get("checkpoint_pause_s") or [0.0])
        acc += (f"checkpoints        {len(s.get('checkpoint_pause_s') or [])} resumable written (checkpoints/), "
                f"median pause {p[len(p) // 2] * 1e3:.0f} ms"
                + (f"; resumed after step {s['resumed_from']}" if s.get("resumed_from") else "") + "\n")
    if (k := s.get("checkpoint_kept")) and k["kept"] == "best":  # train.keep_best
        name = s.get("heldout_metric") or "accuracy"
        acc += (f"checkpoint/        the best evaluated weights: after step {k['version']}, held-out "
                f"{fmt_metric(name, k['heldout_acc'])} (the last, {fmt_metric(name, k['last_heldout_acc'])}, "
                f"is in checkpoint-last/)\n")
    on = f" on {s['device']}" if s.get("device", "cpu") != "cpu" else ""
    return (f"\n== asyncflow {s['mode']} (staleness bound {s['staleness_bound']}){on} ==\n" + init + acc +
            f"throughput         {s['samples_per_s']:.1f} samples/s, {s['tokens_per_s']:.0f} response tokens/s "
            f"({s['samples']} samples in {s['wall_s']:.1f} s; "
            f"after step 1: {s['steady_samples_per_s']:.1f} samples/s)\n"
            + planner_line(s) +
            f"busy fraction      {busy} (after step 1)\n" + oncpu + cores +
            f"staleness          max {s['max_staleness']} (histogram {s['staleness_hist']}), "
            f"dropped {s['dropped_stale']}\n"
            f"run folder         {s['run_dir']}  (metrics.jsonl, summary.json, trace.json, checkpoint/)\n")
