"""Executes one notebook with the evcxr kernel and writes the executed copy (atomically).

Usage: run-notebook.py NOTEBOOK OUTPUT [--timeout SECONDS]

Why not `jupyter nbconvert --execute`: evcxr_jupyter forwards a cell's stdout and stderr lines
from a thread of their own, apart from the message that says the cell is done ("idle"), so a
line can arrive after it (evcxr issue #353, still open for stderr in 0.22). nbclient stops
listening to a cell at its idle and drops what comes later; under load the error message that a
cell's `?` prints (evcxr prints it on stderr) was lost that way, and CI's check that a refused
cell printed its out-of-memory error failed although the kernel had printed it. Here, after each
cell, the kernel's output channel is read on until it has been quiet for a while, and late lines
that belong to that cell (same request) are added to it. Nothing else changes: a cell's error
still stops the run unless the cell is tagged `raises-exception`, and notebooks.sh still checks
the outputs.
"""

import argparse
import os
import queue
import sys
import tempfile

import nbformat
from nbclient import NotebookClient

# Quiet time after a cell before it is taken as finished. A cell tagged `raises-exception` that
# has printed nothing on stderr yet is waited for longer: its refusal is the line that can be late.
QUIET_S = 0.3
EXPECTED_ERROR_WAIT_S = 10.0
LATE_TYPES = {"stream", "display_data", "execute_result", "error"}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("notebook")
    parser.add_argument("output")
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--kernel", default="rust")
    args = parser.parse_args()

    nb = nbformat.read(args.notebook, as_version=4)
    folder = os.path.dirname(os.path.abspath(args.notebook))
    client = NotebookClient(
        nb,
        timeout=args.timeout,
        kernel_name=args.kernel,
        resources={"metadata": {"path": folder}},
    )
    late_total = 0

    async def drain_late_output(cell, cell_index, execute_reply):
        nonlocal late_total
        request = execute_reply.get("parent_header", {}).get("msg_id")
        expects_error = "raises-exception" in cell.get("metadata", {}).get("tags", [])

        def has_error_output():
            return any(
                o.get("output_type") == "error" or o.get("name") == "stderr" for o in cell.outputs
            )

        while True:
            wait = EXPECTED_ERROR_WAIT_S if expects_error and not has_error_output() else QUIET_S
            try:
                msg = await client.kc.iopub_channel.get_msg(timeout=wait)
            except queue.Empty:
                return
            if msg.get("parent_header", {}).get("msg_id") != request:
                continue
            if msg["msg_type"] in LATE_TYPES:
                client.output(cell.outputs, msg, None, cell_index)
                late_total += 1
                print(
                    f"   cell {cell_index}: a {msg['msg_type']} message came after the cell's end",
                    file=sys.stderr,
                )

    client.on_cell_executed = drain_late_output
    client.execute()

    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".run-notebook-", suffix=".ipynb")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            nbformat.write(nb, f)
        os.replace(tmp, args.output)
    except BaseException:
        os.unlink(tmp)
        raise
    if late_total:
        print(f"   ({late_total} late output message(s) kept with their cells)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
