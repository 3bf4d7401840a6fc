#!/usr/bin/env python3
"""Checks wick's cuDNN figures (crates/wick-nn/src/native/cuda/cudnn.rs: the enum values and the
algorithm-result layout it passes to a cuDNN opened at run time) against cudarc's bindings of
cuDNN's headers (bindgen output for cuDNN 8.9.7, 9.10.2 and 9.21.1, in the cargo registry):
every constant must have the same value in every version bound there, and the three
`cudnnConvolution*AlgoPerfStruct`s the same fields in the same order. Run by scripts/cuda-ci.sh."""
import glob
import os
import re
import sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ours = open(os.path.join(root, "crates/wick-nn/src/native/cuda/cudnn.rs")).read()
lock = open(os.path.join(root, "Cargo.lock")).read()
version = re.search(r'name = "cudarc"\nversion = "([^"]+)"', lock).group(1)
home = os.environ.get("CARGO_HOME", os.path.expanduser("~/.cargo"))
found = glob.glob(f"{home}/registry/src/*/cudarc-{version}/src/cudnn/sys/mod.rs")
if not found:
    sys.exit(f"!! cudarc {version}'s cuDNN bindings not found under {home}/registry (run a cargo build first)")
theirs = open(found[0]).read()

failures = 0
constants = re.findall(r"pub\(crate\) const (\w+): (?:c_int|Status) = (\d+);", ours)
for name, value in constants:
    full = "CUDNN_STATUS_SUCCESS" if name == "SUCCESS" else f"CUDNN_{name}"
    values = set(re.findall(rf"\b{full} = (\d+),", theirs))
    ok = values == {value}
    failures += not ok
    print(f"{'ok' if ok else 'MISMATCH'} {name} = {value}: cudarc's {full} = {sorted(values) or 'absent'}")

fields = re.search(r"pub\(crate\) struct AlgoPerf \{(.*?)\}", ours, re.S).group(1)
ours_fields = [f.replace("_", "") for f in re.findall(r"pub\(crate\) (\w+):", fields)]
for kind in ["Fwd", "BwdData", "BwdFilter"]:
    structs = re.findall(rf"pub struct cudnnConvolution{kind}AlgoPerfStruct \{{(.*?)\}}", theirs, re.S)
    for body in structs or [""]:
        names = [n.lower() for n in re.findall(r"pub (\w+):", body)]
        ok = names == [f.lower() for f in ours_fields]
        failures += not ok
        print(f"{'ok' if ok else 'MISMATCH'} cudnnConvolution{kind}AlgoPerf_t fields {names} vs {ours_fields}")
if len(constants) < 10:
    sys.exit(f"!! only {len(constants)} constants read from cudnn.rs")
if failures:
    sys.exit(f"!! {failures} cuDNN figure(s) differ from cuDNN's headers")
print(f"cuDNN figures match cudarc {version}'s bindings ({len(constants)} constants, 3 result layouts)")
