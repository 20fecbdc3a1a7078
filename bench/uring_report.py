#!/usr/bin/env python3
"""The report of a bench/uring.sh run directory (results.jsonl, settings.json).

    python3 bench/uring_report.py bench/out/uring-YYYYmmddTHHMMSSZ
"""

import json
import os
import sys

from report import cell, med  # bench/report.py's: 'median (min–max)', median

LABEL = {
    "epoll": "uring-proxy, epoll (tokio current_thread)",
    "uring": "uring-proxy, io_uring",
    "uring-plain": "uring-proxy, io_uring, plain ring",
    "nginx": "nginx proxy_pass",
    "pier": "Pier",
    "pier-epoll": "Pier, PIER_IO_URING=0",
}
ORDER = ["epoll", "uring", "uring-plain", "nginx", "pier", "pier-epoll"]
THRESHOLD = 0.10  # issue 34: adopt io_uring only if it saves >= 10% CPU per request


def total_us(r):
    if r.get("user_us_per_req") is None or r.get("sys_us_per_req") is None:
        return None
    return r["user_us_per_req"] + r["sys_us_per_req"]


def per_req(r, key):
    """CPU µs a request of the origin or of wrk: a check that the proxy's saving is not
    work moved into its neighbours' processes."""
    n = r.get("requests")
    return r[key] * 1e6 / n if n and r.get(key) is not None else None


def compare(keys, runs, mode, base="epoll"):
    print("Saved: (epoll − io_uring) ÷ epoll's CPU µs a request, from the medians; in "
          "brackets the same from each repetition's pair (the modes run one after the other "
          "in each round). The sys and user columns are each part's saving as a share of "
          "epoll's *total* CPU a request; each is a median of its own, so they add up to the total "
          "only roughly.\n")
    print("| path | conns | req/CPU-s io_uring ÷ epoll | total CPU/req saved | of which sys "
          "| of which user | ≥ 10%? |")
    print("|---|---|---|---|---|---|---|")
    for path, c in keys:
        e, u = runs(base, path, c), runs(mode, path, c)
        if not e or not u:
            continue
        et, ut = med([total_us(r) for r in e]), med([total_us(r) for r in u])
        es, us = med([r["sys_us_per_req"] for r in e]), med([r["sys_us_per_req"] for r in u])
        eu, uu = med([r["user_us_per_req"] for r in e]), med([r["user_us_per_req"] for r in u])
        ratio = med([r["req_per_cpu_s"] for r in u]) / med([r["req_per_cpu_s"] for r in e])
        pairs = [(x, y) for x in e for y in u if x["rep"] == y["rep"]]
        per = [1 - total_us(y) / total_us(x) for x, y in pairs if total_us(x) and total_us(y)]
        saved = 1 - ut / et
        rng = f" ({min(per) * 100:+.0f}% to {max(per) * 100:+.0f}%)" if len(per) > 1 else ""
        if saved >= THRESHOLD and (not per or min(per) >= THRESHOLD):
            verdict = "yes"
        else:
            verdict = "borderline" if saved >= THRESHOLD else "no"
        print(f"| {path} | {c} | {ratio:.2f}× | {saved * 100:+.1f}%{rng} "
              f"| {(es - us) / et * 100:+.1f}% ({es:.1f} → {us:.1f} µs) "
              f"| {(eu - uu) / et * 100:+.1f}% ({eu:.1f} → {uu:.1f} µs) | {verdict} |")
    print()


def main():
    run = sys.argv[1]
    rows = [json.loads(x) for x in open(os.path.join(run, "results.jsonl")) if x.strip()]
    try:
        s = json.load(open(os.path.join(run, "settings.json")))
    except (OSError, ValueError):
        s = {}
    sysc = [r for r in rows if r.get("kind") == "syscalls"]
    rows = [r for r in rows if r.get("kind") == "load"]
    seen = {r["proxy"] for r in rows}
    proxies = [p for p in ORDER if p in seen] + sorted(seen - set(ORDER))
    keys = sorted({(r["path"], r["conns"]) for r in rows}, key=lambda k: (k[0], k[1]))

    print(f"# io_uring against epoll: {os.path.basename(run.rstrip('/'))}\n")
    print(f"{s.get('date', '?')}, kernel {s.get('kernel', '?')}, {s.get('nproc', '?')} cores, "
          f"commit {s.get('commit', '?')}; nginx {s.get('nginx', '?')}; Pier {s.get('pier', 'n/a')}. "
          f"Every proxy with {s.get('workers', '?')} worker(s); wrk -t{s.get('threads', '?')}, "
          f"{s.get('duration', '?')} s a run, {s.get('reps', '?')} repetitions, proxies "
          f"interleaved. Cells: median (min–max) over the repetitions.\n")

    def runs(p, path, c):
        return [r for r in rows if r["proxy"] == p and r["path"] == path and r["conns"] == c]

    for path, c in keys:
        print(f"## {path}, {c} connections\n")
        print("| proxy | req/s | req/CPU-s | user µs/req | sys µs/req | CPU µs/req | sys share "
              "| switches/req | origin µs/req | wrk µs/req | upstream conns | errors | other CPU s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for p in proxies:
            rs = runs(p, path, c)
            if not rs:
                continue
            share = [r["sys_us_per_req"] / total_us(r) if total_us(r) else None for r in rs]
            errs = sum((r.get("socket_errors") or 0) + (r.get("non_2xx") or 0) for r in rs)
            print(f"| {LABEL.get(p, p)} | {cell([r.get('rps') for r in rs], '{:.0f}')} "
                  f"| {cell([r.get('req_per_cpu_s') for r in rs], '{:.0f}')} "
                  f"| {cell([r.get('user_us_per_req') for r in rs], '{:.1f}')} "
                  f"| {cell([r.get('sys_us_per_req') for r in rs], '{:.1f}')} "
                  f"| {cell([total_us(r) for r in rs], '{:.1f}')} "
                  f"| {cell([x * 100 if x is not None else None for x in share], '{:.0f}%')} "
                  f"| {cell([r.get('ctxsw_per_req') for r in rs], '{:.3f}')} "
                  f"| {cell([per_req(r, 'origin_cpu_s') for r in rs], '{:.1f}')} "
                  f"| {cell([per_req(r, 'wrk_cpu_s') for r in rs], '{:.1f}')} "
                  f"| {cell([r.get('upstream_conns') for r in rs], '{:.0f}')} "
                  f"| {errs} | {cell([r.get('other_cpu_s') for r in rs], '{:.1f}')} |")
        print()

    if "epoll" in seen and "uring" in seen:
        print("## io_uring ÷ epoll, same minimal proxy\n")
        compare(keys, runs, "uring")
    if "epoll" in seen and "uring-plain" in seen:
        print("## io_uring on a plain ring (no DEFER_TASKRUN) ÷ epoll\n")
        compare(keys, runs, "uring-plain")
    if "pier-epoll" in seen and "pier" in seen:
        print("## Pier: io_uring (its default) ÷ epoll (PIER_IO_URING=0)\n")
        compare(keys, runs, "pier", base="pier-epoll")

    if sysc:
        print("## System calls per request (perf stat, syscall tracepoints; /hello)\n")
        print("One more wrk run per proxy and connection count, outside the timed runs: "
              "`perf stat -e syscalls:sys_enter_*` on the proxy's processes while wrk runs. "
              "Kinds below 0.005 a request are left out; `total` counts every kind.\n")
        kinds = sorted({k for r in sysc if r.get("requests") for k, v in r["calls"].items()
                        if k != "sys_enter" and v / r["requests"] >= 0.005})
        print("| proxy | conns | " + " | ".join(kinds) + " | total |")
        print("|---|---|" + "---|" * (len(kinds) + 1))
        for r in sorted(sysc, key=lambda r: (r["conns"], ORDER.index(r["proxy"])
                                             if r["proxy"] in ORDER else 99)):
            n = r.get("requests")
            if not n:
                continue
            print(f"| {LABEL.get(r['proxy'], r['proxy'])} | {r['conns']} | "
                  + " | ".join(f"{r['calls'].get(k, 0) / n:.3f}" for k in kinds)
                  + f" | {r['calls'].get('sys_enter', 0) / n:.3f} |")
        print()

    if "nginx" in seen:
        print("## Requests per proxy CPU-second ÷ nginx's\n")
        others = [p for p in proxies if p != "nginx"]
        print("| path | conns | " + " | ".join(LABEL.get(p, p) for p in others) + " |")
        print("|---|---|" + "---|" * len(others))
        for path, c in keys:
            n = med([r.get("req_per_cpu_s") for r in runs("nginx", path, c)])
            cells = []
            for p in others:
                x = med([r.get("req_per_cpu_s") for r in runs(p, path, c)])
                cells.append(f"{x / n:.2f}×" if x and n else "—")
            print(f"| {path} | {c} | " + " | ".join(cells) + " |")
        print()


if __name__ == "__main__":
    main()
