#!/usr/bin/env python3
"""Turn a bench/run.sh run directory (results.jsonl, settings.json) into a Markdown report.

    python3 bench/report.py bench/out/run-YYYYmmddTHHMMSSZ > results.md
"""

import json
import os
import statistics
import sys

ORDER = ["pier", "pier-b", "pier-uring", "pier-epoll", "nginx", "haproxy", "pier-lua", "nginx-lua", "pier-limit", "pier-noanalytics"]
LABEL = {
    "pier": "Pier",
    "pier-b": "Pier, build B (PIER_BIN_B)",
    "pier-uring": "Pier, io_uring (PIER_IO_URING=1)",
    "pier-epoll": "Pier, epoll (PIER_IO_URING=0)",
    "nginx": "nginx",
    "haproxy": "HAProxy",
    "pier-lua": "Pier + Lua hook",
    "nginx-lua": "nginx + Lua hook",
    "pier-limit": "Pier + rate limit",
    "pier-noanalytics": "Pier, analytics off",
}
# (numerator, denominator, target) ratios of requests per proxy CPU-second.
RATIOS = [
    ("pier", "nginx", 1.2),
    ("pier", "haproxy", 1.0),
    ("pier-lua", "nginx-lua", 1.5),
    ("pier", "pier-epoll", 1.1),
    ("pier-uring", "pier-epoll", 1.1),
    ("pier-epoll", "nginx", 1.0),
]


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def cell(xs, fmt, scale=1.0):
    """'median (min–max)' of a list, or the single value, or '—'."""
    xs = [x * scale for x in xs if x is not None]
    if not xs:
        return "—"
    m = statistics.median(xs)
    if len(xs) == 1:
        return fmt.format(m)
    return f"{fmt.format(m)} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def k(x):
    return "{:.1f}k".format(x / 1000)


def kcell(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "—"
    m = statistics.median(xs)
    if len(xs) == 1:
        return k(m)
    return f"{k(m)} ({k(min(xs))}–{k(max(xs))})"


def proxies_in(rows):
    seen = {r["proxy"] for r in rows}
    return [p for p in ORDER if p in seen] + sorted(seen - set(ORDER))


def main():
    run = sys.argv[1]
    rows = []
    with open(os.path.join(run, "results.jsonl")) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    settings = {}
    try:
        with open(os.path.join(run, "settings.json")) as f:
            settings = json.load(f)
    except (OSError, ValueError):
        pass
    skipped = []
    try:
        with open(os.path.join(run, "skipped.txt")) as f:
            skipped = [x.strip() for x in f if x.strip()]
    except OSError:
        pass

    # A new connection per request (TLS=1): its req/CPU-s is handshakes per CPU-second.
    for r in rows:
        if r.get("kind") == "handshake":
            r["kind"] = "load"
            r["path"] = r["path"] + " (TLS handshake per request)"
    # Resumed (or, as a control, never resumed) TLS handshakes from tool.py resume: one
    # connection per request as well, from a Python client that can offer a session.
    resume = [r for r in rows if r.get("kind") == "resume"]
    for r in resume:
        r["kind"] = "load"
        r["path"] = (f"{r['path']} ({r['mode']} TLS {r['tls']} handshake per request, "
                     "Python client)")
    load = [r for r in rows if r.get("kind") == "load"]
    idle = [r for r in rows if r.get("kind") == "idle"]
    failed = [r for r in rows if r.get("kind") == "failed"]
    out = []
    w = out.append

    w("# Benchmark results")
    w("")
    if settings:
        w(f"- date: {settings.get('date')}, {settings.get('nproc')} CPUs, kernel {settings.get('kernel')}; "
          f"nginx {settings.get('nginx')}, HAProxy {settings.get('haproxy')}, "
          f"Pier {settings.get('pier')} (commit {settings.get('pier_commit')})")
        w(f"- wrk -t{settings.get('threads')}, {settings.get('duration')} s per run, "
          f"connections {settings.get('conns')}, paths {settings.get('paths')}, "
          f"{settings.get('reps')} repetitions (proxies interleaved), "
          f"idle test {settings.get('idle_conns')} connections")
    for s in skipped:
        w(f"- **skipped** {s}")
    for r in failed:
        w(f"- **failed to start/check**: {r['proxy']} for {r['path']} at {r['conns']} conns (rep {r['rep']})")
    w("- cells are `median (min–max)` over repetitions; *req/CPU-s* = requests completed ÷ "
      "the proxy's own CPU seconds (utime+stime of all its processes); *user µs/req* and "
      "*sys µs/req* = the proxy's user (utime) and system (stime) CPU time ÷ requests completed; "
      "*upstream conns* = new "
      "connections the origin accepted during the run (stub_status); *other CPU s* = CPU "
      "time used during the run by anything but the proxy, the origin and wrk (noise)")
    w("")

    scenarios = []
    for r in load:
        key = (r["path"], r["conns"])
        if key not in scenarios:
            scenarios.append(key)

    def runs(proxy, path, conns):
        return sorted((r for r in load if r["proxy"] == proxy and r["path"] == path
                       and r["conns"] == conns), key=lambda r: r["rep"])

    if load:
        w("## Throughput, latency, CPU efficiency")
        w("")
        w("| scenario | proxy | req/s | p50 ms | p99 ms | proxy CPU s | **req/CPU-s** "
          "| user µs/req | sys µs/req "
          "| upstream conns opened | % of requests | RSS MB | errors | other CPU s |")
        w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for path, conns in scenarios:
            for p in proxies_in(load):
                rs = runs(p, path, conns)
                if not rs:
                    continue
                errs = sum((r.get("socket_errors") or 0) + (r.get("non_2xx") or 0) for r in rs)
                bad = sum(1 for r in rs if r.get("error"))
                err = str(errs) + (f", {bad} failed runs" if bad else "")
                pct = [100.0 * r["upstream_conns"] / r["requests"] if r.get("requests") else None
                       for r in rs]
                w(f"| {path}, {conns} conns | {LABEL.get(p, p)} "
                  f"| {kcell([r.get('rps') for r in rs])} "
                  f"| {cell([r.get('p50_ms') for r in rs], '{:.2f}')} "
                  f"| {cell([r.get('p99_ms') for r in rs], '{:.2f}')} "
                  f"| {cell([r.get('cpu_s') for r in rs], '{:.2f}')} "
                  f"| **{kcell([r.get('req_per_cpu_s') for r in rs])}** "
                  f"| {cell([r.get('user_us_per_req') for r in rs], '{:.1f}')} "
                  f"| {cell([r.get('sys_us_per_req') for r in rs], '{:.1f}')} "
                  f"| {cell([r.get('upstream_conns') for r in rs], '{:.0f}')} "
                  f"| {cell(pct, '{:.2f}')} "
                  f"| {cell([r.get('rss_kib') for r in rs], '{:.1f}', 1 / 1024)} "
                  f"| {err} "
                  f"| {cell([r.get('other_cpu_s') for r in rs], '{:.1f}')} |")
        w("")

        have = set(proxies_in(load))
        ratios = [(a, b, t) for a, b, t in RATIOS if a in have and b in have]
        if ratios:
            w("## Ratios of requests per proxy CPU-second")
            w("")
            w("Ratio of the medians; in brackets the range of the per-repetition ratios "
              "(each repetition runs the proxies back to back).")
            w("")
            w("| scenario | " + " | ".join(f"{LABEL[a]} ÷ {LABEL[b]} (target ≥ {t})"
                                          for a, b, t in ratios) + " |")
            w("|---|" + "---|" * len(ratios))
            for path, conns in scenarios:
                cells = []
                for a, b, _ in ratios:
                    ra, rb = runs(a, path, conns), runs(b, path, conns)
                    ma = med([r.get("req_per_cpu_s") for r in ra])
                    mb = med([r.get("req_per_cpu_s") for r in rb])
                    if not ma or not mb:
                        cells.append("—")
                        continue
                    byrep = {r["rep"]: r.get("req_per_cpu_s") for r in rb}
                    per = [r["req_per_cpu_s"] / byrep[r["rep"]] for r in ra
                           if r.get("req_per_cpu_s") and byrep.get(r["rep"])]
                    c = f"{ma / mb:.2f}×"
                    if len(per) > 1:
                        c += f" ({min(per):.2f}–{max(per):.2f})"
                    cells.append(c)
                w(f"| {path}, {conns} conns | " + " | ".join(cells) + " |")
            w("")

        if ratios:
            w("## User and system CPU per request: ratios")
            w("")
            w("µs of user (utime) and system (stime) CPU per request, summed over all the "
              "proxy's processes; each cell is the first proxy's ÷ the second's, ratio of the "
              "medians, with the range of the per-repetition ratios in brackets. Below 1 means "
              "the first proxy spends less (system time is mostly the kernel's work for the "
              "proxy's socket syscalls).")
            w("")
            heads = []
            for a, b, _ in ratios:
                heads += [f"{LABEL[a]} ÷ {LABEL[b]} user", f"{LABEL[a]} ÷ {LABEL[b]} sys"]
            w("| scenario | " + " | ".join(heads) + " |")
            w("|---|" + "---|" * len(heads))
            for path, conns in scenarios:
                cells = []
                for a, b, _ in ratios:
                    for key in ("user_us_per_req", "sys_us_per_req"):
                        cells.append(ratio_cell(runs(a, path, conns), runs(b, path, conns), key))
                w(f"| {path}, {conns} conns | " + " | ".join(cells) + " |")
            w("")

        pairs = [(a, b) for a, b in (("pier-lua", "pier"), ("nginx-lua", "nginx"), ("pier-limit", "pier"))
                 if a in have and b in have]
        if pairs:
            w("## Cost of the Lua access hook (and of Pier's rate limit) over the same proxy without it")
            w("")
            w("Drop in requests per CPU-second (1 − with-hook ÷ without-hook, medians). "
              "Targets for Pier: Lua hook ≤ 10%, rate limit on every request ≤ 3%.")
            w("")
            w("| scenario | " + " | ".join(f"{LABEL[a]} vs {LABEL[b]}" for a, b in pairs) + " |")
            w("|---|" + "---|" * len(pairs))
            for path, conns in scenarios:
                cells = []
                for a, b in pairs:
                    ma = med([r.get("req_per_cpu_s") for r in runs(a, path, conns)])
                    mb = med([r.get("req_per_cpu_s") for r in runs(b, path, conns)])
                    cells.append(f"{100 * (1 - ma / mb):+.1f}%" if ma and mb else "—")
                w(f"| {path}, {conns} conns | " + " | ".join(cells) + " |")
            w("")

    if resume:
        w("## TLS handshakes per request from the Python client: resumed or not")
        w("")
        w("`bench/tool.py resume`: each of the clients opens one connection after another "
          "(one GET, `Connection: close`, response read until the proxy closes); "
          "*resumed* runs offer the session (ticket) the client's previous connection got, "
          "after a warm-up of one full handshake per client outside the measurement; the "
          "counts come from `SSLObject.session_reused`. req/s and latency are bounded by the "
          "client (Python), not the proxy; *client CPU s* is its own CPU time.")
        w("")
        w("| scenario | proxy | handshakes (sum) | resumed | full | failed | bad responses "
          "| client CPU s | load avg before |")
        w("|---|---|---|---|---|---|---|---|---|")
        seen = []
        for r in resume:
            if (r["path"], r["conns"]) not in seen:
                seen.append((r["path"], r["conns"]))
        for path, conns in seen:
            for p in proxies_in(resume):
                rs = [r for r in resume if r["proxy"] == p and r["path"] == path
                      and r["conns"] == conns]
                if not rs:
                    continue
                w(f"| {path}, {conns} conns | {LABEL.get(p, p)} "
                  f"| {sum(r['requests'] or 0 for r in rs)} | {sum(r['resumed'] for r in rs)} "
                  f"| {sum(r['full'] for r in rs)} "
                  f"| {sum(r['socket_errors'] + r.get('warm_errors', 0) for r in rs)} "
                  f"| {sum(r['non_2xx'] for r in rs)} "
                  f"| {cell([r.get('client_cpu_s') for r in rs], '{:.1f}')} "
                  f"| {cell([r.get('loadavg_before') for r in rs], '{:.1f}')} |")
        w("")

    if idle:
        tls = any(r.get("scheme") == "https" for r in idle)
        w("## Memory with idle keep-alive client connections" + (" (TLS)" if tls else ""))
        w("")
        w("Each connection sent one GET /hello, read the response and stayed open; RSS and PSS "
          "are summed over all the proxy's processes (PSS splits shared pages between them)."
          + (" Every connection made a full TLS 1.3 handshake (no resumption)." if tls else ""))
        w("")
        w("| proxy | RSS before MB | RSS with idle conns MB | KiB per conn | PSS with idle conns MB "
          "| opened (failed) | still reusable (sample) |")
        w("|---|---|---|---|---|---|---|")
        for p in proxies_in(idle):
            rs = [r for r in idle if r["proxy"] == p]
            per = [(r["rss_kib"] - r["rss0_kib"]) / r["opened"] if r["opened"] else None for r in rs]
            w(f"| {LABEL.get(p, p)} | {cell([r['rss0_kib'] for r in rs], '{:.1f}', 1 / 1024)} "
              f"| {cell([r['rss_kib'] for r in rs], '{:.1f}', 1 / 1024)} "
              f"| {cell(per, '{:.1f}')} "
              f"| {cell([r['pss_kib'] for r in rs], '{:.1f}', 1 / 1024)} "
              f"| {cell([r['opened'] for r in rs], '{:.0f}')} ({sum(r['failed'] for r in rs)}) "
              f"| {sum(r['reuse_ok'] for r in rs)}/{sum(r['reuse_sampled'] for r in rs)} |")
        w("")

    targets = target_rows(load, idle, scenarios, runs)
    if targets:
        w("## Targets (issues 2 and 3)")
        w("")
        w("| target | scenario | measured | met? |")
        w("|---|---|---|---|")
        out.extend(targets)
        w("")
    print("\n".join(out))


def ratio_cell(ra, rb, key):
    """'median(a) ÷ median(b)×' with the range of the per-repetition ratios, or '—'."""
    ma = med([r.get(key) for r in ra])
    mb = med([r.get(key) for r in rb])
    if ma is None or not mb:
        return "—"
    byrep = {r["rep"]: r.get(key) for r in rb}
    per = [r[key] / byrep[r["rep"]] for r in ra
           if r.get(key) is not None and byrep.get(r["rep"])]
    c = f"{ma / mb:.2f}×"
    if len(per) > 1:
        c += f" ({min(per):.2f}–{max(per):.2f})"
    return c


def target_rows(load, idle, scenarios, runs):
    have = {r["proxy"] for r in load}
    rows = []

    def m(p, path, conns, key):
        return med([r.get(key) for r in runs(p, path, conns)])

    def yes(ok):
        return "yes" if ok else "**no**"

    for path, conns in scenarios:
        sc = f"{path}, {conns} conns"
        for a, b, t in RATIOS:
            if a in have and b in have:
                x, y = m(a, path, conns, "req_per_cpu_s"), m(b, path, conns, "req_per_cpu_s")
                if x and y:
                    rows.append(f"| {LABEL[a]} req/CPU-s ≥ {t}× {LABEL[b]} | {sc} | "
                                f"{x / y:.2f}× | {yes(x / y >= t)} |")
        # The Python handshake client's latencies are its own queueing, not the proxy's.
        if "pier" in have and "nginx" in have and "Python client" not in path:
            x, y = m("pier", path, conns, "p99_ms"), m("nginx", path, conns, "p99_ms")
            if x is not None and y is not None:
                rows.append(f"| Pier p99 ≤ nginx p99 | {sc} | {x:.2f} ms vs {y:.2f} ms | {yes(x <= y)} |")
        if "pier" in have and conns >= 500:
            pct = med([100.0 * r["upstream_conns"] / r["requests"]
                       for r in runs("pier", path, conns) if r.get("requests")])
            if pct is not None:
                rows.append(f"| Pier upstream conns opened ≤ 1% of requests | {sc} | "
                            f"{pct:.3f}% | {yes(pct <= 1.0)} |")
        if "pier-lua" in have and "pier" in have:
            x, y = m("pier-lua", path, conns, "req_per_cpu_s"), m("pier", path, conns, "req_per_cpu_s")
            if x and y:
                o = 100 * (1 - x / y)
                rows.append(f"| Pier Lua hook overhead ≤ 10% | {sc} | {o:+.1f}% | {yes(o <= 10)} |")
        if "pier-limit" in have and "pier" in have:
            x, y = m("pier-limit", path, conns, "req_per_cpu_s"), m("pier", path, conns, "req_per_cpu_s")
            if x and y:
                o = 100 * (1 - x / y)
                rows.append(f"| Pier rate-limit overhead ≤ 3% | {sc} | {o:+.1f}% | {yes(o <= 3)} |")
        if "pier-noanalytics" in have and "pier" in have:
            x, y = m("pier", path, conns, "req_per_cpu_s"), m("pier-noanalytics", path, conns, "req_per_cpu_s")
            if x and y:
                o = 100 * (1 - x / y)
                rows.append(f"| Pier analytics overhead ≤ 3% | {sc} | {o:+.1f}% | {yes(o <= 3)} |")
    ip = {p: med([r["rss_kib"] for r in idle if r["proxy"] == p]) for p in ("pier", "nginx")}
    if ip["pier"] is not None and ip["nginx"] is not None:
        rows.append(f"| Pier RSS with idle conns ≤ nginx's | idle | {ip['pier'] / 1024:.1f} MB vs "
                    f"{ip['nginx'] / 1024:.1f} MB | {yes(ip['pier'] <= ip['nginx'])} |")
    return rows


if __name__ == "__main__":
    main()
