"""Loads a wick memory_viz snapshot with PyTorch's own memory_viz tooling (not run in CI).

    python scripts/torch-reference/memory_viz_check.py RUN.memory-viz.pickle [RUN.history.json] [--html OUT]

wick writes the snapshot (`MemoryHistory::write_memory_viz`, `zoo-speed --record-history`,
`wick train --record-history`) in the pickle layout of `torch.cuda.memory._snapshot()`. This
script feeds it to `torch.cuda._memory_viz`: `trace` (PyTorch's text replay of every event),
`segsum`, `memory` and `segments`, and `trace_plot` (the HTML page pytorch.org/memory_viz's
"Active Memory Timeline" draws; it loads the viewer's script from a CDN, so open it where the
network reaches). With the run's JSON history it also checks that the snapshot holds one entry
per allocation and two per free, and ends at the bytes the history's recorded allocations hold. Exits non-zero on any
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
    for name in ("segsum", "memory", "segments"):
        out = getattr(_memory_viz, name)(snap)
        print(f"torch.cuda._memory_viz.{name}: {len(out)} characters")
    page = _memory_viz.trace_plot(snap)
    print(f"torch.cuda._memory_viz.trace_plot: {len(page)} characters of HTML")
    if args.html:
        with open(args.html, "w") as f:
            f.write(page)

    if args.history:
        with open(args.history) as f:
            history = json.load(f)
        heap = history["heap"]
        open_blocks, live, unseen = {}, 0, 0
        for e in heap["events"]:
            if e["action"] == "alloc":
                open_blocks[e["addr"]] = e["size"]
                live += e["size"]
            elif e["addr"] in open_blocks:
                live -= open_blocks.pop(e["addr"])
            else:
                unseen += e["size"]
        # PyTorch's replay subtracts every completed free, paired or not.
        expected = live - unseen
        # PyTorch's `trace` prints a TOTAL MEM whose counter its own loop index overwrites (2.5.1),
        # so the snapshot's bytes at the end are summed here from its entries as trace() pairs them.
        count = 0
        for t in traces:
            for e in t:
                if e["action"] == "alloc":
                    count += e["size"]
                elif e["action"] == "free_completed":
                    count -= e["size"]
        ok = count == expected
        print(f"bytes at the end: the snapshot's entries {count} B, wick's JSON history {expected} B ({'same' if ok else 'DIFFERENT'})")
        if not ok:
            failures.append("the replay's end differs from the history's")
        if len(heap["events"]) + sum(1 for e in heap["events"] if e["action"] == "free") != events:
            failures.append("the snapshot's entry count is not one per allocation and two per free")
    for f in failures:
        print("FAIL:", f)
    print("PASS" if not failures else "FAIL")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
