"""``asyncflow`` command line: ``train``, ``bench``, ``profile``, ``plan``.

Heavy modules (torch, transformers, ray) are imported only inside the commands, so
``--help`` and ``--dry-run`` are instant. A user mistake (bad config, bad override,
missing file) prints one line ``asyncflow: error: ...`` and exits 2, without a traceback.
A crash (a role's error, a lost worker process, a stalled step) prints one line too, naming
where it happened, the root cause and its ``file:line``, and exits 1; the tracebacks are in
``<run_dir>/error.log`` (:mod:`asyncflow.workflow.failure`). A lost process or a stalled step
first restarts the run from its checkpoint (``train.max_restarts``, one line on stderr each).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from asyncflow.config import ConfigError, RunConfig, dump_config, load_config
from asyncflow.config.files import check_files
from asyncflow.workflow.failure import LOG, one_line  # light: no torch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncflow", description="Asynchronous streaming RL post-training for LLMs.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run a training job (default: built-in GRPO example, async mode, local Ray)")
    t.add_argument("config", nargs="?", help="YAML config file (optional)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=20 mode=sync")
    t.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue RUN_DIR from its latest checkpoint (its config.yaml, overriding train.steps only)")
    t.add_argument("--dry-run", action="store_true",
                   help="print the resolved config and exit (plan=auto: the plan too, profiling first if needed)")
    b = sub.add_parser("bench", help="compare sync, stream and async on the same resources")
    b.add_argument("config", nargs="?", help="YAML config file (optional)")
    b.add_argument("overrides", nargs="*", help="key=value overrides applied to every run")
    b.add_argument("--samples", type=int, default=None, help="samples per measured run (default from the bench preset)")
    b.add_argument("--workloads", default="a,b", help="comma list: a (compute-bound, "
                                                      "long-tailed), b (+ remote reward latency)")
    b.add_argument("--modes", default="sync,sync:dp,stream,async,async:2",
                   help="comma list of modes; async:K runs async with staleness bound K; sync:dp runs sync with "
                        "one 1-thread data-parallel rank per CPU (vs sync divides by the faster sync variant)")
    b.add_argument("--repeat", type=int, default=2,
                   help="runs of each mode (and of each role alone); each row shows the fastest (default 2)")
    b.add_argument("--out", default=None, help="write the results as JSON here (default: the bench folder)")
    b.add_argument("--quality", action="store_true",
                   help="instead: held-out accuracy of sync and async after the same number of samples")
    b.add_argument("--seeds", default=None,
                   help="--quality: comma list of seeds, each trained in both modes (default: the config's seed)")
    for name, text in (("profile", "measure this machine's per-role cost curves (JSON, under a minute)"),
                       ("plan", "choose mode, threads, micro-batch and staleness by simulation")):
        q = sub.add_parser(name, help=text)
        q.add_argument("config", nargs="?", help="YAML config file (optional)")
        q.add_argument("overrides", nargs="*", help="key=value overrides")
        q.add_argument("--profile", default="runs/profile.json",
                       help="profile JSON to write (profile) or read (plan; measured first if missing)")
        q.add_argument("--cpus", type=int, default=None, help="CPU budget (default: this machine's cores)")
        q.add_argument("--trace", default=None, help="plan: write a Chrome trace (Perfetto) of the planned run here")
        q.add_argument("--gantt", default=None, help="plan: write a PNG Gantt chart of "
                                                     "the planned run here (needs [plot])")
    return p


def _planner(args: argparse.Namespace, cfg: RunConfig) -> int:
    from asyncflow.planner.profile import run_profile  # lazy: numpy and the profiler, keeps --help fast

    if args.command == "profile" or not os.path.exists(args.profile):
        run_profile(cfg, out=args.profile, cpus=args.cpus)
    if args.command == "plan":
        from asyncflow.planner.search import plan  # lazy: numpy and the simulator, keeps --help fast

        print(plan(cfg, args.profile, cpus=args.cpus, trace=args.trace, gantt=args.gantt))
    return 0


def _split(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """Allow ``asyncflow train key=value`` without a config file."""
    if config is not None and "=" in config and not os.path.exists(config):
        return None, [config, *overrides]
    return config, overrides


def _seeds(text: str | None) -> list[int] | None:
    try:
        return [int(x) for x in text.split(",")] if text else None
    except ValueError:
        raise ConfigError(f"bench --seeds takes a comma list of integers, e.g. 0,1,2; got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download at run time
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # per-worker load bars hide ours
    try:
        config, overrides = _split(args.config, args.overrides)
        resume = getattr(args, "resume", None)
        if resume is not None and config is None:  # the run's own config
            config = os.path.join(resume, "config.yaml")
            if not os.path.isfile(config):
                raise ConfigError(f"--resume {resume}: {config} not found (not a run folder)")
        cfg = load_config(config, overrides)
        if args.command == "train":
            if cfg.plan == "auto":
                from asyncflow.planner.auto import resolve  # lazy: numpy and the planner, keeps --help fast

                cfg, text = resolve(cfg, log=lambda m: print(m, file=sys.stderr))
                print("# plan=auto\n" + "\n".join(f"# {line}".rstrip() for line in text.splitlines()), flush=True)
            check_files(cfg)  # light: a reward.fn file or data path that is not there, even with --dry-run
            if args.dry_run:
                print(dump_config(cfg), end="")
                return 0
            from asyncflow.api import train  # lazy: torch, transformers, keeps --help fast
            from asyncflow.observe.report import format_summary  # lazy: tqdm, needed only after a run

            print(format_summary(train(cfg, resume=resume)))
            return 0
        if args.command == "bench":
            from asyncflow.bench.run import run_bench  # lazy: torch and the launchers; keeps --help fast

            run_bench(cfg, config, overrides, samples=args.samples, workloads=args.workloads.split(","),
                      modes=args.modes.split(","), out=args.out, quality=args.quality,
                      repeat=args.repeat, seeds=_seeds(args.seeds))
            return 0
        if args.command in ("profile", "plan"):
            return _planner(args, cfg)
    except ConfigError as e:
        print(f"asyncflow: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("asyncflow: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        return _crashed(e)
    return 1


def _crashed(e: Exception) -> int:
    """One line for a crash (exit 1); the traceback goes to stderr only when no error.log has it."""
    if getattr(e, LOG, None) is None:
        traceback.print_exception(type(e), e, e.__traceback__)
    print(f"asyncflow: error: {one_line(e)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
