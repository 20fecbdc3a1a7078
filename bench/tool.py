#!/usr/bin/env python3
"""Measurement helpers for bench/run.sh (standard library only).

Subcommands:
  port                      print a free 127.0.0.1 TCP port below the ephemeral range
  wait-port PORT SECS [--pid P]  wait until 127.0.0.1:PORT accepts TCP connections
  check PORT [--lua]        sanity-check a proxy: GET /hello is 200 "hello world";
                            with --lua also x-lua: 1 and 403 when X-Block is sent
  tree PID                  print PID and all its descendants
  stat PID                  print CPU seconds (user, sys) and RSS (KiB) of PID and all its
                            descendants
  measure ...               run wrk against a proxy and append one JSON result line
  idle ...                  RSS of a proxy with N idle keep-alive client connections open
  resume ...                TLS handshakes per proxy CPU-second, each resuming the session
                            its client's previous connection got (--full: never resuming)
  pier-config SRC DST       rewrite a Pier TOML config for the benchmark (2 workers,
                            access log off, room for 20k connections)
"""

import argparse
import asyncio
import json
import os
import random
import re
import resource
import socket
import subprocess
import sys
import time
import urllib.request

CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- ports


def free_port():
    """A free port below the ephemeral range.

    Ports from bind(0) come from the ephemeral range, which the benchmark's own
    client and upstream connections churn through by the tens of thousands; a
    proxy re-bound there per run could collide with one of them.
    """
    lo = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except OSError:
        pass
    lo = max(lo, 12000)
    for _ in range(200):
        port = random.randrange(10000, lo)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    # Fall back to the kernel's choice.
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        return s[s.rindex(")") + 2] != "Z"
    except OSError:
        return False


def wait_port(port, secs, pid=None):
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        if pid and not _alive(pid):
            return False  # the server exited: no point waiting
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


# ---------------------------------------------------------------- http


# TLS=1 runs: the proxies speak https (bench certificates, not verified here).
SCHEME = os.environ.get("BENCH_SCHEME", "http")


def _ssl_ctx():
    import ssl
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def http_get(port, path, headers=None, timeout=5.0, scheme="http"):
    """One request on a fresh connection; returns (status, headers dict, body)."""
    req = urllib.request.Request(f"{scheme}://127.0.0.1:{port}{path}", headers=headers or {})
    handlers = [urllib.request.ProxyHandler({})]
    if scheme == "https":
        handlers.append(urllib.request.HTTPSHandler(context=_ssl_ctx()))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def origin_accepts(port):
    """The origin's stub_status `accepts` counter (includes this query's own connection)."""
    _, _, body = http_get(port, "/__status")
    m = re.search(rb"\n\s*(\d+)\s+(\d+)\s+(\d+)", body)
    if not m:
        raise RuntimeError(f"unexpected stub_status body: {body!r}")
    return int(m.group(1))


def check(port, lua):
    ua = {"User-Agent": "pier-bench"}
    st, hd, body = http_get(port, "/hello", ua, scheme=SCHEME)
    if st != 200 or body != b"hello world\n":
        return f"GET /hello -> {st} {body[:80]!r}, want 200 'hello world'"
    st, _, body = http_get(port, "/4k.bin", ua, scheme=SCHEME)
    if st != 200 or len(body) != 4096:
        return f"GET /4k.bin -> {st}, {len(body)} bytes, want 200 and 4096 bytes"
    if lua:
        if hd.get("x-lua") != "1":
            return f"GET /hello: response header x-lua is {hd.get('x-lua')!r}, want '1'"
        st, _, _ = http_get(port, "/hello", {**ua, "X-Block": "1"})
        if st != 403:
            return f"GET /hello with X-Block -> {st}, want 403"
    return None


# ---------------------------------------------------------------- /proc


def _children_map():
    kids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
        except OSError:
            continue
        ppid = int(s[s.rindex(")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def tree(pid):
    """PID and all its descendants (nginx master + workers, etc.)."""
    kids = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def stat_split(pid):
    """(user_seconds, sys_seconds, rss_kib, pss_kib, nprocs) summed over the process tree.

    User CPU is utime of every live process plus cutime (children that already
    exited and were reaped); system CPU likewise stime plus cstime. So nothing a
    process tree burned is lost: nginx's and HAProxy's workers are all counted,
    Pier's threads are in its one process's utime/stime.
    """
    uticks = sticks = rss = pss = n = 0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                s = f.read()
            fields = s[s.rindex(")") + 2 :].split()
            # fields[0] is state (field 3); utime, stime, cutime, cstime are
            # fields 14-17 -> indexes 11-14.
            ut, st, cut, cst = (int(x) for x in fields[11:15])
            uticks += ut + cut
            sticks += st + cst
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1])
            try:
                with open(f"/proc/{p}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss:"):
                            pss += int(line.split()[1])
            except OSError:
                pass
            n += 1
        except (OSError, ValueError):
            continue
    return uticks / CLK_TCK, sticks / CLK_TCK, rss, pss, n


def faults_switches(pid):
    """(minor page faults, context switches) so far, summed over the process tree and
    every thread: page faults are kernel time a proxy causes by touching fresh memory,
    context switches the times it slept (or was preempted) between events."""
    flt = sw = 0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                s = f.read()
            flt += int(s[s.rindex(")") + 2 :].split()[7])  # minflt (field 10)
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/status") as f:
                    for line in f:
                        if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")):
                            sw += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return flt, sw


def stat(pid):
    """(cpu_seconds, rss_kib, pss_kib, nprocs): stat_split with user + sys CPU added up."""
    user, sys_, rss, pss, n = stat_split(pid)
    return user + sys_, rss, pss, n


def busy_seconds():
    """CPU seconds all cores spent busy since boot (from /proc/stat), for the noise check."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...
    return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / CLK_TCK


# ---------------------------------------------------------------- wrk


_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def _ms(v):
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", v)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


def parse_wrk(text):
    r = {"rps": None, "p50_ms": None, "p99_ms": None, "requests": None,
         "socket_errors": 0, "non_2xx": 0}
    m = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if m:
        r["rps"] = float(m.group(1))
    m = re.search(r"(\d+) requests in", text)
    if m:
        r["requests"] = int(m.group(1))
    for pct, key in (("50", "p50_ms"), ("99", "p99_ms")):
        m = re.search(rf"^\s+{pct}(?:\.000)?%\s+(\S+)", text, re.M)
        if m:
            r[key] = _ms(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    if m:
        r["socket_errors"] = sum(int(x) for x in m.groups())
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    if m:
        r["non_2xx"] = int(m.group(1))
    return r


def measure(a):
    wrk = ["wrk", f"-t{a.threads}", f"-c{a.conns}", f"-d{a.duration}s", "--latency",
           "--timeout", "10s", "-H", "User-Agent: pier-bench"]
    if a.close:
        # A new connection (a full TLS handshake) per request.
        wrk += ["-H", "Connection: close"]
    if getattr(a, "script", None):
        wrk += ["-s", a.script]
    wrk.append(f"{SCHEME}://127.0.0.1:{a.port}{a.path}")
    acc0 = origin_accepts(a.origin_port)
    user0, sys0, _, _, _ = stat_split(a.pid)
    flt0, sw0 = faults_switches(a.pid)
    ocpu0, _, _, _ = stat(a.origin_pid)
    busy0 = busy_seconds()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = open("/proc/loadavg").read().split()[0]
    t0 = time.monotonic()
    p = subprocess.run(wrk, capture_output=True, text=True, timeout=a.duration + 60)
    wall = time.monotonic() - t0
    user1, sys1, rss, pss, nproc = stat_split(a.pid)
    flt1, sw1 = faults_switches(a.pid)
    ocpu1, _, _, _ = stat(a.origin_pid)
    busy1 = busy_seconds()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    wrk_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    acc1 = origin_accepts(a.origin_port)
    r = parse_wrk(p.stdout)
    user, sys_ = user1 - user0, sys1 - sys0
    cpu = user + sys_
    reqs = r["requests"]
    r.update({
        "kind": "handshake" if a.close else "load", "proxy": a.proxy, "path": a.path,
        "conns": a.conns, "rep": a.rep, "scheme": SCHEME,
        "duration": a.duration, "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "user_s": round(user, 3),
        "sys_s": round(sys_, 3),
        "req_per_cpu_s": (reqs / cpu) if (reqs and cpu > 0) else None,
        # Per request, in microseconds (CPU time is counted in 1/CLK_TCK ticks).
        "user_us_per_req": (user * 1e6 / reqs) if reqs else None,
        "sys_us_per_req": (sys_ * 1e6 / reqs) if reqs else None,
        "minflt_per_req": ((flt1 - flt0) / reqs) if reqs else None,
        "ctxsw_per_req": ((sw1 - sw0) / reqs) if reqs else None,
        # -1: the second stub_status query's own connection.
        "upstream_conns": acc1 - acc0 - 1,
        "origin_cpu_s": round(ocpu1 - ocpu0, 3),
        "wrk_cpu_s": round(wrk_cpu, 3),
        # CPU that neither the proxy, the origin nor wrk used: other work on the machine
        # (and this helper); large values mean a noisy run.
        "other_cpu_s": round((busy1 - busy0) - cpu - (ocpu1 - ocpu0) - wrk_cpu, 3),
        "loadavg_before": float(load0),
        "rss_kib": rss, "pss_kib": pss, "nprocs": nproc,
        "wrk_rc": p.returncode,
    })
    if p.returncode != 0 or r["rps"] is None:
        r["error"] = (p.stderr or p.stdout)[-400:]
    with open(a.out, "a") as f:
        f.write(json.dumps(r) + "\n")
    upc = r["upstream_conns"]
    print(f"  {a.proxy:9} {a.path:8} c={a.conns:<4} rps={r['rps'] or 0:>9.0f} "
          f"p50={r['p50_ms'] or 0:.2f}ms p99={r['p99_ms'] or 0:.2f}ms cpu={cpu:.2f}s "
          f"req/cpu-s={r['req_per_cpu_s'] or 0:>7.0f} "
          f"user={r['user_us_per_req'] or 0:.1f}us/req sys={r['sys_us_per_req'] or 0:.1f}us/req "
          f"upstream-conns={upc} "
          f"rss={rss / 1024:.1f}MB errs={r['socket_errors']}+{r['non_2xx']} "
          f"other-cpu={r['other_cpu_s']:.1f}s", flush=True)
    return 0 if "error" not in r else 1


# ---------------------------------------------------------------- idle connections


async def _idle(port, n, path, parallel, hold_cb):
    req = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: pier-bench-idle\r\n\r\n").encode()
    sem = asyncio.Semaphore(parallel)
    conns = []
    failed = [0]

    async def one_request(reader, writer):
        writer.write(req)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        m = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
        if not m:
            raise RuntimeError("no content-length")
        await reader.readexactly(int(m.group(1)))
        return status

    # One context for all connections: building one per connection (create_default_context
    # loads the system CA store each time) made 10,000 TLS connections take minutes.
    ssl_ctx = _ssl_ctx() if SCHEME == "https" else None

    async def opener():
        async with sem:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port, ssl=ssl_ctx), 10)
                st = await asyncio.wait_for(one_request(reader, writer), 10)
                if st != 200:
                    raise RuntimeError(f"status {st}")
                conns.append((reader, writer))
            except Exception:  # noqa: BLE001 - counted, reported as failures
                failed[0] += 1

    await asyncio.gather(*(opener() for _ in range(n)))
    await asyncio.sleep(1.0)  # let the proxy settle (buffers freed, pools idle)
    held = hold_cb()
    # Prove the connections are still alive: a second request on a sample of them.
    sample = random.sample(conns, min(200, len(conns)))
    alive = 0

    async def reuse(rw):
        nonlocal alive
        try:
            if await asyncio.wait_for(one_request(*rw), 10) == 200:
                alive += 1
        except Exception:  # noqa: BLE001 - counted as not alive
            pass

    await asyncio.gather(*(reuse(rw) for rw in sample))
    for _, w in conns:
        w.close()
    return len(conns), failed[0], len(sample), alive, held


def idle(a):
    _, rss0, pss0, _ = stat(a.pid)

    def hold():
        return stat(a.pid)

    t0 = time.monotonic()
    opened, failed, sampled, alive, held = asyncio.run(
        asyncio.wait_for(_idle(a.port, a.n, a.path, a.parallel, hold), a.timeout))
    _, rss1, pss1, nproc = held
    r = {"kind": "idle", "proxy": a.proxy, "rep": a.rep, "scheme": SCHEME, "target": a.n,
         "opened": opened,
         "failed": failed, "reuse_sampled": sampled, "reuse_ok": alive,
         "rss0_kib": rss0, "rss_kib": rss1, "pss0_kib": pss0, "pss_kib": pss1,
         "nprocs": nproc, "secs": round(time.monotonic() - t0, 2)}
    with open(a.out, "a") as f:
        f.write(json.dumps(r) + "\n")
    per = (rss1 - rss0) / opened if opened else 0
    print(f"  {a.proxy:9} idle: {opened}/{a.n} open ({failed} failed), "
          f"{alive}/{sampled} reusable; RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MB "
          f"(~{per:.1f} KiB per connection)", flush=True)
    return 0


# ---------------------------------------------------------------- resumed TLS handshakes


def _resume_ctx(version):
    """A client context of its own (Python only resumes a session in the context that made it)."""
    import ssl
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if version == "1.2":
        ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    else:
        ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    return ctx


async def _tls_get(loop, port, ctx, session, req):
    """One connection: TCP connect, TLS handshake (offering `session` when given), one request
    with Connection: close, the response read until the proxy closes. Memory BIOs over a
    non-blocking socket, so the session can be passed in (asyncio's streams cannot).
    Returns (status, body length ok, session_reused, the connection's latest session)."""
    import ssl
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = ctx.wrap_bio(inc, out, server_hostname="localhost", session=session)

        async def flush():
            data = out.read()
            if data:
                await loop.sock_sendall(sock, data)

        async def fill():
            data = await loop.sock_recv(sock, 65536)
            if data:
                inc.write(data)
                return True
            inc.write_eof()
            return False

        while True:
            try:
                obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await flush()
                if not await fill():
                    raise ConnectionError("EOF during the TLS handshake")
        obj.write(req)
        await flush()
        buf = bytearray()
        while True:
            try:
                chunk = obj.read(65536)
            except ssl.SSLWantReadError:
                await flush()
                if not await fill():
                    break
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                break  # close_notify, or the TCP FIN after it
            if not chunk:
                break
            buf += chunk
        head, _, body = bytes(buf).partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
        m = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
        ok = bool(m) and len(body) == int(m.group(1))
        return status, ok, obj.session_reused, obj.session
    finally:
        sock.close()


async def _resume_run(port, conns, n, duration, version, full, path, before, after):
    loop = asyncio.get_running_loop()
    req = (f"GET {path} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: pier-bench-resume\r\n"
           "Connection: close\r\n\r\n").encode()
    ctxs = [_resume_ctx(version) for _ in range(conns)]
    sessions = [None] * conns
    c = {"started": 0, "done": 0, "resumed": 0, "full": 0, "errors": 0, "bad": 0,
         "warm_errors": 0}
    lat = []

    async def warm(i):
        # One full handshake per client, which leaves it with a session (ticket) to offer.
        try:
            st, ok, _, sess = await asyncio.wait_for(_tls_get(loop, port, ctxs[i], None, req), 10)
            if st == 200 and ok:
                sessions[i] = sess
                return
        except Exception:  # noqa: BLE001 - counted
            pass
        c["warm_errors"] += 1

    if not full:
        await asyncio.gather(*(warm(i) for i in range(conns)))
    deadline = time.monotonic() + duration

    async def worker(i):
        while c["started"] < n and time.monotonic() < deadline:
            c["started"] += 1
            t0 = time.monotonic()
            try:
                st, ok, reused, sess = await asyncio.wait_for(
                    _tls_get(loop, port, ctxs[i], None if full else sessions[i], req), 10)
            except Exception:  # noqa: BLE001 - counted as an error
                c["errors"] += 1
                continue
            lat.append(time.monotonic() - t0)
            c["done"] += 1
            c["resumed" if reused else "full"] += 1
            if st != 200 or not ok:
                c["bad"] += 1
            if not full and sess is not None:
                sessions[i] = sess  # the freshest ticket, as a browser would

    snap0 = before()
    t0 = time.monotonic()
    await asyncio.gather(*(worker(i) for i in range(conns)))
    wall = time.monotonic() - t0
    snap1 = after()
    return c, lat, wall, snap0, snap1


def resume(a):
    """Handshakes per proxy CPU-second with TLS session resumption (or, --full, without):
    CONNS concurrent clients, each opening one connection after another with one
    GET and Connection: close, offering the session (ticket) its previous connection got."""
    def snap():
        return {"proxy": stat_split(a.pid), "origin": stat(a.origin_pid)[0],
                "busy": busy_seconds(), "self": resource.getrusage(resource.RUSAGE_SELF),
                "accepts": origin_accepts(a.origin_port),
                "load": float(open("/proc/loadavg").read().split()[0])}

    c, lat, wall, s0, s1 = asyncio.run(_resume_run(
        a.port, a.conns, a.n, a.duration, a.tls, a.full, a.path, snap, snap))
    user = s1["proxy"][0] - s0["proxy"][0]
    sys_ = s1["proxy"][1] - s0["proxy"][1]
    cpu = user + sys_
    client = ((s1["self"].ru_utime + s1["self"].ru_stime)
              - (s0["self"].ru_utime + s0["self"].ru_stime))
    origin = s1["origin"] - s0["origin"]
    done = c["done"]
    lat.sort()

    def pct(q):
        return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 3) if lat else None

    kind = "full" if a.full else "resumed"
    r = {"kind": "resume", "mode": kind, "tls": a.tls, "proxy": a.proxy, "path": a.path,
         "conns": a.conns, "rep": a.rep, "scheme": "https", "duration": a.duration,
         "wall_s": round(wall, 3), "requests": done,
         "rps": done / wall if wall > 0 else None, "p50_ms": pct(0.50), "p99_ms": pct(0.99),
         "resumed": c["resumed"], "full": c["full"], "warm_errors": c["warm_errors"],
         "socket_errors": c["errors"], "non_2xx": c["bad"],
         "cpu_s": round(cpu, 3), "user_s": round(user, 3), "sys_s": round(sys_, 3),
         "req_per_cpu_s": (done / cpu) if (done and cpu > 0) else None,
         "user_us_per_req": (user * 1e6 / done) if done else None,
         "sys_us_per_req": (sys_ * 1e6 / done) if done else None,
         # -1: the second stub_status query's own connection.
         "upstream_conns": s1["accepts"] - s0["accepts"] - 1,
         "origin_cpu_s": round(origin, 3), "client_cpu_s": round(client, 3),
         "other_cpu_s": round((s1["busy"] - s0["busy"]) - cpu - origin - client, 3),
         "loadavg_before": s0["load"], "loadavg_after": s1["load"],
         "rss_kib": s1["proxy"][2], "pss_kib": s1["proxy"][3], "nprocs": s1["proxy"][4]}
    if a.full:
        ok = done > 0 and c["resumed"] == 0
    else:
        ok = done > 0 and c["full"] == 0 and c["warm_errors"] == 0
    if not ok or c["errors"] or c["bad"]:
        r["error"] = (f"{c['resumed']} resumed, {c['full']} full, {c['errors']} failed, "
                      f"{c['bad']} bad responses, {c['warm_errors']} warm-up failures")
    with open(a.out, "a") as f:
        f.write(json.dumps(r) + "\n")
    print(f"  {a.proxy:9} {kind:7} TLS {a.tls} c={a.conns:<3} {done} handshakes "
          f"({c['resumed']} resumed, {c['full']} full, {c['errors']} failed, {c['bad']} bad) "
          f"in {wall:.1f}s; proxy cpu={cpu:.2f}s hs/cpu-s={r['req_per_cpu_s'] or 0:.0f} "
          f"user={r['user_us_per_req'] or 0:.1f}us sys={r['sys_us_per_req'] or 0:.1f}us "
          f"client-cpu={client:.1f}s other-cpu={r['other_cpu_s']:.1f}s load={s0['load']}",
          flush=True)
    return 0 if "error" not in r else 1


# ---------------------------------------------------------------- pier config rewrite


def _toml_key(k):
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def _toml_val(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        # A JSON string is a valid TOML basic string (same escapes).
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_val(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_val(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _is_table_array(v):
    return isinstance(v, list) and v and all(isinstance(x, dict) for x in v)


def toml_dump(d, prefix=()):
    out = []
    scalars = [(k, v) for k, v in d.items() if not isinstance(v, dict) and not _is_table_array(v)]
    for k, v in scalars:
        out.append(f"{_toml_key(k)} = {_toml_val(v)}")
    for k, v in d.items():
        path = prefix + (k,)
        name = ".".join(_toml_key(x) for x in path)
        if isinstance(v, dict):
            out.append(f"\n[{name}]")
            out.append(toml_dump(v, path))
        elif _is_table_array(v):
            for item in v:
                out.append(f"\n[[{name}]]")
                out.append(toml_dump(item, path))
    return "\n".join(x for x in out if x != "")


def pier_config(a):
    import tomllib

    with open(a.src, "rb") as f:
        cfg = tomllib.load(f)
    cfg.setdefault("server", {})["workers"] = 2
    cfg.setdefault("log", {})["access"] = "off"
    cfg.setdefault("limits", {})["max_connections"] = 20000
    cfg.setdefault("timeouts", {})["client_idle"] = "65s"
    with open(a.dst, "w") as f:
        f.write(f"# Generated by bench/tool.py from {a.src}\n" + toml_dump(cfg) + "\n")
    return 0


# ---------------------------------------------------------------- main


def cg_totals(paths):
    """Totals of callgrind output files, summed: (Ir, L1d misses, LL data misses, L1i misses);
    the misses are 0 unless callgrind ran with --cache-sim=yes."""
    tot = {}
    for path in paths:
        ev = None
        for line in open(path, errors="replace"):
            if line.startswith("events:"):
                ev = line.split()[1:]
            elif line.startswith("totals:") and ev:
                for k, v in zip(ev, line.split()[1:]):
                    tot[k] = tot.get(k, 0) + int(v)
    d1 = tot.get("D1mr", 0) + tot.get("D1mw", 0)
    ll = tot.get("DLmr", 0) + tot.get("DLmw", 0)
    return tot.get("Ir", 0), d1, ll, tot.get("I1mr", 0)


def strace_calls(path):
    """{syscall: calls} from an `strace -c -U calls,name` summary file."""
    calls = {}
    for line in open(path, errors="replace"):
        f = line.split()
        if len(f) == 2 and f[0].isdigit() and f[1] != "total":
            calls[f[1]] = calls.get(f[1], 0) + int(f[0])
    return calls


def syscalls_per_request(a_path, b_path, n):
    """Lines "name per-request" of the calls run B made beyond run A (n more requests), the
    kinds at 0.005 or more a request, and their total."""
    a, b = strace_calls(a_path), strace_calls(b_path)
    per = {k: (b.get(k, 0) - a.get(k, 0)) / n for k in set(a) | set(b)}
    out = [f"  {k:<20} {v:8.3f}" for k, v in sorted(per.items()) if v >= 0.005]
    out.append(f"  {'total':<20} {sum(per.values()):8.3f}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    sp = ap.add_subparsers(dest="cmd", required=True)
    sp.add_parser("port")
    w = sp.add_parser("wait-port")
    w.add_argument("port", type=int)
    w.add_argument("secs", type=float)
    w.add_argument("--pid", type=int, help="give up early when this process exits")
    c = sp.add_parser("check")
    c.add_argument("port", type=int)
    c.add_argument("--lua", action="store_true")
    t = sp.add_parser("tree")
    t.add_argument("pid", type=int)
    s = sp.add_parser("stat")
    s.add_argument("pid", type=int)
    m = sp.add_parser("measure")
    for k in ("proxy", "path", "out"):
        m.add_argument(f"--{k}", required=True)
    for k in ("pid", "port", "origin-pid", "origin-port", "conns", "duration", "threads", "rep"):
        m.add_argument(f"--{k}", type=int, required=True)
    m.add_argument("--close", action="store_true", help="Connection: close on every request")
    m.add_argument("--script", help="a wrk Lua script (e.g. distinct URLs per request)")
    i = sp.add_parser("idle")
    for k in ("proxy", "out"):
        i.add_argument(f"--{k}", required=True)
    for k in ("pid", "port", "n", "rep"):
        i.add_argument(f"--{k}", type=int, required=True)
    i.add_argument("--path", default="/hello")
    i.add_argument("--parallel", type=int, default=200)
    i.add_argument("--timeout", type=float, default=180)
    rs = sp.add_parser("resume", help="TLS handshakes (resumed, or --full) per proxy CPU-second")
    for k in ("proxy", "out"):
        rs.add_argument(f"--{k}", required=True)
    for k in ("pid", "port", "origin-pid", "origin-port", "conns", "duration", "rep"):
        rs.add_argument(f"--{k}", type=int, required=True)
    rs.add_argument("--n", type=int, default=200000, help="at most this many handshakes")
    rs.add_argument("--tls", choices=("1.3", "1.2"), default="1.3")
    rs.add_argument("--full", action="store_true", help="never offer a session (control)")
    rs.add_argument("--path", default="/hello")
    g = sp.add_parser("cg-totals", help="Ir, L1d and LL data misses, L1i misses of callgrind files")
    g.add_argument("files", nargs="+")
    sc = sp.add_parser("syscalls", help="system calls per request from two strace -c summaries")
    sc.add_argument("a")
    sc.add_argument("b")
    sc.add_argument("n", type=int, help="requests run B served beyond run A")
    p = sp.add_parser("pier-config")
    p.add_argument("src")
    p.add_argument("dst")
    a = ap.parse_args()

    if a.cmd == "port":
        print(free_port())
    elif a.cmd == "wait-port":
        return 0 if wait_port(a.port, a.secs, a.pid) else 1
    elif a.cmd == "check":
        err = check(a.port, a.lua)
        if err:
            print(err)
            return 1
    elif a.cmd == "tree":
        print(" ".join(str(p) for p in tree(a.pid)))
    elif a.cmd == "stat":
        user, sys_, rss, pss, n = stat_split(a.pid)
        print(f"cpu_s={user + sys_:.2f} user_s={user:.2f} sys_s={sys_:.2f} "
              f"rss_kib={rss} pss_kib={pss} procs={n}")
    elif a.cmd == "measure":
        return measure(a)
    elif a.cmd == "idle":
        return idle(a)
    elif a.cmd == "resume":
        return resume(a)
    elif a.cmd == "cg-totals":
        print(*cg_totals(a.files))
    elif a.cmd == "syscalls":
        print(syscalls_per_request(a.a, a.b, a.n))
    elif a.cmd == "pier-config":
        return pier_config(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
