"""Loads a wick memory_viz snapshot with PyTorch's own memory_viz tooling (not run in CI).

    python scripts/torch-reference/memory_viz_check.py RUN.memory-viz.pickle [RUN.history.json] [--html OUT]

wick writes the snapshot (`MemoryHistory::write_memory_viz`, `zoo-speed --record-history`,
`wick train --record-history`) in the pickle layout of `torch.cuda.memory._snapshot()`. This
script feeds it to `torch.cuda._memory_viz`: `trace` (PyTorch's text replay of every event),
`segsum`, `memory` and `segments`, and `trace_plot` (the HTML page pytorch.org/memory_viz's
"Active Memory Timeline" draws; it loads the viewer's script from a CDN, so open it where the
network reaches). With the run's JSON history it also checks that the snapshot holds one entry
per allocation and two per free, and reaches the same peak and end as the history. Exits non-zero on any
failure.
"""

import argparse
import json
import pickle
import sys

from torch.cuda import _memory_viz


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("snapshot")
    ap.add_argument("history", nargs="?", help="the run's wick JSON history (memory-history.json)")
    ap.add_argument("--html", help="write trace_plot's page here")
    args = ap.parse_args()
    with open(args.snapshot, "rb") as f:
        snap = pickle.load(f)
    failures = []
    for key in ("segments", "device_traces"):
        if key not in snap:
            failures.append(f"no '{key}' in the snapshot")
    traces = snap.get("device_traces", [])
    events = sum(len(t) for t in traces)
    actions = sorted({e["action"] for t in traces for e in t})
    print(f"snapshot: {len(snap.get('segments', []))} segments, {len(traces)} device trace(s), {events} entries, actions {actions}")
    for e in (e for t in traces for e in t):
        missing = [k for k in ("action", "addr", "size", "stream", "time_us", "frames") if k not in e]
        if missing:
            failures.append(f"entry without {missing}: {e}")
            break
        if any(set(fr) != {"filename", "line", "name"} for fr in e["frames"]):
            failures.append(f"a frame of {e} is not {{filename, line, name}}")
            break

    text = _memory_viz.trace(snap)
    last_lines = text.strip().splitlines()[-3:]
    print("torch.cuda._memory_viz.trace:", " | ".join(last_lines))
    print(f"torch.cuda._memory_viz.segsum: {len(_memory_viz.segsum(snap))} characters")
    for name in ("memory", "segments"):
        # Their flamegraph lines as text: the default formatter downloads flamegraph.pl.
        out = getattr(_memory_viz, name)(snap, format_flamegraph=lambda lines: lines)
        print(f"torch.cuda._memory_viz.{name}: {len(out)} characters of flamegraph lines")
    page = _memory_viz.trace_plot(snap)
    print(f"torch.cuda._memory_viz.trace_plot: {len(page)} characters of HTML")
    if args.html:
        with open(args.html, "w") as f:
            f.write(page)

    if args.history:
        with open(args.history) as f:
            history = json.load(f)
        heap = history["heap"]
        # The history's bytes after each event, less its baseline, paired as wick pairs them.
        open_blocks, level, peak = {}, 0, 0
        for e in heap["events"]:
            if e["action"] == "alloc":
                open_blocks[e["addr"]] = e["size"]
                level += e["size"]
            else:
                level -= open_blocks.pop(e["addr"], e["size"])
            peak = max(peak, level)
        # The snapshot's, as memory_viz's timeline adds allocations and subtracts completed frees.
        count, snap_peak = 0, 0
        for t in traces:
            for e in t:
                if e["action"] == "alloc":
                    count += e["size"]
                elif e["action"] == "free_completed":
                    count -= e["size"]
                snap_peak = max(snap_peak, count)
        ok = (snap_peak, count) == (peak, level)
        print(f"peak and end above the baseline: snapshot {snap_peak} B, {count} B; wick's JSON history {peak} B, {level} B ({'same' if ok else 'DIFFERENT'})")
        if not ok:
            failures.append("the snapshot's peak or end differs from the history's")
        if len(heap["events"]) + sum(1 for e in heap["events"] if e["action"] == "free") != events:
            failures.append("the snapshot's entry count is not one per allocation and two per free")
    for f in failures:
        print("FAIL:", f)
    print("PASS" if not failures else "FAIL")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
