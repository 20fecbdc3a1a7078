#!/usr/bin/env python3
"""Markdown report of a bench/redis_incr.sh run (results.jsonl, settings.json).

    python3 bench/redis_report.py bench/out/redis-YYYYmmddTHHMMSSZ > results.md
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import cell, kcell, med, ratio_cell  # noqa: E402  (same cells as bench/run.sh's)

ORDER = ["pier-redis", "pier-redis-b", "nginx-redis"]
LABEL = {"pier-redis": "Pier + lua-resty-redis", "pier-redis-b": "Pier (build B) + lua-resty-redis",
         "nginx-redis": "nginx + lua-resty-redis"}


def main():
    run = sys.argv[1]
    rows = [json.loads(x) for x in open(os.path.join(run, "results.jsonl")) if x.strip()]
    try:
        settings = json.load(open(os.path.join(run, "settings.json")))
    except (OSError, ValueError):
        settings = {}
    load = [r for r in rows if r.get("kind") == "load"]
    side = {(r["proxy"], r["conns"], r["rep"]): r for r in rows if r.get("kind") == "redis"}
    failed = [r for r in rows if r.get("kind") == "failed"]
    for r in load:
        r.update({k: v for k, v in side.get((r["proxy"], r["conns"], r["rep"]), {}).items()
                  if k.startswith("redis_") or k == "incrs"})
    out = []
    w = out.append
    w("# Redis INCR hook: Pier vs OpenResty-style nginx")
    w("")
    if settings:
        w(f"- date: {settings.get('date')}, {settings.get('nproc')} CPUs, kernel {settings.get('kernel')}; "
          f"nginx {settings.get('nginx')}, redis {settings.get('redis')}, Pier {settings.get('pier')} "
          f"(commit {settings.get('pier_commit')}); libraries {settings.get('lua_libs')}")
        w(f"- wrk -t{settings.get('threads')}, {settings.get('duration')} s per run, connections "
          f"{settings.get('conns')}, {settings.get('reps')} repetitions (proxies interleaved), "
          f"{settings.get('workers', 2)} workers per proxy")
    for r in failed:
        w(f"- **failed to start/check**: {r['proxy']} at {r['conns']} conns (rep {r['rep']})")
    w("- one content hook (bench/peers/redis/incr.lua) in both: lua-resty-redis `INCR` per "
      "request, `set_keepalive(10000, 100)`; cells are `median (min–max)` over repetitions; "
      "*req/CPU-s* = requests completed ÷ the proxy's own CPU seconds; *redis conns* = "
      "connections redis-server accepted during the run, and per 1,000 requests; *TCP segs/req* "
      "= TCP segments the machine received (all loopback) per request: 4 when every request "
      "reuses a pooled redis connection, about 7 more for each one opened and closed; "
      "*faults/req*, *switches/req* = the proxy's minor page faults and context switches "
      "(all its threads) per request; "
      "*INCRs − reqs* = INCRs redis counted minus requests wrk completed (requests cut off at "
      "the end, or errors)")
    w("")
    w("| conns | proxy | req/s | p50 ms | p99 ms | proxy CPU s | **req/CPU-s** | user µs/req "
      "| sys µs/req | faults/req | switches/req | redis CPU s | redis conns | per 1k req | TCP segs/req | INCRs − reqs "
      "| errors |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    conns_list = sorted({r["conns"] for r in load})
    seen = {r["proxy"] for r in load}
    proxies = [p for p in ORDER if p in seen] + sorted(seen - set(ORDER))

    def runs(p, c):
        return sorted((r for r in load if r["proxy"] == p and r["conns"] == c), key=lambda r: r["rep"])

    for c in conns_list:
        for p in proxies:
            rs = runs(p, c)
            if not rs:
                continue
            errs = sum((r.get("socket_errors") or 0) + (r.get("non_2xx") or 0) for r in rs)
            extra = [r["incrs"] - r["requests"] if r.get("requests") is not None and "incrs" in r
                     else None for r in rs]

            def per_req(key, scale):
                return [r[key] * scale / r["requests"] if r.get("requests") and key in r
                        else None for r in rs]
            w(f"| {c} | {LABEL.get(p, p)} | {kcell([r.get('rps') for r in rs])} "
              f"| {cell([r.get('p50_ms') for r in rs], '{:.2f}')} "
              f"| {cell([r.get('p99_ms') for r in rs], '{:.2f}')} "
              f"| {cell([r.get('cpu_s') for r in rs], '{:.2f}')} "
              f"| **{kcell([r.get('req_per_cpu_s') for r in rs])}** "
              f"| {cell([r.get('user_us_per_req') for r in rs], '{:.1f}')} "
              f"| {cell([r.get('sys_us_per_req') for r in rs], '{:.1f}')} "
              f"| {cell([r.get('minflt_per_req') for r in rs], '{:.3f}')} "
              f"| {cell([r.get('ctxsw_per_req') for r in rs], '{:.3f}')} "
              f"| {cell([r.get('redis_cpu_s') for r in rs], '{:.2f}')} "
              f"| {cell([r.get('redis_conns_opened') for r in rs], '{:.0f}')} "
              f"| {cell(per_req('redis_conns_opened', 1000), '{:.0f}')} "
              f"| {cell(per_req('redis_tcp_segs', 1), '{:.2f}')} "
              f"| {cell(extra, '{:.0f}')} | {errs} |")
    w("")
    for pa, pb, what in [("pier-redis", "nginx-redis", "Pier ÷ nginx"),
                         ("pier-redis-b", "nginx-redis", "Pier (build B) ÷ nginx"),
                         ("pier-redis", "pier-redis-b", "Pier ÷ Pier (build B)")]:
        if pa not in seen or pb not in seen:
            continue
        w(f"{what} (ratio of the medians; per-repetition range in brackets):")
        w("")
        w("| conns | req/CPU-s | user µs/req | sys µs/req |")
        w("|---|---|---|---|")
        for c in conns_list:
            a, b = runs(pa, c), runs(pb, c)
            w(f"| {c} | {ratio_cell(a, b, 'req_per_cpu_s')} | {ratio_cell(a, b, 'user_us_per_req')} "
              f"| {ratio_cell(a, b, 'sys_us_per_req')} |")
        w("")
    print("\n".join(out))
    return 0 if med([r.get("rps") for r in load]) is not None else 1


if __name__ == "__main__":
    sys.exit(main())
