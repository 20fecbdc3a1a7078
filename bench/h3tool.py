#!/usr/bin/env python3
"""Measurement helpers for bench/h3.sh (standard library only; /proc helpers from tool.py).

Subcommands:
  load ...     run bench/h3load (HTTP/3, or HTTP/2 over TLS) against a proxy and append one
               JSON result line: the client's counts and latencies, the proxy's user and
               system CPU from /proc, the connections it opened to the origin, the client's
               own CPU and what else the machine ran
  check ...    one GET /hello and one GET /4k.bin through the proxy with h3load (HTTP/3, or
               --proto h2): exit 0 when both are 200 with 12 and 4096 bytes
  report DIR   Markdown report of DIR/results.jsonl: medians and ranges per scenario, Pier ÷
               Caddy per CPU-second, and Pier's CPU per request over HTTP/3 ÷ over HTTP/2
"""

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tool  # noqa: E402


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def h3load_cmd(a, path, duration, streams, conns, newconn):
    cmd = [a.h3load, "-proto", a.proto, "-url", f"https://127.0.0.1:{a.port}{path}",
           "-m", str(streams), "-c", str(conns), "-d", f"{duration}s", "-timeout", "10s"]
    if newconn:
        cmd.append("-newconn")
    if a.cacert:
        cmd += ["-cacert", a.cacert]
    if path == "/hello":
        cmd += ["-expect-size", "12"]
    elif path == "/4k.bin":
        cmd += ["-expect-size", "4096"]
    return cmd


LOG_ERR = re.compile(r"(?i)\b(error|panic|panicked)\b")


def log_errors(path):
    """Lines of the proxy's log that name an error or a panic (none when there is no log)."""
    if not path:
        return 0
    try:
        with open(path, errors="replace") as f:
            return sum(1 for line in f if LOG_ERR.search(line))
    except OSError:
        return 0


def cmd_load(a):
    newconn = a.mode == "newconn"
    cmd = h3load_cmd(a, a.path, a.duration, a.streams, a.conns, newconn)
    # Warm-up (keep-alive mode): the same load for --warmup seconds, unmeasured, in a call of
    # its own, so the measured call's connections meet a proxy past its first requests.
    if a.warmup and not newconn:
        w = h3load_cmd(a, a.path, a.warmup, a.streams, a.conns, False)
        subprocess.run(w, capture_output=True, text=True, timeout=a.warmup + 60)
        time.sleep(0.3)  # the proxy logs what the warm-up's end did before the count starts
    le0 = log_errors(a.log)
    before = tool.stat_split(a.pid)
    fs0 = tool.faults_switches(a.pid)
    origin0 = tool.stat(a.origin_pid)[0]
    busy0, t0, cli0 = tool.busy_seconds(), time.monotonic(), children_cpu()
    la0 = loadavg()
    acc0 = tool.origin_accepts(a.origin_port)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.duration + 60)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = "h3load did not end in time (killed)", -9
    wall = time.monotonic() - t0
    after = tool.stat_split(a.pid)
    fs1 = tool.faults_switches(a.pid)
    origin = tool.stat(a.origin_pid)[0] - origin0
    busy = tool.busy_seconds() - busy0
    client = children_cpu() - cli0
    acc1 = tool.origin_accepts(a.origin_port)
    time.sleep(0.3)  # let the proxy log what the end of the run did to it
    le1 = log_errors(a.log)
    try:
        r = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        r = {"requests": 0, "errors": None}
    user, sys_ = after[0] - before[0], after[1] - before[1]
    cpu = user + sys_
    n = r.get("requests") or 0
    r.update(
        kind="h3bench", proxy=a.proxy, proto=a.proto, mode=a.mode, path=a.path,
        conns=a.conns if not newconn else 0, streams=a.streams, rep=a.rep,
        duration=a.duration, load1=la0, wall=wall, rc=rc, cmd=" ".join(cmd),
        user_s=user, sys_s=sys_, cpu_s=cpu, rss_kib=after[2], nprocs=after[4],
        client_cpu_s=client, origin_cpu_s=origin,
        other_cpu_s=busy - cpu - origin - client,
        upstream_conns=acc1 - acc0 - 1,  # -1: the second stub_status query's own
        proxy_log_errors=le1 - le0,
    )
    if n and cpu > 0:
        r["req_per_cpu_s"] = n / cpu
        r["user_us"] = user / n * 1e6
        r["sys_us"] = sys_ / n * 1e6
        r["minflt_per_req"] = (fs1[0] - fs0[0]) / n
        r["ctxsw_per_req"] = (fs1[1] - fs0[1]) / n
    if rc != 0:
        r["stderr"] = err[-2000:]
    with open(a.out, "a") as f:
        f.write(json.dumps(r) + "\n")
    errs = r.get("errors")
    kinds = r.get("error_kinds") or {}
    print(f"  {a.proxy:8} {a.proto} {a.mode:9} {a.path:8} m={a.streams:<4} c={r['conns']:<2} "
          f"{n} req ({errs} errors{' ' + json.dumps(kinds) if kinds else ''}), "
          f"{r.get('rps') or 0:.0f} req/s, p99 {r.get('p99_ms') or 0:.1f} ms; proxy cpu {cpu:.2f}s "
          f"(user {user:.2f} sys {sys_:.2f}) -> {r.get('req_per_cpu_s') or 0:.0f} req/CPU-s; "
          f"client cpu {client:.1f}s, other {r['other_cpu_s']:.1f}s, upstream conns "
          f"{r['upstream_conns']}, proxy log errors {r['proxy_log_errors']}, load {la0:.2f}",
          file=sys.stderr, flush=True)
    return 0 if rc == 0 and n else 1


def cmd_check(a):
    for path, size in (("/hello", 12), ("/4k.bin", 4096)):
        cmd = [a.h3load, "-proto", a.proto, "-url", f"https://127.0.0.1:{a.port}{path}",
               "-m", "1", "-c", "1", "-d", "300ms", "-expect-size", str(size)]
        if a.cacert:
            cmd += ["-cacert", a.cacert]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            print(f"GET {path} over {a.proto}: h3load timed out")
            return 1
        try:
            r = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            print(f"GET {path} over {a.proto}: no result ({p.stderr.strip()[-300:]})")
            return 1
        if not r.get("requests") or r.get("errors") or r.get("setup_errors"):
            print(f"GET {path} over {a.proto}: {r.get('requests')} ok, {r.get('errors')} errors "
                  f"{r.get('error_samples') or ''} {p.stderr.strip()[-300:]}")
            return 1
    return 0


# ---------------------------------------------------------------- report


def _agg(vals):
    v = [x for x in vals if x is not None]
    if not v:
        return None, None, None
    return statistics.median(v), min(v), max(v)


def _fmt(x, nd=0):
    if x is None:
        return "—"
    return f"{x:,.{nd}f}"


PROXY_NAMES = {
    ("pier", "h3"): "Pier, HTTP/3",
    ("caddy", "h3"): "Caddy, HTTP/3",
    ("pier-h2", "h2"): "Pier, HTTP/2 over TLS",
    ("caddy-h2", "h2"): "Caddy, HTTP/2 over TLS",
}
ORDER = [("pier", "h3"), ("caddy", "h3"), ("pier-h2", "h2"), ("caddy-h2", "h2")]


def scenario_name(mode, path, streams, conns):
    if mode == "newconn":
        return f"new connection per request, {path}, {streams} clients"
    return f"{path}, {streams} streams over {conns} connections"


def _ratio(x, target):
    """x with two decimals, or three when two would round it onto the target."""
    return f"{x:.3f}" if f"{x:.2f}" == f"{target:.2f}" and x != target else f"{x:.2f}"


def per_rep_ratio(rs_a, rs_b, key, invert=False):
    """Per-repetition ratios of key between two lists of results (matched by rep)."""
    b = {r["rep"]: r.get(key) for r in rs_b}
    out = []
    for r in rs_a:
        x, y = r.get(key), b.get(r["rep"])
        if x and y:
            out.append(y / x if invert else x / y)
    return out


def cmd_report(a):
    rows = [json.loads(l) for l in open(os.path.join(a.dir, "results.jsonl")) if l.strip()]
    rows = [r for r in rows if r.get("kind") == "h3bench"]
    out = []
    settings = os.path.join(a.dir, "settings.json")
    if os.path.exists(settings):
        out.append("Settings: `" + open(settings).read().strip().replace("\n", " ") + "`\n")
    scen = sorted({(r["mode"], r["path"], r["streams"], r["conns"]) for r in rows},
                  key=lambda s: (s[0] == "newconn", s[1], s[2]))
    out.append("### Per proxy\n")
    out.append("| scenario | proxy | req/s | p50 ms | p99 ms | proxy CPU s | **req/CPU-s** | user µs/req "
               "| sys µs/req | switches/req | upstream conns opened | RSS MB | errors | proxy log errors "
               "| client CPU s | other CPU s | runs |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for s in scen:
        mode, path, streams, conns = s
        for key in ORDER:
            rs = [r for r in rows if (r["mode"], r["path"], r["streams"], r["conns"]) == s
                  and (r["proxy"], r["proto"]) == key]
            if not rs:
                continue

            def cell(k, nd=0, scale=1.0):
                m, lo, hi = _agg([(r.get(k) * scale if r.get(k) is not None else None) for r in rs])
                return f"{_fmt(m, nd)} ({_fmt(lo, nd)}–{_fmt(hi, nd)})"

            med = _agg([r.get("req_per_cpu_s") for r in rs])
            summary[(s, key)] = rs
            errs = sum((r.get("errors") or 0) + (r.get("setup_errors") or 0) for r in rs)
            kinds = {}
            for r in rs:
                for k, v in (r.get("error_kinds") or {}).items():
                    kinds[k] = kinds.get(k, 0) + v
            errtxt = str(errs) + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))})"
                                  if kinds else "")
            out.append(
                f"| {scenario_name(*s)} | {PROXY_NAMES.get(key, key[0])} | {cell('rps')} "
                f"| {cell('p50_ms', 2)} | {cell('p99_ms', 2)} | {cell('cpu_s', 2)} "
                f"| **{_fmt(med[0])} ({_fmt(med[1])}–{_fmt(med[2])})** | {cell('user_us', 1)} "
                f"| {cell('sys_us', 1)} | {cell('ctxsw_per_req', 2)} | {cell('upstream_conns')} "
                f"| {cell('rss_kib', 1, 1 / 1024)} | {errtxt} "
                f"| {sum(r.get('proxy_log_errors') or 0 for r in rs)} | {cell('client_cpu_s', 1)} "
                f"| {cell('other_cpu_s', 1)} | {len(rs)} |")
    out.append("")

    out.append("### Ratios\n")
    out.append("Ratio of the medians; per-repetition ratios (proxies ran interleaved, one after "
               "another within a repetition) in brackets.\n")
    out.append("| scenario | Pier ÷ Caddy, HTTP/3 req/CPU-s (target ≥ 1.5×) | Pier HTTP/3 ÷ Pier "
               "HTTP/2-over-TLS, CPU per request (target ≤ 1.5×) | Pier HTTP/3 user, sys µs/req "
               "| Caddy HTTP/3 user, sys µs/req | Pier HTTP/2 user, sys µs/req |")
    out.append("|---|---|---|---|---|---|")
    jsummary = []
    for s in scen:
        p3 = summary.get((s, ("pier", "h3")))
        c3 = summary.get((s, ("caddy", "h3")))
        p2 = summary.get((s, ("pier-h2", "h2")))

        def med(rs, k="req_per_cpu_s"):
            return _agg([r.get(k) for r in rs])[0] if rs else None

        vs_caddy = vs_h2 = "—"
        row = {"scenario": scenario_name(*s), "mode": s[0], "path": s[1], "streams": s[2],
               "conns": s[3]}
        if p3 and c3 and med(p3) and med(c3):
            rr = per_rep_ratio(p3, c3, "req_per_cpu_s")
            x = med(p3) / med(c3)
            row.update(pier_div_caddy=x, pier_div_caddy_reps=rr)
            vs_caddy = (f"{_ratio(x, 1.5)}× ({', '.join(f'{v:.2f}' for v in rr)}) — "
                        f"{'met' if x >= 1.5 else '**not met**'}")
        if p3 and p2 and med(p3) and med(p2):
            # CPU per request is 1 / req_per_cpu_s: h3 cost ÷ h2 cost = h2 rate ÷ h3 rate.
            rr = per_rep_ratio(p3, p2, "req_per_cpu_s", invert=True)
            x = med(p2) / med(p3)
            row.update(pier_h3_cost_div_h2=x, pier_h3_cost_div_h2_reps=rr)
            vs_h2 = (f"{_ratio(x, 1.5)}× ({', '.join(f'{v:.2f}' for v in rr)}) — "
                     f"{'met' if x <= 1.5 else '**not met**'}")

        def us(rs):
            if not rs:
                return "—"
            return f"{_fmt(med(rs, 'user_us'), 1)}, {_fmt(med(rs, 'sys_us'), 1)}"

        for name, rs in (("pier_h3", p3), ("caddy_h3", c3), ("pier_h2", p2)):
            if rs:
                row[name] = {"req_per_cpu_s": med(rs), "user_us": med(rs, "user_us"),
                             "sys_us": med(rs, "sys_us"), "rps": med(rs, "rps"),
                             "p99_ms": med(rs, "p99_ms"),
                             "errors": sum((r.get("errors") or 0) for r in rs)}
        jsummary.append(row)
        out.append(f"| {scenario_name(*s)} | {vs_caddy} | {vs_h2} | {us(p3)} | {us(c3)} | {us(p2)} |")
    out.append("")
    with open(os.path.join(a.dir, "summary.json"), "w") as f:
        json.dump(jsummary, f, indent=1)
    print("\n".join(out))
    return 0


def main():
    ap = argparse.ArgumentParser()
    sp = ap.add_subparsers(dest="cmd", required=True)
    ld = sp.add_parser("load")
    for k in ("proxy", "out", "h3load", "path"):
        ld.add_argument(f"--{k}", required=True)
    ld.add_argument("--proto", choices=("h3", "h2"), default="h3")
    ld.add_argument("--mode", choices=("keepalive", "newconn"), default="keepalive")
    for k in ("pid", "port", "origin-pid", "origin-port", "streams", "duration", "rep"):
        ld.add_argument(f"--{k}", type=int, required=True)
    ld.add_argument("--conns", type=int, default=5)
    ld.add_argument("--warmup", type=int, default=1)
    ld.add_argument("--cacert", default="")
    ld.add_argument("--log", default="", help="the proxy's log: lines naming errors are counted")
    ck = sp.add_parser("check")
    ck.add_argument("--h3load", required=True)
    ck.add_argument("--port", type=int, required=True)
    ck.add_argument("--proto", choices=("h3", "h2"), default="h3")
    ck.add_argument("--cacert", default="")
    rp = sp.add_parser("report")
    rp.add_argument("dir")
    a = ap.parse_args()
    if a.cmd == "load":
        return cmd_load(a)
    if a.cmd == "check":
        return cmd_check(a)
    return cmd_report(a)


if __name__ == "__main__":
    sys.exit(main())
