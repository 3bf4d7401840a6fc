"""Replays wick's allocation traces through PyTorch's CUDA caching allocator, for the side-by-side
rows of scripts/gpu-check.sh. Prints Markdown table rows."""
import json
import sys
import time

try:
    import torch
except ImportError:
    print("| PyTorch replay | SKIPPED | torch is not installed here |")
    sys.exit(0)

if not torch.cuda.is_available():
    print("| PyTorch replay | SKIPPED | no CUDA device for torch |")
    sys.exit(0)

for path in sys.argv[1:]:
    trace = json.load(open(path))
    ops = trace["ops"]
    streams = {0: torch.cuda.current_stream(), 1: torch.cuda.Stream()}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    timings = []
    frag = None
    for rep in range(2):  # warm-up pass fills the cache, second pass is timed
        live = {}
        start = time.perf_counter()
        for op in ops:
            if op["op"] == "alloc":
                live[op["id"]] = torch.cuda.caching_allocator_alloc(op["size"], 0, streams[op.get("stream", 0)])
            else:
                ptr = live.pop(op["id"], None)
                if ptr is not None:
                    torch.cuda.caching_allocator_delete(ptr)
        torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
        if rep == 0:
            st = torch.cuda.memory_stats()
            frag = st["reserved_bytes.all.peak"] / max(1, st["allocated_bytes.all.peak"])
    # The interpreter's share: the same loop with the allocator calls replaced by dict work.
    live = {}
    start = time.perf_counter()
    for op in ops:
        if op["op"] == "alloc":
            live[op["id"]] = op["size"]
        else:
            live.pop(op["id"], None)
    overhead = time.perf_counter() - start
    n = len(ops)
    print(
        f"| replay {trace['name']} through PyTorch {torch.__version__} | INFO | "
        f"{timings[1] / n * 1e6:.2f} us/op with Python, loop overhead {overhead / n * 1e6:.2f} us/op, "
        f"net {(timings[1] - overhead) / n * 1e6:.2f} us/op; peak reserved/allocated {frag:.3f} |"
    )
    torch.cuda.empty_cache()
