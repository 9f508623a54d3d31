"""Summarises a unit trace of the decode megakernel (`megakernel_bench --profile N --trace-out F`):
per phase kind, how long the median and the slowest active unit took once the phase before had
ended, split at the unit's marks (matrix units: input complete, loaded, products, then the
publish; attention: q/k/v complete, loaded, normed and roped, cache pages, warps merged, output),
and the blocks whose unit was the slowest most often. The slowest unit sets when the next phase
can start, so the gap between the two columns is time the chain loses to imbalance.

usage: python3 bench/megakernel_trace.py TRACE_FILE
"""
import collections
import statistics
import sys

KINDS = ["qkv", "attention", "o_proj", "gate_up", "down", "lm_head", "argmax"]
WORDS = 9  # start, marks 1-6, end, ns waiting for pages
END = 7


def main(path):
    rows = []
    for line in open(path):
        if line.startswith("#"):
            continue
        v = list(map(int, line.split()))
        rows.append({"t": v[0], "block": v[2], "kind": v[3], "layer": v[4], "w": v[7:7 + WORDS]})
    layers = max(r["layer"] for r in rows if r["kind"] <= 4) + 1

    def phase(r):
        return r["layer"] * 5 + r["kind"] if r["kind"] <= 4 else layers * 5 + r["kind"] - 5

    by_phase = collections.defaultdict(list)
    for r in rows:
        by_phase[(r["t"], phase(r))].append(r)
    steps = {k: {"median": collections.defaultdict(list), "slowest": collections.defaultdict(list)} for k in range(7)}
    after = {k: {"median": [], "slowest": []} for k in range(7)}
    slow_blocks = {k: collections.Counter() for k in range(7)}
    for t in sorted({r["t"] for r in rows}):
        ends = {ph: max(u["w"][END] for u in us) for (tt, ph), us in by_phase.items() if tt == t}
        for ph in sorted(ends):
            if ph == 0 or ph - 1 not in ends:
                continue
            ready = ends[ph - 1]
            active = [u for u in by_phase[(t, ph)] if u["w"][1] != 0]
            if not active:
                continue
            kind = active[0]["kind"]

            def split(u):
                w = u["w"]
                begun = max(w[0], ready)
                marks = [begun] + [w[k] for k in range(1, END + 1) if w[k] != 0]
                return w[END] - begun, [max(0, b - a) for a, b in zip(marks, marks[1:])], u["block"]

            units = sorted((split(u) for u in active), key=lambda s: s[0])
            for name, unit in (("median", units[len(units) // 2]), ("slowest", units[-1])):
                after[kind][name].append(unit[0])
                for i, d in enumerate(unit[1]):
                    steps[kind][name][i].append(d)
            slow_blocks[kind][units[-1][2]] += 1
    print("us after the phase before ended: total = wait for inputs + the steps between marks")
    for k in range(7):
        if not after[k]["median"]:
            continue
        for name in ("median", "slowest"):
            parts = " ".join(f"{statistics.mean(steps[k][name][i]) / 1e3:5.2f}" for i in sorted(steps[k][name]))
            print(f"{KINDS[k]:9s} {name:7s} {statistics.mean(after[k][name]) / 1e3:6.2f} = {parts}")
        print(f"{'':9s} slowest blocks (times): {slow_blocks[k].most_common(6)}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
