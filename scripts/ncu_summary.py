"""Sums Nsight Compute's per-kernel summary (`ncu --metrics gpu__time_duration.sum
--print-summary per-kernel --csv`) by kernel name: each kernel's total time (invocations x
average), its share, and its launches, largest first.

    python3 scripts/ncu_summary.py FILE.csv [FILE.csv ...] [--top 18]
"""

import argparse
import collections
import csv


def totals(path):
    """{kernel name: [launches, milliseconds]} from one ncu CSV (lines other than the table's,
    such as the program's own output and ncu's ==PROF== lines, are skipped)."""
    with open(path) as f:
        rows = [line for line in f if line.startswith('"')]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for row in csv.DictReader(rows):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        launches = int(row["Invocations"].replace(",", ""))
        average_ns = float(row["Average"].replace(",", ""))
        name = row["Kernel Name"].split("(")[0].split("<")[0][:64]
        by_name[name][0] += launches
        by_name[name][1] += launches * average_ns / 1e6
    return by_name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    for path in args.files:
        by_name = totals(path)
        total = sum(ms for _, ms in by_name.values())
        launches = sum(n for n, _ in by_name.values())
        print(f"{path}: {total:.2f} ms of kernels, {launches} launches")
        for name, (n, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"  {ms:8.2f} ms {100 * ms / max(total, 1e-9):5.1f} % {n:6d}  {name}")


if __name__ == "__main__":
    main()
