#!/usr/bin/env python3
"""Measurement helpers for bench/h2.sh (standard library only; /proc helpers from tool.py).

Subcommands:
  h2load ...   run h2load against a proxy (HTTP/2 over TLS, or h2c with --kind h2c), append one
               JSON result line
  ghz ...      run ghz (gRPC unary) against a proxy, append one JSON result line, with the
               upstream connections the proxy opened to the gRPC server during the run
  idle ...     RSS of a proxy with N idle HTTP/2-over-TLS client connections (one request
               each, then held open)
  check-h2 [--cleartext] PORT   one HTTP/2-over-TLS (or h2c) GET /hello: exit 0 on 200
               "hello world" over h2
  report DIR   Markdown report of DIR/results.jsonl: medians and ranges per scenario
"""

import argparse
import asyncio
import json
import os
import re
import resource
import ssl
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tool  # noqa: E402


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def upstream_tuples(port):
    """The proxy-side port of every TCP connection to the gRPC server's port, any state
    (TIME-WAIT included, on whichever side closed first): one per connection a proxy opened
    to it within the last minute."""
    out = subprocess.run(["ss", "-Htan", f"( sport = :{port} or dport = :{port} )"],
                         capture_output=True, text=True).stdout
    s = set()
    for line in out.splitlines():
        f = line.split()
        if len(f) < 5 or f[0].startswith("LISTEN"):
            continue
        local, peer = f[3].rsplit(":", 1)[1], f[4].rsplit(":", 1)[1]
        s.add(peer if local == str(port) else local)
    return s


def _run_load(a, cmd, parse):
    before = tool.stat_split(a.pid)
    busy0, t0 = tool.busy_seconds(), time.monotonic()
    la0 = loadavg()
    up0 = upstream_tuples(a.upstream_port) if a.upstream_port else None
    acc0 = tool.origin_accepts(a.origin_port) if a.origin_port else None
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.duration * 4 + 60)
    wall = time.monotonic() - t0
    busy = tool.busy_seconds() - busy0
    after = tool.stat_split(a.pid)
    r = parse(p.stdout)
    r.update(
        kind=a.kind, proxy=a.proxy, conns=a.conns, streams=a.streams, rep=a.rep,
        per_conn=a.streams // a.conns, path=a.path if a.kind != "grpc" else None, duration=a.duration, load1=la0, machine_busy=busy / wall / os.cpu_count(),
        user_s=after[0] - before[0], sys_s=after[1] - before[1], rss_kib=after[2],
        cmd=" ".join(cmd), rc=p.returncode,
    )
    r["cpu_s"] = r["user_s"] + r["sys_s"]
    if up0 is not None:
        r["upstream_conns"] = len(upstream_tuples(a.upstream_port) - up0)
    if acc0 is not None:
        r["upstream_conns"] = tool.origin_accepts(a.origin_port) - acc0 - 1
    if r.get("requests") and r["cpu_s"] > 0:
        r["req_per_cpu_s"] = r["requests"] / r["cpu_s"]
        r["user_us"] = r["user_s"] / r["requests"] * 1e6
        r["sys_us"] = r["sys_s"] / r["requests"] * 1e6
    if p.returncode != 0:
        r["stderr"] = p.stderr[-2000:]
    with open(a.out, "a") as f:
        f.write(json.dumps(r) + "\n")
    print(f"{a.proxy:8} {a.kind} {r['path'] or ''} {a.streams:4} streams ({r['per_conn']}/conn): "
          f"{r.get('requests')} req, "
          f"{r.get('rps', 0):.0f} req/s, cpu {r['cpu_s']:.2f}s -> "
          f"{r.get('req_per_cpu_s', 0):.0f} req/CPU-s, upstream conns {r.get('upstream_conns')}, "
          f"load {la0:.2f}", file=sys.stderr)
    return 0 if p.returncode == 0 else 1


def parse_h2load(text):
    r = {"requests": None, "rps": None, "failed": None, "non_2xx": None}
    m = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", text)
    if m:
        r["rps"] = float(m.group(1))
    m = re.search(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded, (\d+) failed", text)
    if m:
        r["requests"], r["failed"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", text)
    if m:
        ok = int(m.group(1))
        r["non_2xx"] = sum(int(x) for x in m.groups()[1:])
        r["requests"] = ok  # count only good answers
    m = re.search(r"time for request:\s+(\S+)\s+(\S+)\s+(\S+)", text)
    if m:
        r["mean_ms"] = tool._ms(m.group(3))
    return r


def parse_ghz(text):
    r = {"requests": None, "rps": None, "failed": None}
    try:
        j = json.loads(text)
    except ValueError:
        return r
    dist = j.get("statusCodeDistribution") or {}
    ok = dist.get("OK", 0)
    r["requests"] = ok
    r["failed"] = sum(v for k, v in dist.items() if k != "OK")
    r["rps"] = j.get("rps")
    lat = {d["percentage"]: d["latency"] for d in (j.get("latencyDistribution") or [])}
    if 50 in lat:
        r["p50_ms"] = lat[50] / 1e6
    if 99 in lat:
        r["p99_ms"] = lat[99] / 1e6
    return r


def cmd_h2load(a):
    # http:// is h2c with prior knowledge (h2load's default for cleartext).
    scheme = "http" if a.kind == "h2c" else "https"
    url = f"{scheme}://127.0.0.1:{a.port}{a.path}"
    cmd = ["h2load", f"-c{a.conns}", f"-m{a.streams // a.conns}", f"-t{min(2, a.conns)}",
           f"-D{a.duration}", "--warm-up-time=1", "-H", "User-Agent: pier-bench", url]
    return _run_load(a, cmd, parse_h2load)


def cmd_ghz(a):
    cmd = [a.ghz, "--insecure", "--proto", a.proto, "--import-paths", os.path.dirname(a.proto),
           "--call", "grpc.testing.TestService/UnaryCall",
           "-d", '{"response_size": 16, "payload": {"body": "cGllci1iZW5jaC1wYXlsb2Fk"}}',
           f"--connections={a.conns}", f"-c{a.streams}", f"-z{a.duration}s",
           "--timeout=10s", "-O", "json", f"127.0.0.1:{a.port}"]
    return _run_load(a, cmd, parse_ghz)


# ---------------------------------------------------------------- idle HTTP/2 connections

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(typ, flags, stream, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes([typ, flags]) + stream.to_bytes(4, "big") + payload


def get_hello(scheme="https"):
    # HPACK: :method GET (2), :scheme https (7) or http (6), :path (4) "/hello", :authority (1)
    # literal.
    block = bytes([0x82, 0x87 if scheme == "https" else 0x86, 0x04, 6]) + b"/hello" + bytes([0x01, 9]) + b"127.0.0.1"
    return frame(1, 0x5, 1, block)  # END_STREAM | END_HEADERS


async def read_frame(reader):
    h = await reader.readexactly(9)
    n = int.from_bytes(h[:3], "big")
    payload = await reader.readexactly(n) if n else b""
    return h[3], h[4], int.from_bytes(h[5:9], "big") & 0x7FFFFFFF, payload


async def one_idle(port, ctx, held, sem):
    async with sem:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, ssl=ctx), 30)
        if writer.get_extra_info("ssl_object").selected_alpn_protocol() != "h2":
            raise RuntimeError("no h2 by ALPN")
        writer.write(PREFACE + frame(4, 0, 0) + get_hello())
        got_settings = done = False
        while not (got_settings and done):
            typ, flags, sid, _ = await asyncio.wait_for(read_frame(reader), 30)
            if typ == 4 and not flags & 1:
                writer.write(frame(4, 1, 0))
                got_settings = True
            elif sid == 1 and typ in (0, 1) and flags & 1:
                done = True
            elif typ == 7:
                raise RuntimeError("GOAWAY")
        await writer.drain()
        held.append((reader, writer))


async def idle_async(port, n, settle):
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    held = []
    sem = asyncio.Semaphore(100)
    await asyncio.gather(*(one_idle(port, ctx, held, sem) for _ in range(n)))
    await settle(held)
    for _, w in held:
        w.close()


def cmd_idle(a):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, a.n + 200)), hard))
    base = tool.stat_split(a.pid)
    res = {}

    async def settle(held):
        await asyncio.sleep(2)
        s = tool.stat_split(a.pid)
        res.update(rss=s[2], pss=s[3], open=len(held))

    asyncio.run(idle_async(a.port, a.n, settle))
    r = {"kind": "idle-h2", "proxy": a.proxy, "rep": a.rep, "n": a.n, "load1": loadavg(),
         "rss_before_kib": base[2], "rss_after_kib": res["rss"],
         "per_conn_kib": (res["rss"] - base[2]) / a.n}
    with open(a.out, "a") as f:
        f.write(json.dumps(r) + "\n")
    print(f"{a.proxy:8} idle h2 x{a.n}: RSS {base[2] / 1024:.1f} -> {res['rss'] / 1024:.1f} MB, "
          f"{r['per_conn_kib']:.1f} KiB/conn", file=sys.stderr)
    return 0


def cmd_check_h2(a):
    async def go():
        ctx = None
        if not a.cleartext:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            ctx.set_alpn_protocols(["h2"])
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", a.port, ssl=ctx), 10)
        if ctx and writer.get_extra_info("ssl_object").selected_alpn_protocol() != "h2":
            return "ALPN did not pick h2"
        writer.write(PREFACE + frame(4, 0, 0) + get_hello("http" if a.cleartext else "https"))
        body = b""
        status = None
        while True:
            typ, flags, sid, payload = await asyncio.wait_for(read_frame(reader), 10)
            if typ == 4 and not flags & 1:
                writer.write(frame(4, 1, 0))
            if sid == 1 and typ == 1:
                # :status 200 is static index 8 (0x88) when sent indexed.
                status = 200 if payload[:1] == b"\x88" or b"200" in payload else payload[:8]
            if sid == 1 and typ == 0:
                body += payload
            if sid == 1 and flags & 1:
                break
        writer.close()
        if status != 200 or body != b"hello world\n":
            return f"status {status!r}, body {body[:40]!r}"
        return None

    err = asyncio.run(go())
    if err:
        print(err)
        return 1
    return 0


# ---------------------------------------------------------------- report


def _fmt(v, digits=0):
    return "—" if v is None else f"{v:,.{digits}f}"


def _agg(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return None, None, None
    return statistics.median(vals), min(vals), max(vals)


def cmd_report(a):
    rows = [json.loads(l) for l in open(os.path.join(a.dir, "results.jsonl")) if l.strip()]
    out = []
    settings = os.path.join(a.dir, "settings.json")
    if os.path.exists(settings):
        out.append("Settings: `" + open(settings).read().strip().replace("\n", " ") + "`\n")
    for kind, title in (("h2", "HTTP/2 over TLS, h2load"),
                        ("h2c", "HTTP/2 cleartext (prior knowledge), h2load"),
                        ("grpc", "gRPC unary, ghz, UnaryCall (10 streams per connection)")):
        sel = [r for r in rows if r.get("kind") == kind]
        if not sel:
            continue
        # Results from before PATHS and PER_CONN: /hello, 10 streams a connection.
        for r in sel:
            r.setdefault("per_conn", 10)
            r.setdefault("path", None if kind == "grpc" else "/hello")
        out.append(f"### {title}\n")
        out.append("| proxy | path | streams (per conn) | req/CPU-s median (min–max) | × nginx (or pier-b) "
                   "| × haproxy | user µs/req | sys µs/req | req/s | upstream conns opened | failed | load1 | runs |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        cells = sorted({(r["path"] or "", r["per_conn"], r["streams"]) for r in sel})
        # Against nginx, or (a before/after run without nginx) against pier-b.
        ref = "nginx" if any(r["proxy"] == "nginx" for r in sel) else "pier-b"
        for path, per, streams in cells:
            cell = [r for r in sel if (r["path"] or "", r["per_conn"], r["streams"]) == (path, per, streams)]
            base = _agg([r.get("req_per_cpu_s") for r in cell if r["proxy"] == ref])[0]
            hap = _agg([r.get("req_per_cpu_s") for r in cell if r["proxy"] == "haproxy"])[0]
            for proxy in ("pier", "pier-b", "nginx", "haproxy"):
                rs = [r for r in cell if r["proxy"] == proxy]
                if not rs:
                    continue
                med, lo, hi = _agg([r.get("req_per_cpu_s") for r in rs])
                ratio = f"{med / base:.2f}×" if med and base else "—"
                hratio = f"{med / hap:.2f}×" if med and hap else "—"
                up = _agg([r.get("upstream_conns") for r in rs])
                reqs = _agg([r.get("requests") for r in rs])[0]
                upshare = f" ({up[0] / reqs * 100:.3f}% of req)" if up[0] is not None and reqs else ""
                out.append(
                    f"| {proxy} | {path or '—'} | {streams} ({per}) | {_fmt(med)} ({_fmt(lo)}–{_fmt(hi)}) "
                    f"| {ratio} | {hratio} "
                    f"| {_fmt(_agg([r.get('user_us') for r in rs])[0], 1)} "
                    f"| {_fmt(_agg([r.get('sys_us') for r in rs])[0], 1)} "
                    f"| {_fmt(_agg([r.get('rps') for r in rs])[0])} "
                    f"| {_fmt(up[0])} ({_fmt(up[1])}–{_fmt(up[2])}){upshare} "
                    f"| {sum(r.get('failed') or 0 for r in rs)} "
                    f"| {_fmt(_agg([r.get('load1') for r in rs])[0], 2)} | {len(rs)} |")
        out.append("")
    sel = [r for r in rows if r.get("kind") == "idle-h2"]
    if sel:
        out.append("### Memory per idle HTTP/2 connection (TLS, one request each, then held)\n")
        out.append("| proxy | connections | RSS before → after, MB (median) | KiB per connection median (min–max) |")
        out.append("|---|---|---|---|")
        for proxy in ("pier", "pier-b", "nginx", "haproxy"):
            rs = [r for r in sel if r["proxy"] == proxy]
            if not rs:
                continue
            med, lo, hi = _agg([r["per_conn_kib"] for r in rs])
            b = _agg([r["rss_before_kib"] for r in rs])[0] / 1024
            e = _agg([r["rss_after_kib"] for r in rs])[0] / 1024
            out.append(f"| {proxy} | {rs[0]['n']} | {b:.1f} → {e:.1f} | {med:.1f} ({lo:.1f}–{hi:.1f}) |")
        out.append("")
    print("\n".join(out))
    return 0


def main():
    ap = argparse.ArgumentParser()
    sp = ap.add_subparsers(dest="cmd", required=True)
    for name in ("h2load", "ghz"):
        m = sp.add_parser(name)
        for k in ("proxy", "out", "kind"):
            m.add_argument(f"--{k}", required=True)
        for k in ("pid", "port", "conns", "streams", "duration", "rep"):
            m.add_argument(f"--{k}", type=int, required=True)
        m.add_argument("--upstream-port", type=int, default=0)
        m.add_argument("--origin-port", type=int, default=0)
        m.add_argument("--path", default="/hello")
        m.add_argument("--proto", default="")
        m.add_argument("--ghz", default="ghz")
    i = sp.add_parser("idle")
    for k in ("proxy", "out"):
        i.add_argument(f"--{k}", required=True)
    for k in ("pid", "port", "n", "rep"):
        i.add_argument(f"--{k}", type=int, required=True)
    c = sp.add_parser("check-h2")
    c.add_argument("port", type=int)
    c.add_argument("--cleartext", action="store_true", help="h2c with prior knowledge, no TLS")
    r = sp.add_parser("report")
    r.add_argument("dir")
    a = ap.parse_args()
    return {"h2load": cmd_h2load, "ghz": cmd_ghz, "idle": cmd_idle, "check-h2": cmd_check_h2,
            "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
