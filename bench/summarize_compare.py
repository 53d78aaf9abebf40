"""Summarise bench/compare_trl.sh's logs: per shape, medians over runs of our and TRL's seconds per iteration and per
phase, the ratios, and each phase's achieved FLOP/s against the measured matmul peak (FLOPs from our benchmark's
`[flops]` line, the same work for both; TRL's scoring skips the policy forward). Prints markdown.

python bench/summarize_compare.py out/bench
"""

import glob
import os
import re
import statistics
import sys


def kv(line: str) -> dict:
    return {k: float(v) for k, v in re.findall(r"([a-z_]+)=([0-9.]+)", line)}


def parse(path: str) -> dict:
    text = open(path).read()
    out = {}
    for line in text.splitlines():
        if line.startswith("trl_ppo_bench:") or line.startswith("ppo_throughput:"):
            out |= kv(line.split(":", 1)[1])
        elif line.startswith("[result] median phase seconds per iteration:"):  # TRL
            p = kv(line.split(":", 1)[1])
            out["generate"] = p["generate"]
            out["scoring"] = p["rollout_logprob"] + p["rollout_ref_fwd"] + p["rollout_value_reward_fwd"]
            out["update"] = p["train_fwd"] + p["train_logprob"] + p["backward"] + p["optimizer_step"]
        elif line.startswith("[flops]"):
            out["flops"] = kv(line[len("[flops]") :])
        elif line.startswith("[floor]"):
            out["floor"] = kv(line.split(":", 1)[1])  # generate, scoring, update, iteration
        else:
            m = re.match(r"\[result\] (generate|scoring|update)\s+([0-9.]+)s", line)
            if m:
                out[m.group(1)] = float(m.group(2))
    return out


def last_line(path: str, prefix: str) -> dict:
    """The key=value pairs of a log's line that starts with prefix ({} if the log or the line is missing)."""
    lines = [x for x in open(path).read().splitlines() if x.startswith(prefix)] if os.path.exists(path) else []
    return kv(lines[-1].split(":", 1)[1]) if lines else {}


def main(log_dir: str) -> None:
    for shape in ("S", "L", "smollm2"):
        trl = [parse(p) for p in sorted(glob.glob(os.path.join(log_dir, f"trl_{shape}_*.txt")))]
        ours = [parse(p) for p in sorted(glob.glob(os.path.join(log_dir, f"ours_{shape}_*.txt")))]
        trl, ours = [r for r in trl if "sec_per_iter" in r], [r for r in ours if "sec_per_iter" in r]
        if not trl or not ours:
            continue

        def med(rs: list, k: str) -> float:
            return statistics.median(r[k] for r in rs)

        fl = ours[0]["flops"]
        peak = statistics.median(r["flops"]["peak"] for r in ours) * 1e9
        work = {
            "generate": (fl["generate"], fl["generate"]),
            "scoring": (fl["scoring"], fl["scoring_without_policy"]),
            "update": (fl["update"], fl["update"]),
        }
        print(
            f"\nShape {shape}: {len(ours)} runs of ours, {len(trl)} of TRL (medians; runs alternated); "
            f"fp32 matmul peak {peak / 1e9:.0f} GFLOP/s\n"
        )
        floors = [r["floor"] for r in ours if "floor" in r]
        floor = {k: statistics.median(f[k] for f in floors) for k in floors[0]} if floors else {}

        def fl_col(k: str, floor=floor) -> str:
            return f"{floor[k]:.3f}" if floor else "-"

        print(
            "| phase | ours s | TRL s | TRL / ours | GEMM floor s | ours GFLOP/s (% of peak) "
            "| TRL GFLOP/s (% of peak) |"
        )
        print("|---|---|---|---|---|---|---|")
        for ph in ("generate", "scoring", "update"):
            o, t = med(ours, ph), med(trl, ph)
            fo, ft = work[ph][0] * 1e9 / o, work[ph][1] * 1e9 / t
            print(
                f"| {ph} | {o:.3f} | {t:.3f} | {t / o:.2f}x | {fl_col(ph)} | {fo / 1e9:.1f} "
                f"({100 * fo / peak:.0f}%) | {ft / 1e9:.1f} ({100 * ft / peak:.0f}%) |"
            )
        o, t = med(ours, "sec_per_iter"), med(trl, "sec_per_iter")
        print(f"| **iteration** | **{o:.3f}** | **{t:.3f}** | **{t / o:.2f}x** | {fl_col('iteration')} | | |")
        runs_o = ", ".join(f"{r['sec_per_iter']:.2f}" for r in ours)
        runs_t = ", ".join(f"{r['sec_per_iter']:.2f}" for r in trl)
        print(
            f"\nsec_per_iter by run: ours {runs_o}; TRL {runs_t}. Peak RSS: ours {med(ours, 'peak_rss_mb'):.0f} MB, "
            f"TRL {med(trl, 'peak_rss_mb'):.0f} MB."
        )
        if floor:
            f = floor["iteration"]
            print(
                f"GEMM floor (the iteration's linear-layer GEMMs timed alone, warm caches, median of our runs): "
                f"{f:.3f} s, {100 * f / o:.0f}% of our iteration; TRL / floor = {t / f:.2f}x is the most any "
                f"implementation of this work could gain over TRL on this machine (with one forward fewer in "
                f"scoring, as TRL: {t / (f - floor['scoring'] / 4):.2f}x)."
            )
        g = last_line(os.path.join(log_dir, f"generate_{shape}.txt"), "decode_vs_hf:")
        if g:
            print(
                f"Generation alone (bench/decode.py --vs-hf, same weights): ours {g['ours_tok_per_s']:.0f} tok/s, "
                f"transformers generate {g['hf_tok_per_s']:.0f} tok/s: {g['ratio']:.2f}x."
            )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/bench")
