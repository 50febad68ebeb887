"""``bench/RESULTS.md`` from ``bench/results.json``: the tables the README and docs quote."""

from __future__ import annotations

from typing import Any

from bench.checksum import checksum_launches_md, checksum_md
from bench.reference import INSTANCES
from scenarios.spec.overhead import CHECKS_OFF, NONFINITE, NONFINITE_EVERY_STEP

GUARD_OFF = CHECKS_OFF.name
NF_EVERY = NONFINITE_EVERY_STEP.name


def _unit(section: dict[str, Any]) -> str:
    """What a block-timed section's bootstrap resamples."""
    return "rotations" if section.get("rotation_rounds") else "rounds"


def _over_rounds(section: dict[str, Any], what: str) -> str:
    """How a block-timed section's ``what`` (ratio, difference) is estimated: over whole
    rotations of the configurations (``bench.overhead``), or, in runs before them, over
    rounds."""
    n = section.get("rotation_rounds")
    if not n:
        return f"the median over rounds of each round's {what}"
    return (f"the median over whole rotations ({n} rounds: every configuration once in every "
            f"position of a round, which moves a block's time) of each rotation's {what} of "
            "means")


def _untimed_first(section: dict[str, Any]) -> str:
    """How a block-timed section's blocks start: after one untimed step, where it did; a run
    published before that says nothing."""
    return (" after one untimed step (the first after a switch builds the checks anew: their "
            "hooks and buffers, once in a training run)" if section.get("untimed_first") else "")


def overhead_md(ov: dict[str, Any], *, reference: bool) -> list[str]:
    lines = ["", f"## Step-time overhead: {ov['world']} ranks x 1 thread, MLP of "
             f"{ov['params']/1e6:.2f}M parameters, batch {ov['batch']}, AdamW", "",
             "Wall time is the target metric; CPU time (the rank's process, all threads) is the "
             "work the check adds, without the waits.", "",
             "The guard's configurations with a check share one model, switched block by "
             "block. The guard with its checks off runs on models of its own (it registers no "
             "comm hook; one with checks would keep it), and plain DDP trains those same models "
             f"and optimizers with a plain loop; {INSTANCES} instances of each are used in "
             "turn, round by round, so that the speed difference between two instances of the "
             "same model (1-2% here) is sampled by the intervals rather than hidden in them. "
             "The order of the configurations rotates round by round. "
             "The last column compares each check with the guard with its checks off (no comm "
             "hook: a check that reads the gradient buckets pays DDP's extra pass for any hook "
             "too).", "",
             "| configuration | median step (ms) | overhead vs plain DDP | 90% interval (bootstrap "
             "over rounds) | median CPU per step (ms) | CPU overhead | vs guard, checks off "
             "(90% interval) |",
             "|---|---|---|---|---|---|---|"]
    for name, s in ov["step_s"].items():
        lo, hi = ov["overhead_interval_90"].get(name, (0.0, 0.0))
        same = ""
        if name in ov.get("overhead_vs_guard_off", {}):
            glo, ghi = ov["vs_guard_off_interval_90"][name]
            same = (f"{ov['overhead_vs_guard_off'][name]*100:+.1f}% "
                    f"({glo*100:+.1f}% .. {ghi*100:+.1f}%)")
        lines.append(f"| {name} | {s*1e3:.2f} | {ov['overhead_vs_plain_ddp'][name]*100:+.1f}% | "
                     f"{lo*100:+.1f}% .. {hi*100:+.1f}% | {ov['step_cpu_s'][name]*1e3:.2f} | "
                     f"{ov['cpu_overhead_vs_plain_ddp'][name]*100:+.1f}% | {same} |")
    d = ov["direct_s"]
    lines += ["", "Parts measured directly (after a barrier; parameters + AdamW state = "
              f"{ov['state_bytes']/2**20:.1f} MiB):", "", "| part | median (ms) |", "|---|---|"]
    for name, s in d.items():
        lines.append(f"| {name} | {s*1e3:.3f} |")
    target = " (target <= 2%)" if reference else ""
    lines += ["", "nonfinite, measured directly (the fused pass minus the scaling pass, the "
              "reduced-result check, and sending the flags word, once every "
              f"{ov.get('nonfinite_exchange_interval', 1)} steps) = "
              f"**{ov['nonfinite_direct_fraction_of_plain_step']*100:.1f}%** of a plain DDP step"
              f"{target}; in step time **{ov['overhead_vs_plain_ddp'][NONFINITE.name]*100:+.1f}%**"
              " vs plain DDP and "
              f"**{ov['overhead_vs_guard_off'][NONFINITE.name]*100:+.1f}%** vs the guard with its "
              "checks off (which has no comm hook), in CPU time "
              f"**{ov['cpu_overhead_vs_plain_ddp'][NONFINITE.name]*100:+.1f}%**."]
    if NF_EVERY in ov["overhead_vs_guard_off"]:
        lines += ["With its flags sent every step (`nonfinite_exchange_interval=1`: a word nobody "
                  "waits for, but a collective all the same): "
                  f"**{ov['overhead_vs_guard_off'][NF_EVERY]*100:+.1f}%** vs the guard with its "
                  "checks off."]
    lines.append("")
    bl = ov.get("blocks")
    if bl:
        lines += [f"Timed as a training loop runs: blocks of {bl['block']} steps"
                  + _untimed_first(bl)
                  + f" with no barrier between the steps, {bl['rounds']} rounds, the order "
                  "rotating; " + _over_rounds(bl, "ratio") + " to the guard with its checks off "
                  "(a barrier per "
                  "step, as in the table above, adds two meeting points per step and lines the "
                  "ranks' phases up, which on 3 ranks sharing 2 cores magnifies any extra work):",
                  "", "| configuration | median step (ms) | vs guard, checks off | 90% interval "
                  f"(bootstrap over {_unit(bl)}) | CPU vs guard, checks off |",
                  "|---|---|---|---|---|"]
        for name, sec in bl["step_s"].items():
            if name == GUARD_OFF:
                lines.append(f"| {name} | {sec*1e3:.2f} | | | |")
                continue
            lo, hi = bl["vs_guard_off_interval_90"][name]
            lines.append(f"| {name} | {sec*1e3:.2f} | **{bl['vs_guard_off'][name]*100:+.1f}%** | "
                         f"{lo*100:+.1f}% .. {hi*100:+.1f}% | "
                         f"{bl['cpu_vs_guard_off'][name]*100:+.1f}% |")
        lines.append("")
    target = " (target <= 1.5x)" if reference else ""
    lines += ["weights verdict / (fingerprint then all_gather, timed as one) = "
              f"**{ov['weights_cost_ratio_to_timed_ideal']:.2f}x**{target}; / (sum of the two "
              f"medians) = {ov['weights_cost_ratio']:.2f}x; (local fingerprint + all_gather) / "
              f"(flat fingerprint + all_gather) = {ov['weights_local_cost_ratio']:.2f}x.", ""]
    return lines


def guard_off_md(go: dict[str, Any], *, reference: bool) -> list[str]:
    """The guard with its checks off beside plain DDP (``bench.overhead.check_guard_off``)."""
    target = " (target: within 0.5% of plain DDP)" if reference else ""
    configs = go.get("configs") or [""] * 4
    alloc = go.get("allocator") or {}
    if alloc:
        title = (f"## The same with glibc's heap trimming off: {go['world']} ranks, "
                 f"batch {go['batch']}")
        intro = [f"Each rank first sets glibc's "
                 f"{', '.join(f'`mallopt({k}, {v})`' for k, v in alloc.items())} (what "
                 "docs/usage.md advises for CPU training as `MALLOC_*` variables: freed "
                 "memory stays with the process, so no step faults its pages back in), "
                 + ("bucket views on both sides" if len(configs) == 2 else
                    "each DDP construction on both sides")
                 + f"; {go['rounds']} rounds{_launches(go)}. What is left is the guard's own "
                 "work."]
    else:
        title = (f"## The guard with its checks off beside plain DDP: {go['world']} ranks, "
                 f"batch {go['batch']}")
        intro = [f"Blocks of {go['block']} steps"
                 + _untimed_first(go)
                 + " with no barrier between the steps, "
                 f"{go['rounds']} rounds{_launches(go)}, the order of the {len(configs)} "
                 "configurations rotating; each DDP construction on both sides. No check reads "
                 "the gradient buckets, so the guard registers no comm hook and DDP keeps its "
                 "built-in all-reduce (any hook costs DDP a pass of its own: docs/architecture.md)."
                 + (" glibc's allocator as it comes: it gives the top of its heap back to the "
                    "system and the next step faults those pages in again, a number that "
                    "moves with each loop's pattern of allocations (the page faults below)."
                    if go.get("page_faults_per_step") else "")]
    over = " over launches" if go.get("launches", 1) > 1 else ""
    lines = ["", title, "", *intro, "",
             "Step time: " + _over_rounds(go, "ratio") + f" (90% bootstrap interval{over})"
             + target + ":", "",
             "| guard, checks off / plain DDP | ratio - 1 | 90% interval |", "|---|---|---|"]
    for pair, (r, (lo, hi)) in go["guard_off_vs_plain"].items():
        lines.append(f"| {pair} | **{r*100:+.2f}%** | {lo*100:+.2f}% .. {hi*100:+.2f}% |")
    per_launch = go.get("guard_off_vs_plain_per_launch") or {}
    if go.get("launches", 1) > 1 and per_launch:
        lines += ["", "Each launch's own ratio (the same median over its rotations), in the order "
                  "they ran: " + "; ".join(
                      f"{pair}: " + ", ".join(f"{r*100:+.2f}%" for r in rs)
                      for pair, rs in per_launch.items()) + "."]
    lines += ["", "The main thread's extra CPU time per step (" + _over_rounds(go, "difference")
              + f"; 90% bootstrap interval{over}; as a fraction of plain DDP's main thread CPU per "
              "step):", "",
              "| guard, checks off / plain DDP | extra CPU per step (us) | 90% interval (us) | "
              "fraction (90% interval) |", "|---|---|---|---|"]
    for pair, (d, (lo, hi), base) in go["guard_off_main_thread_cpu_extra_s"].items():
        lines.append(f"| {pair} | **{d*1e6:+.0f}** | {lo*1e6:+.0f} .. {hi*1e6:+.0f} | "
                     f"**{d/base*100:+.2f}%** ({lo/base*100:+.2f}% .. {hi/base*100:+.2f}%) |")
    faults = go.get("page_faults_per_step")
    if faults:
        lines += ["", "Minor page faults per step of this rank's process, the median over rounds: "
                  + "; ".join(f"{name} {n:.0f}" for name, n in faults.items()) + "."]
    launch_faults = go.get("page_faults_per_step_per_launch") or {}
    if go.get("launches", 1) > 1 and faults and launch_faults:
        lines += ["", "The same per launch: " + "; ".join(
            f"{name} " + ", ".join(f"{n:.0f}" for n in ns) for name, ns in launch_faults.items())
                  + "."]
    lines.append("")
    return lines


def _launches(section: dict[str, Any]) -> str:
    """How a block-timed section's rounds were run: in launches of new rank processes, where
    it was (``bench.overhead.block_stats``)."""
    n = section.get("launches", 1)
    if n <= 1:
        return ""
    return (f" in {n} launches of {section['rounds'] // n} rounds (new rank processes each "
            "time, one after another: how a process's heap behaves, glibc's trimming included, "
            "depends on that process's history, a draw the rounds of one launch share, so the "
            "intervals resample launches)")


def _faults(r: dict[str, Any]) -> str:
    pf = r.get("page_faults_per_step")
    if not pf:
        return "-"
    audit, ideal = (v["audit"] for v in pf.values())
    return f"{audit:.0f} / {ideal:.0f}"


def replay_md(rp: dict[str, Any]) -> list[str]:
    kernel = "" if rp.get("native_kernel") else ", digests on the torch path (no C kernel)"
    checks = ("the non-finite check on in every configuration" if rp.get("nonfinite", False)
              else "the replay alone")
    alloc = rp.get("allocator") or {}
    pooled = all("per_audit_step_ratio_pooled" in r for r in rp["intervals"].values())
    if alloc:
        checks += ", glibc's heap trimming off"
    lines = [f"## Replay audit overhead ({rp['world']} rank(s), batch {rp['batch']}, {checks}, "
             f"{rp.get('rounds', rp['steps_per_config'] // 10)} rounds, alternated{kernel})", "",
             f"Replay off: {rp['step_s_replay_off']*1e3:.2f} ms/step (median) "
             f"({rp['step_cpu_s_replay_off']*1e3:.2f} ms CPU). Ideal run: replay off plus one "
             "plain forward+backward of the neighbour's batch every k steps, alternated with the "
             "others. Every configuration runs on the same model, switched block by block "
             f"({INSTANCES} instances used in turn, round by round). For reference, one "
             "forward+backward timed alone: "
             f"{rp['forward_backward_s']*1e3:.2f} ms. Interval k runs blocks of max(10, 4k) "
             "steps, so every interval has the same number of audit (or extra) steps; the "
             "order of the configurations rotates round by round, and the first step of a "
             "block (the first after a switch) is run untimed.", "",
             "**Per audit step** (the target: what an audit adds beyond its recomputation): the "
             "extra time of an audit step over the other steps of the same configuration "
             "(over \"off\" for k = 1), against the same for the ideal's extra "
             "forward+backward. Comparing steps within one configuration keeps the noise "
             "between configurations out, which at long intervals is larger than the whole "
             "effect. " + (
                 "The headline is the median over rounds of each round's ratio (a round's "
                 "blocks ran one after another on one model instance), as the checksum table's; "
                 "the pooled column takes each median over every round's steps first. "
                 if pooled else
                 "The ratio of the medians over every round's steps (this run predates the "
                 "median over rounds of each round's ratio). ") +
             "The main-thread CPU column is the pooled ratio in the rank's main-thread "
             "CPU time: the work an audit adds, without the waits of 3 ranks sharing 2 cores. "
             "The last column checks the premise: the audit configuration's other "
             "steps cost what \"off\" costs.", "",
             "| interval | audit step extra (ms) | ideal step extra (ms) | **measured / ideal, per "
             "audit step** | 90% interval (bootstrap over rounds) | "
             + ("pooled medians (90% interval) | " if pooled else "")
             + "main-thread CPU, measured / ideal | audit's other steps vs off (ms, 90% interval) "
             "| page faults per audit step: audit / ideal |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if pooled else "")]
    for k, r in rp["intervals"].items():
        lo, hi = r["per_audit_step_ratio_interval_90"]
        rlo, rhi = r["audit_rest_vs_off_interval_90"]
        rest = ("-" if k == "1" else f"{r['audit_rest_vs_off_s']*1e3:+.2f} "
                f"({rlo*1e3:+.2f} .. {rhi*1e3:+.2f})")
        pooled_cell = ""
        if pooled:
            plo, phi = r["per_audit_step_ratio_pooled_interval_90"]
            pooled_cell = f"{r['per_audit_step_ratio_pooled']:.2f} ({plo:.2f} .. {phi:.2f}) | "
        lines.append(f"| {k} | {r['audit_step_extra_s']*1e3:.2f} | "
                     f"{r['ideal_step_extra_s']*1e3:.2f} | **{r['per_audit_step_ratio']:.2f}** | "
                     f"{lo:.2f} .. {hi:.2f} | {pooled_cell}"
                     f"{r.get('per_audit_step_thread_cpu_ratio', float('nan')):.2f} | {rest} | "
                     f"{_faults(r)} |")
    faults = (f"Page faults: minor faults of the rank's process per audit (or extra) step, "
              f"mean; replay off: {rp.get('page_faults_per_step_replay_off', 0):.0f} per step. "
              + ("Each rank first set glibc's "
                 + ", ".join(f"`mallopt({k}, {v})`" for k, v in alloc.items())
                 + " (docs/usage.md: freed memory stays with the process): what faults remain "
                 "come from elsewhere (the interpreter's own arenas, new buffers)."
                 if alloc else
                 "Memory the C library gave back to the system and the step touched again "
                 "(glibc trims its heap when enough is free at its top, and the audit step's "
                 "allocations differ from the ideal's). Each fault costs about a microsecond "
                 "plus the page's zeroing (docs/usage.md: the allocator settings that avoid "
                 "them; `python -m bench.replay --no-trim` times the audit with them)."))
    lines += ["", faults,
              "", "Per step, over the whole run (robust means: the median of the audit (or "
              "extra) steps and of the other steps, weighted 1/k and (k-1)/k, so that this "
              "machine's occasional 100 ms stalls do not swamp effects of 1%; at long "
              "intervals the difference between two configurations' other steps, pure noise "
              "here, outweighs the audit):", "",
              "| interval | audit step (ms) | audit overhead | ideal step (ms) | ideal overhead "
              "| measured / ideal | 90% interval (bootstrap over rounds) | CPU measured / ideal "
              "| measured / (fwd+bwd alone / k) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for k, r in rp["intervals"].items():
        lo, hi = r["ratio_to_ideal_interval_90"]
        lines.append(f"| {k} | {r['step_s']*1e3:.2f} | {r['overhead']*100:+.1f}% | "
                     f"{r['ideal_step_s']*1e3:.2f} | {r['ideal_overhead']*100:+.1f}% | "
                     f"{r['ratio_to_ideal']:.2f} | {lo:.2f} .. {hi:.2f} | "
                     f"{r['cpu_ratio_to_ideal']:.2f} | {r['ratio_to_formula']:.2f} |")
    lines.append("")
    return lines


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# Benchmark results ({results['machine']})", "",
             "Produced by `nox -s bench` (`python -m bench`). Medians of alternated "
             "repetitions in one run.", ""]
    later = results.get("measured_later") or {}
    if later:
        runs: dict[tuple[str, str], list[str]] = {}
        for key, when in later.items():
            runs.setdefault((when["commit"], when["date"]), []).append(key)
        lines += ["Measured again later, on the same machine, the rest kept from the full run "
                  "(`python -m bench --only ...`): " + "; ".join(
                      f"{', '.join(keys)} (commit {commit}, {date})"
                      for (commit, date), keys in runs.items()) + ".", ""]
    fp = results["fingerprint"]
    lines += [f"## Fingerprint throughput: {fp['tensor_mib']} MiB float32, "
              f"{fp['threads']} threads", "",
              "| method | GiB/s | ratio to torch.sum |", "|---|---|---|"]
    for name, m in fp["methods"].items():
        lines.append(f"| {name} | {m['gib_per_s']:.2f} | {m['ratio_to_sum']:.2f} |")
    small = fp.get("many_small")
    if small:
        lines += ["", f"Many small tensors ({small['tensors']}: a model's biases, norms, their "
                  "AdamW moments and step counters), 1 list, microseconds per tensor:", "",
                  "| method | us per tensor |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in small["us_per_tensor"].items()]
    cache = fp.get("in_cache")
    if cache:
        rates = cache["gib_per_s"]
        loops = ", ".join(f"{k.removeprefix('C word loop, ')} {v:.1f}" for k, v in rates.items()
                          if k != "torch.sum")
        lines += ["", f"In cache ({cache['kib']} KiB float32, stays in L2; 1 thread), GiB/s: "
                  f"torch.sum {rates['torch.sum']:.1f}; the C kernel's word loop: {loops}. "
                  "With no wait for memory, this is what each loop's instructions allow: "
                  "where it is well above a machine's one-thread memory bandwidth, that "
                  "loop is not what binds the fingerprint there."]
    if fp.get("after_torch_op"):
        from bench.fingerprint import after_torch_op_md  # (it imports this module to write)

        lines += after_torch_op_md(fp["after_torch_op"])
    lines += overhead_md({**results["overhead"], "blocks": results.get("overhead_blocks")},
                          reference=True)
    if results.get("guard_off"):
        lines += guard_off_md(results["guard_off"], reference=True)
    if results.get("guard_off_no_trim"):
        lines += guard_off_md(results["guard_off_no_trim"], reference=True)
    if results.get("checksum"):
        lines += checksum_md(results["checksum"])
    if results.get("checksum_launches"):
        lines += checksum_launches_md(results["checksum_launches"])
    if results.get("replay"):
        lines += replay_md(results["replay"])
    if results.get("replay_exchange"):
        from bench.replay_exchange import table

        lines += ["## Where the replay audit posts its ring exchange", "",
                  "The default (with the step's first gradient bucket) beside the placement "
                  "before it (right after the replay), every step audited, alternated blocks "
                  "(`python -m bench.replay_exchange`).", "", *table(results["replay_exchange"]),
                  ""]
    if results.get("replay_no_trim"):
        lines += ["## The replay audit with glibc's heap trimming off", "",
                  "The same as the first replay table, each rank keeping the memory it frees "
                  "(the settings docs/usage.md advises for CPU training). The audit step frees "
                  "its recomputation's gradients and activations before the step allocates; "
                  "with glibc's defaults that memory may go back to the system and come back "
                  "as page faults later in the step (the optimizer's temporaries), as often as "
                  "the process's history of allocations decides. Here what is left is the "
                  "audit's own work.", ""]
        lines += replay_md(results["replay_no_trim"])
    if results.get("replay_alone"):
        lines += ["## The replay audit alone", "",
                  "The same, with the non-finite check off everywhere (the audit's replayed words "
                  "go to their owner point to point and a mismatch vetoes the step through the "
                  "gradient all-reduce, with or without the non-finite check).", ""]
        lines += replay_md(results["replay_alone"])
    if results.get("overhead_world2"):
        lines += ["## The same with 2 ranks on the 2 cores (no oversubscription)", "",
                  "With 3 ranks on 2 cores every synchronisation point makes the ranks' next "
                  "compute phases collide, which costs wall time that is not work. These runs "
                  "show the checks without that effect.", ""]
        lines += overhead_md(results["overhead_world2"], reference=False)
        if results.get("replay_world2"):
            lines += replay_md(results["replay_world2"])
    if results.get("replay_world1"):
        lines += ["## The audit's own cost: one rank alone", "",
                  "A single rank replays its own batch (the ring of one): no other process "
                  "competes for the cores and no rank waits for another, so this is the work the "
                  "audit adds, against one forward+backward.", ""]
        lines += replay_md(results["replay_world1"])
    fallback = [k for k in ("replay_world1_torch",)
                if k in results and not results[k].get("native_kernel")]
    if fallback:
        lines += ["## The same audit on the torch path", "",
                  "`SDC_GUARD_NATIVE=0` (what a machine without a C compiler runs): the "
                  "gradient digests take torch ops instead of the C kernel.", ""]
    for key in fallback:
        lines += replay_md(results[key])
    return "\n".join(lines) + "\n"
