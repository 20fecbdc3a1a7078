#!/usr/bin/env python3
"""Helpers for bench/cache.sh: a Zipf workload (disk bytes written by the transient tier),
filling a memory tier, and the median table of the hit and miss runs."""
import argparse
import bisect
import http.client
import json
import random
import statistics
import sys
import time
import urllib.request


def metrics(admin):
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        k, v = line.rsplit(" ", 1)
        try:
            out[k] = float(v)
        except ValueError:
            pass
    return out


def get_all(port, paths, timeout=30):
    """GET every path on one keep-alive connection; returns bytes received."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    total = 0
    for p in paths:
        c.request("GET", p, headers={"User-Agent": "pier-bench-cache"})
        r = c.getresponse()
        body = r.read()
        if r.status != 200:
            raise SystemExit(f"GET {p} -> {r.status}")
        total += len(body)
    c.close()
    return total


def zipf(a):
    """N requests over M keys, P(rank k) ~ 1/k^s; many keys are asked for once."""
    rng = random.Random(a.seed)
    cum, acc = [], 0.0
    for k in range(1, a.keys + 1):
        acc += 1.0 / (k ** a.s)
        cum.append(acc)
    # Ranks are scattered over key names so that popular keys are not neighbours.
    names = list(range(a.keys))
    rng.shuffle(names)
    reqs = [names[bisect.bisect_left(cum, rng.random() * acc)] for _ in range(a.requests)]
    counts = {}
    for k in reqs:
        counts[k] = counts.get(k, 0) + 1
    t0 = time.monotonic()
    got = get_all(a.port, [f"{a.path}?z={k}" for k in reqs])
    wall = time.monotonic() - t0
    # Writes are asynchronous: wait for the queue to drain (bounded).
    deadline = time.monotonic() + 30
    zone = f'zone="{a.zone}"'
    last = None
    while time.monotonic() < deadline:
        m = metrics(a.admin)
        now = (m.get(f"pier_cache_disk_writes_total{{{zone}}}", 0),
               m.get(f"pier_cache_promotions_total{{{zone}}}", 0))
        if now == last:
            break
        last = now
        time.sleep(0.5)
    m = metrics(a.admin)
    look = lambda r: m.get(f'pier_cache_lookups_total{{{zone},result="{r}"}}', 0)
    out = {
        "label": a.label, "requests": a.requests, "keys_universe": a.keys, "zipf_s": a.s,
        "distinct_keys": len(counts),
        "one_hit_keys": sum(1 for v in counts.values() if v == 1),
        "bytes_served": got, "wall_s": round(wall, 2),
        "disk_writes": m.get(f"pier_cache_disk_writes_total{{{zone}}}", 0),
        "disk_bytes_written": m.get(f"pier_cache_disk_written_bytes_total{{{zone}}}", 0),
        "disk_objects": m.get(f'pier_cache_objects{{{zone},tier="disk"}}', 0),
        "disk_hits": m.get(f"pier_cache_disk_hits_total{{{zone}}}", 0),
        "skipped_queue": m.get(f'pier_cache_disk_skipped_total{{{zone},reason="queue_full"}}', 0),
        "hits": look("hit"), "misses": look("miss"),
    }
    print(json.dumps(out))


def fill(a):
    paths = [f"{a.path}?f={i}" for i in range(a.n)]
    t0 = time.monotonic()
    got = get_all(a.port, paths)
    print(json.dumps({"filled_bytes": got, "wall_s": round(time.monotonic() - t0, 2)}))


def table(a):
    rows = [json.loads(l) for l in open(a.results) if l.strip()]
    rows = [r for r in rows if r.get("kind") == "load" and r.get("req_per_cpu_s")]
    groups = {}
    for r in rows:
        groups.setdefault((r["path"], r["conns"], r["proxy"]), []).append(r)
    keys = sorted({(p, c) for p, c, _ in groups}, key=lambda x: (x[0], x[1]))
    proxies = []
    for _, _, p in groups:
        if p not in proxies:
            proxies.append(p)
    # X and X-plain: what X's cache costs it (cache on ÷ off, per CPU-second).
    pairs = [p for p in proxies if p + "-plain" in proxies]
    print("| path | conns | " + " | ".join(f"{p} req/CPU-s (min–max)" for p in proxies)
          + " | " + " | ".join(f"pier ÷ {p}" for p in proxies if p != "pier")
          + "".join(f" | {p} on ÷ off" for p in pairs) + " | load avg |")
    print("|---|---|" + "---|" * (2 * len(proxies) - 1 + len(pairs) + 1))
    for path, conns in keys:
        med = {}
        cells = []
        loads = []
        for p in proxies:
            rs = groups.get((path, conns, p), [])
            v = [r["req_per_cpu_s"] for r in rs]
            loads += [r["loadavg_before"] for r in rs]
            if v:
                med[p] = statistics.median(v)
                cells.append(f"{med[p]:,.0f} ({min(v):,.0f}–{max(v):,.0f})")
            else:
                cells.append("—")
        ratios = []
        for p in proxies:
            if p == "pier":
                continue
            ratios.append(f"{med['pier'] / med[p]:.2f}×" if "pier" in med and p in med else "—")
        for p in pairs:
            q = p + "-plain"
            ratios.append(f"{med[p] / med[q]:.2f}×" if p in med and q in med else "—")
        lo = f"{min(loads):.1f}–{max(loads):.1f}" if loads else "—"
        print(f"| {path} | {conns} | " + " | ".join(cells) + " | " + " | ".join(ratios) + f" | {lo} |")


def main():
    ap = argparse.ArgumentParser()
    sp = ap.add_subparsers(dest="cmd", required=True)
    z = sp.add_parser("zipf")
    for k in ("port", "admin", "requests", "keys", "seed"):
        z.add_argument(f"--{k}", type=int, required=True)
    z.add_argument("--s", type=float, default=0.9)
    z.add_argument("--path", default="/4k.bin")
    z.add_argument("--zone", default="main")
    z.add_argument("--label", default="")
    f = sp.add_parser("fill")
    f.add_argument("--port", type=int, required=True)
    f.add_argument("--n", type=int, required=True)
    f.add_argument("--path", default="/1m.bin")
    t = sp.add_parser("table")
    t.add_argument("results")
    a = ap.parse_args()
    {"zipf": zipf, "fill": fill, "table": table}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
