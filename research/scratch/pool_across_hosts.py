"""Pool benchmarks.quantized's rows across two hosts: prompts 1-20 from an earlier run's report (its
printed per-prompt lines, 4-5 decimals: that run kept no --json) and prompts 21-40 from this host's
--json parts, into the rule's figures (mean KL over mean order noise, identical answers) on 40
distinct prompts. The float32 reference and its order noise are the same on both hosts (the noise of
prompts 1-20 agrees to its 4 printed decimals), so only the quantized engines' rounding differs.

    PYTHONPATH=. python3 research/scratch/pool_across_hosts.py qwen2.5-0.5b \
        docs/runs/quantized-fidelity-fast-qwen2.5-0.5b-amx.md part-20-30.json part-30-40.json
"""

import json
import re
import statistics
import sys

LINE = re.compile(r"squad\s+(\d+): noise ([\d.]+) full KL (-?[\d.]+) fused KL (-?[\d.]+) same (\w+)/(\w+)")
FIELDS = ("noise", "full_kl", "fused_kl", "full_same", "fused_same")


def report_rows(path: str) -> list[dict]:
    """The per-prompt rows a report printed."""
    return [{"number": int(m[1]), "noise": float(m[2]), "full_kl": float(m[3]), "fused_kl": float(m[4]),
             "full_same": m[5] == "True", "fused_same": m[6] == "True"} for m in LINE.finditer(open(path).read())]


def main(model: str, report: str, *parts: str) -> None:
    rows = [r for r in report_rows(report) if r["number"] <= 20]
    rows += [{"number": r["number"], **{k: r[k] for k in FIELDS}}
             for part in parts for r in json.load(open(part)) if r["number"] > 20]
    numbers = sorted(r["number"] for r in rows)
    assert numbers == list(range(1, 41)), f"not prompts 1-40 once each: {numbers}"
    noise = statistics.mean(r["noise"] for r in rows)
    for what in ("full", "fused"):
        kl = statistics.mean(r[f"{what}_kl"] for r in rows)
        same = sum(r[f"{what}_same"] for r in rows)
        print(f"{model} {what}, prompts 1-20 of the report + 21-40 here: mean KL {kl:.5f} = {kl / noise:.2%} of the "
              f"order noise ({noise:.4f}); identical answers on {same} of {len(rows)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
