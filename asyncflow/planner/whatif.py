"""What-if at the published scale: sync vs stream vs async for 7B / 32B on 32..1024 devices.

Everything here is an **assumption** (we have no NPU cluster): the device sheet and
utilisations of :mod:`asyncflow.planner.costs` (``ASSUMPTIONS``), and the workload below.
The simulator is the same one that is validated against measured CPU runs.

* global batch fixed at ``PROMPTS`` prompts x ``GROUP`` answers per step (strong scaling,
  as when a recipe is moved to more devices), prompts of ``PROMPT_LEN`` tokens;
* long-tailed answer lengths ``LENGTHS`` (DeepScaleR-like maths reasoning, 8k cap),
  simulated in chunks of ``CHUNK`` tokens;
* rollout instances of ``TP[model]`` devices with ``SLOTS[model]`` sequences each;
  the trainer packs sequences (no padding) and also runs the old-policy and reference
  forward passes (verl-style step);
* ``sync``: every device does every phase (colocated, weights resharded each step);
  ``stream`` / ``async``: devices split between rollout and actor, the best split of
  ``SPLITS`` is reported; async with staleness 1 (as the paper runs).

Run ``python -m asyncflow.planner.whatif`` to print the tables of docs/planner.md.
"""

from __future__ import annotations

from asyncflow.planner.costs import DEVICES, MODELS, AnalyticCost
from asyncflow.planner.sim import Allocation, Workload, simulate

PROMPTS, GROUP, PROMPT_LEN, CHUNK, STEPS = 512, 8, 256, 512, 5
LENGTHS = {512: 0.15, 1024: 0.20, 2048: 0.25, 4096: 0.25, 8192: 0.15}
TP = {"7b": 2, "32b": 4}
SLOTS = {"7b": 256, "32b": 128}
SPLITS = (0.375, 0.5, 0.625, 0.75)
MICRO = 32  # prompts per streamed micro-batch
DEVICE_COUNTS = (32, 64, 128, 256, 512, 1024)


def workload(steps: int = STEPS, prompts: int = PROMPTS) -> Workload:
    return Workload(prompts_per_step=prompts, group_size=GROUP, prompt_len=PROMPT_LEN, lengths=LENGTHS,
                    steps=steps, token_chunk=CHUNK, packed=True)


def run_mode(model: str, devices: int, mode: str, device: str = "ascend-910b", micro: int = MICRO,
             steps: int = STEPS, prompts: int = PROMPTS, splits=SPLITS) -> tuple[float, Allocation]:
    """Best simulated samples/s of ``mode`` (over the device splits) and its allocation."""
    tp, wl = TP[model], workload(steps, prompts)
    if mode == "sync":
        cost = AnalyticCost(MODELS[model], DEVICES[device], tp=tp, colocated=True)
        a = Allocation("sync", devices, devices, micro, 0, (devices // tp) * SLOTS[model])
        return simulate(wl, a, cost).samples_per_s, a
    cost = AnalyticCost(MODELS[model], DEVICES[device], tp=tp)
    best = (0.0, None)
    for f in splits:
        roll = max(tp, int(devices * f) // tp * tp)
        a = Allocation(mode, roll, devices - roll, micro, 1, (roll // tp) * SLOTS[model])
        best = max(best, (simulate(wl, a, cost).samples_per_s, a), key=lambda x: x[0])
    return best


def table(models=("7b", "32b"), counts=DEVICE_COUNTS, **kw) -> list[dict]:
    rows = []
    for m in models:
        for n in counts:
            sync, _ = run_mode(m, n, "sync", **kw)
            stream, sa = run_mode(m, n, "stream", **kw)
            asyn, aa = run_mode(m, n, "async", **kw)
            rows.append({"model": m, "devices": n, "sync": sync, "stream": stream, "async": asyn,
                         "stream_x": stream / sync, "async_x": asyn / sync,
                         "split": f"{aa.rollout_res}/{aa.actor_res}"})
    return rows


def ablation(model: str = "7b", devices: int = 512, **kw) -> dict[str, float]:
    """The paper's ablation: task-separated one task at a time -> + streaming -> + async."""
    base, _ = run_mode(model, devices, "stream", micro=PROMPTS, **kw)  # whole-batch hand-offs
    streaming, _ = run_mode(model, devices, "stream", **kw)
    asyn, _ = run_mode(model, devices, "async", **kw)
    sync, _ = run_mode(model, devices, "sync", **kw)
    return {"task-separated, one task at a time": 1.0, "+ streaming data plane": streaming / base,
            "+ async workflow (staleness 1)": asyn / base, "(colocated sync, for reference)": sync / base}


def format_tables(rows: list[dict], abl: dict[str, float]) -> str:
    out = ["| model | devices | sync samples/s | stream | async | stream / sync | async / sync "
           "| async split (rollout/actor) |",
           "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['model'].upper()} | {r['devices']} | {r['sync']:.1f} | {r['stream']:.1f} "
                   f"| {r['async']:.1f} | {r['stream_x']:.2f}x | {r['async_x']:.2f}x | {r['split']} |")
    ax = [r["async_x"] for r in rows]
    out += ["", f"async / sync: average {sum(ax) / len(ax):.2f}x, peak {max(ax):.2f}x "
            f"({next(r['model'].upper() + ' on ' + str(r['devices']) for r in rows if r['async_x'] == max(ax))})", "",
            "| ablation (7B, 512 devices) | normalized throughput |", "|---|---:|"]
    out += [f"| {k} | {v:.2f} |" for k, v in abl.items()]
    return "\n".join(out)


if __name__ == "__main__":
    print(format_tables(table(), ablation()))
