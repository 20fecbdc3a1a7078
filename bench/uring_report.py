#!/usr/bin/env python3
"""The report of a bench/uring.sh run directory (results.jsonl, settings.json).

    python3 bench/uring_report.py bench/out/uring-YYYYmmddTHHMMSSZ
"""

import json
import os
import statistics
import sys

LABEL = {
    "epoll": "uring-proxy, epoll (tokio current_thread)",
    "uring": "uring-proxy, io_uring",
    "nginx": "nginx proxy_pass",
    "pier": "Pier",
}
ORDER = ["epoll", "uring", "nginx", "pier"]
THRESHOLD = 0.10  # issue 34: adopt io_uring only if it saves >= 10% CPU per request


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def cell(xs, fmt):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "—"
    m = statistics.median(xs)
    if len(xs) == 1:
        return fmt.format(m)
    return f"{fmt.format(m)} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def total_us(r):
    if r.get("user_us_per_req") is None or r.get("sys_us_per_req") is None:
        return None
    return r["user_us_per_req"] + r["sys_us_per_req"]


def main():
    run = sys.argv[1]
    rows = [json.loads(x) for x in open(os.path.join(run, "results.jsonl")) if x.strip()]
    try:
        s = json.load(open(os.path.join(run, "settings.json")))
    except (OSError, ValueError):
        s = {}
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
              "| switches/req | upstream conns | errors | other CPU s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
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
                  f"| {cell([r.get('upstream_conns') for r in rs], '{:.0f}')} "
                  f"| {errs} | {cell([r.get('other_cpu_s') for r in rs], '{:.1f}')} |")
        print()

    if "epoll" in seen and "uring" in seen:
        print("## io_uring ÷ epoll, same minimal proxy\n")
        print("Saved: (epoll − io_uring) ÷ epoll's CPU µs a request, from the medians; in "
              "brackets the same from each repetition's pair (the two modes run back to back). "
              "The sys and user columns are each part's saving as a share of epoll's *total* "
              "CPU a request, so they add up to the total.\n")
        print("| path | conns | req/CPU-s io_uring ÷ epoll | total CPU/req saved | of which sys "
              "| of which user | ≥ 10%? |")
        print("|---|---|---|---|---|---|---|")
        for path, c in keys:
            e, u = runs("epoll", path, c), runs("uring", path, c)
            if not e or not u:
                continue
            et, ut = med([total_us(r) for r in e]), med([total_us(r) for r in u])
            es, us = med([r["sys_us_per_req"] for r in e]), med([r["sys_us_per_req"] for r in u])
            eu, uu = med([r["user_us_per_req"] for r in e]), med([r["user_us_per_req"] for r in u])
            ratio = med([r["req_per_cpu_s"] for r in u]) / med([r["req_per_cpu_s"] for r in e])
            pairs = [(a, b) for a in e for b in u if a["rep"] == b["rep"]]
            per = [1 - total_us(b) / total_us(a) for a, b in pairs if total_us(a) and total_us(b)]
            saved = 1 - ut / et
            rng = f" ({min(per) * 100:+.0f}% to {max(per) * 100:+.0f}%)" if len(per) > 1 else ""
            verdict = "yes" if saved >= THRESHOLD and (not per or min(per) >= THRESHOLD) else (
                "borderline" if saved >= THRESHOLD else "no")
            print(f"| {path} | {c} | {ratio:.2f}× | {saved * 100:+.1f}%{rng} "
                  f"| {(es - us) / et * 100:+.1f}% ({es:.1f} → {us:.1f} µs) "
                  f"| {(eu - uu) / et * 100:+.1f}% ({eu:.1f} → {uu:.1f} µs) | {verdict} |")
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
