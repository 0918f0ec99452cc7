"""Per-kernel times of a captured decode step from a ktrace CSV (scripts/ktrace.c).

Takes the last CUDA graph the trace holds (the last session's decode steps),
cuts it into replays (a step: every node once), and prints per kernel
(name and grid/block): its count per step, the median over steps of its
increment (its end minus the latest end before it: what it adds to the
step), their sum per step, its duration (first block start to last block
end) and how early it starts (the previous kernel's end minus its start).
Then a stretch of consecutive kernels in the middle of the step.

    python3 scripts/ktrace.py k.csv
"""
import csv
import statistics as st
import sys
from collections import defaultdict


def main(path):
    rows = [r for r in csv.DictReader(open(path)) if r["graph"] != "0"]
    if not rows:
        print("no kernels launched from a CUDA graph in", path)
        return
    for r in rows:
        r["start"], r["end"], r["node"] = int(r["start"]), int(r["end"]), int(r["node"])
    rows.sort(key=lambda r: r["start"])
    last = rows[-1]["graph"]
    rows = [r for r in rows if r["graph"] == last]
    pos = {n: i for i, n in enumerate(sorted({r["node"] for r in rows}))}
    n = len(pos)
    steps, cur = [], []
    for r in rows:
        if cur and pos[r["node"]] <= pos[cur[-1]["node"]]:
            steps.append(cur)
            cur = []
        cur.append(r)
    steps.append(cur)
    steps = [sorted(s, key=lambda r: pos[r["node"]]) for s in steps if len(s) == n]
    if not steps:
        print("no complete replay of graph", last)
        return
    print(f"graph {last}: {len(steps)} full steps of {n} kernels")
    spans = [(max(r["end"] for r in s) - s[0]["start"]) / 1e3 for s in steps]
    gaps = [(steps[i + 1][0]["start"] - max(r["end"] for r in steps[i])) / 1e3 for i in range(len(steps) - 1)]
    gap = st.median(gaps) if gaps else 0.0
    print(f"step on the device (first start to last end): median {st.median(spans):.1f} us; between steps {gap:.1f} us")
    inc, dur, early = defaultdict(list), defaultdict(list), defaultdict(list)
    for s in steps:
        prev_end = None
        for i, r in enumerate(s):
            dur[i].append((r["end"] - r["start"]) / 1e3)
            if prev_end is not None:
                inc[i].append((r["end"] - prev_end) / 1e3)
                early[i].append((prev_end - r["start"]) / 1e3)
            prev_end = max(prev_end or 0, r["end"])
    name = {i: r["name"][:48] for i, r in enumerate(steps[0])}
    geo = {i: f"{r['gx']}x{r['gy']}x{r['gz']}/{r['bx']}" for i, r in enumerate(steps[0])}
    med = lambda v: st.median(v) if v else 0.0
    by = defaultdict(lambda: ([], [], []))
    for i in range(n):
        b = by[(name[i], geo[i])]
        b[0].append(med(inc[i]))
        b[1].append(med(dur[i]))
        b[2].append(med(early[i]))
    print(f"{'kernel':48s} {'grid/block':>18s} {'n':>4s} {'incr us':>8s} {'sum us':>8s} {'dur us':>7s} {'early us':>8s}")
    total = 0.0
    for key, (incs, durs, earl) in sorted(by.items(), key=lambda kv: -sum(kv[1][0])):
        total += sum(incs)
        print(f"{key[0]:48s} {key[1]:>18s} {len(incs):4d} {med(incs):8.2f} {sum(incs):8.1f} {med(durs):7.2f} {med(earl):8.2f}")
    print(f"sum of increments {total:.1f} us")
    mid = n // 2
    print(f"kernels {max(1, mid - 10)}..{min(n - 1, mid + 10)} of the step:")
    for i in range(max(1, mid - 10), min(n, mid + 11)):
        print(f"  {i:4d} {name[i][:44]:44s} {geo[i]:>18s} incr {med(inc[i]):6.2f} dur {med(dur[i]):6.2f} early {med(early[i]):6.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
