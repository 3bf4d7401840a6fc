#!/usr/bin/env python3
"""Alternates `f32_products` bench binaries (or one binary under different environments) and
prints each layer shape's median G multiply-adds a second per configuration.

    python3 scripts/f32-products-ab.py ROUNDS ROWS NAME=ENV=VAL;ENV=VAL:BINARY ...

ROWS is the bench's argument (e.g. 128,1024); each configuration is a name, `;`-separated
environment settings (possibly none) and the binary (`cargo bench -p wick-kernels --bench
f32_products --no-run` prints its path). The order is reversed every other round."""
import subprocess, sys, statistics, os, re, time
rounds=int(sys.argv[1]); rows=sys.argv[2]; cfgs=[]
for spec in sys.argv[3:]:
    name, rest = spec.split('=',1)
    envs, binary = rest.rsplit(':',1)
    env=dict(os.environ)
    for kv in filter(None, envs.split(';')):
        k,v=kv.split('=',1); env[k]=v
    cfgs.append((name,binary,env))
res={}
t=time.time()
for r in range(rounds):
    for name,binary,env in (cfgs if r%2==0 else cfgs[::-1]):
        out=subprocess.run([binary,rows],capture_output=True,text=True,env=env).stdout
        for line in out.splitlines():
            m=re.match(r'\| (\S+) \| (\S+) \| (.*?) \| ([\d.]+) \|',line)
            if m: res.setdefault((m[1],m[2],m[3]),{}).setdefault(name,[]).append(float(m[4]))
print(f"{rounds} rounds, {time.time()-t:.0f}s; medians G/s")
names=[c[0] for c in cfgs]
print("| shape | "+" | ".join(names)+" | "+names[-1]+"/"+names[0]+" |")
for k,v in res.items():
    meds=[statistics.median(v[n]) for n in names]
    print(f"| {k[0]} {k[1]} {k[2]} | "+" | ".join(f"{x:.1f}" for x in meds)+f" | {meds[-1]/meds[0]:.2f} |")
