// h3load: a small HTTP/3 (and HTTP/2-over-TLS) load generator for bench/h3.sh.
//
// Debian's h2load has no HTTP/3, so this client drives quic-go's http3 package, and, with
// -proto h2, golang.org/x/net/http2 over crypto/tls: the same client for both protocols,
// so "HTTP/3 against HTTP/2 over TLS" compares servers, not load generators.
//
//	h3load -url https://127.0.0.1:8443/hello -c 5 -m 500 -d 10s            # HTTP/3, keep-alive
//	h3load -proto h2 -url https://127.0.0.1:8443/hello -c 5 -m 500 -d 10s  # HTTP/2 over TLS
//	h3load -url https://127.0.0.1:8443/hello -newconn -m 50 -d 10s         # a new connection per request
//
// Keep-alive mode: -c connections are opened (and each checked with one request) before the
// clock starts; -m workers in total, spread round-robin over them, each sends one request
// after another on its connection until -d has passed. A connection carries at most what the
// server allows (its stream limit); workers beyond it wait for a stream, as a browser would.
//
// -newconn: -m workers, each opening one connection after another: a full handshake (no
// session resumption, no 0-RTT), one GET, the body read, the connection closed.
//
// Prints one JSON object: requests completed (2xx with the whole body read), errors (by
// kind, with a few samples), bytes, wall time, requests per second, latency percentiles
// (ms) and, for -newconn, handshake percentiles. Every request has a timeout (-timeout) and
// the whole run ends by -d + -timeout + 5 s at the latest, whatever the server does.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
	"golang.org/x/net/http2"
)

type result struct {
	Proto       string           `json:"proto"`
	URL         string           `json:"url"`
	Mode        string           `json:"mode"`
	Conns       int              `json:"conns"`
	Streams     int              `json:"streams"`
	DurationS   float64          `json:"duration_s"`
	WallS       float64          `json:"wall_s"`
	Requests    int64            `json:"requests"`
	Errors      int64            `json:"errors"`
	ErrorKinds  map[string]int64 `json:"error_kinds,omitempty"`
	ErrorSample []string         `json:"error_samples,omitempty"`
	Bytes       int64            `json:"bytes"`
	RPS         float64          `json:"rps"`
	P50ms       float64          `json:"p50_ms"`
	P90ms       float64          `json:"p90_ms"`
	P99ms       float64          `json:"p99_ms"`
	MaxMs       float64          `json:"max_ms"`
	HsP50ms     float64          `json:"handshake_p50_ms,omitempty"`
	HsP99ms     float64          `json:"handshake_p99_ms,omitempty"`
	SetupErrors int              `json:"setup_errors"`
}

// A per-request round trip on one connection.
type doer interface {
	RoundTrip(*http.Request) (*http.Response, error)
}

type stats struct {
	mu       sync.Mutex
	lat      []time.Duration
	hs       []time.Duration
	requests atomic.Int64
	errors   atomic.Int64
	bytes    atomic.Int64
	kinds    map[string]int64
	samples  []string
}

func (s *stats) fail(kind string, err error) {
	if strings.HasSuffix(kind, "cut-by-end-of-run") {
		return // a request in flight when the run ended: not the server's error
	}
	s.errors.Add(1)
	s.mu.Lock()
	s.kinds[kind]++
	if len(s.samples) < 5 {
		s.samples = append(s.samples, kind+": "+err.Error())
	}
	s.mu.Unlock()
}

func main() {
	var (
		rawURL   = flag.String("url", "", "https://HOST:PORT/PATH (required)")
		proto    = flag.String("proto", "h3", "h3 (HTTP/3 over QUIC) or h2 (HTTP/2 over TLS over TCP)")
		conns    = flag.Int("c", 5, "connections (keep-alive mode)")
		streams  = flag.Int("m", 50, "concurrent requests in total, spread over the connections (-newconn: concurrent clients)")
		dur      = flag.Duration("d", 10*time.Second, "measured duration")
		newconn  = flag.Bool("newconn", false, "a new connection (full handshake) per request")
		timeout  = flag.Duration("timeout", 10*time.Second, "per request (and per handshake)")
		caFile   = flag.String("cacert", "", "trust this CA (PEM); default: no certificate verification")
		sni      = flag.String("sni", "localhost", "TLS server name")
		ua       = flag.String("ua", "pier-bench-h3load", "User-Agent")
		warmup   = flag.Duration("warmup", 0, "send load for this long before the measured duration (keep-alive mode)")
		maxBody  = flag.Int64("max-body", 16<<20, "read at most this many body bytes")
		expectSz = flag.Int64("expect-size", -1, "count a response whose body is not this many bytes as an error (-1: any)")
	)
	flag.Parse()
	if *rawURL == "" || *streams < 1 || *conns < 1 || (*proto != "h3" && *proto != "h2") {
		flag.Usage()
		os.Exit(2)
	}
	u, err := url.Parse(*rawURL)
	if err != nil || u.Scheme != "https" {
		fmt.Fprintln(os.Stderr, "h3load: -url must be https://HOST:PORT/PATH")
		os.Exit(2)
	}
	addr := u.Host
	if _, _, err := net.SplitHostPort(addr); err != nil {
		addr = net.JoinHostPort(addr, "443")
	}

	tlsConf := &tls.Config{ServerName: *sni, InsecureSkipVerify: true}
	if *caFile != "" {
		pem, err := os.ReadFile(*caFile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "h3load:", err)
			os.Exit(2)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			fmt.Fprintln(os.Stderr, "h3load: no certificate in", *caFile)
			os.Exit(2)
		}
		tlsConf.RootCAs, tlsConf.InsecureSkipVerify = pool, false
	}
	if *proto == "h3" {
		tlsConf.NextProtos = []string{http3.NextProtoH3}
	} else {
		tlsConf.NextProtos = []string{"h2"}
	}
	quicConf := &quic.Config{
		HandshakeIdleTimeout: *timeout,
		MaxIdleTimeout:       30 * time.Second,
		KeepAlivePeriod:      0,
	}
	h3tr := &http3.Transport{TLSClientConfig: tlsConf, QUICConfig: quicConf}
	h2tr := &http2.Transport{TLSClientConfig: tlsConf, StrictMaxConcurrentStreams: true}

	// dial opens one connection and returns its round-tripper and closer.
	dial := func(ctx context.Context) (doer, func(), error) {
		if *proto == "h3" {
			qc, err := quic.DialAddr(ctx, addr, tlsConf, quicConf)
			if err != nil {
				return nil, nil, err
			}
			cc := h3tr.NewClientConn(qc)
			return cc, func() { qc.CloseWithError(0, "") }, nil
		}
		d := &tls.Dialer{NetDialer: &net.Dialer{}, Config: tlsConf}
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, nil, err
		}
		if p := c.(*tls.Conn).ConnectionState().NegotiatedProtocol; p != "h2" {
			c.Close()
			return nil, nil, fmt.Errorf("ALPN picked %q, not h2", p)
		}
		cc, err := h2tr.NewClientConn(c)
		if err != nil {
			c.Close()
			return nil, nil, err
		}
		return cc, func() { cc.Close() }, nil
	}

	st := &stats{kinds: map[string]int64{}}
	one := func(ctx context.Context, rt doer, record bool) error {
		rctx, cancel := context.WithTimeout(ctx, *timeout)
		defer cancel()
		req, _ := http.NewRequestWithContext(rctx, http.MethodGet, *rawURL, nil)
		req.Header.Set("User-Agent", *ua)
		t0 := time.Now()
		resp, err := rt.RoundTrip(req)
		if err != nil {
			if record {
				st.fail(kindOf(ctx, err), err)
			}
			return err
		}
		n, err := io.Copy(io.Discard, io.LimitReader(resp.Body, *maxBody))
		resp.Body.Close()
		if err != nil {
			if record {
				k := kindOf(ctx, err)
				if k == "other" {
					k = "body"
				} else if !strings.HasSuffix(k, "cut-by-end-of-run") {
					k = "body:" + k
				}
				st.fail(k, err)
			}
			return err
		}
		if resp.StatusCode < 200 || resp.StatusCode > 299 {
			err = fmt.Errorf("status %d", resp.StatusCode)
			if record {
				st.fail("status", err)
			}
			return err
		}
		if *expectSz >= 0 && n != *expectSz {
			err = fmt.Errorf("body of %d bytes, want %d", n, *expectSz)
			if record {
				st.fail("size", err)
			}
			return err
		}
		if record {
			d := time.Since(t0)
			st.requests.Add(1)
			st.bytes.Add(n)
			st.mu.Lock()
			st.lat = append(st.lat, d)
			st.mu.Unlock()
		}
		return nil
	}

	// Hard stop: whatever happens, the process ends.
	hard := *warmup + *dur + *timeout + 5*time.Second
	time.AfterFunc(hard+10*time.Second, func() {
		fmt.Fprintln(os.Stderr, "h3load: hard deadline passed, exiting")
		os.Exit(3)
	})

	res := result{Proto: *proto, URL: *rawURL, Conns: *conns, Streams: *streams, DurationS: dur.Seconds()}
	var wall time.Duration
	if !*newconn {
		res.Mode = "keepalive"
		rts := make([]doer, *conns)
		closers := make([]func(), 0, *conns)
		for i := range rts {
			ctx, cancel := context.WithTimeout(context.Background(), *timeout)
			rt, closer, err := dial(ctx)
			if err == nil {
				err = one(ctx, rt, false) // the connection works before the clock starts
			}
			cancel()
			if err != nil {
				fmt.Fprintf(os.Stderr, "h3load: connection %d: %v\n", i, err)
				res.SetupErrors++
				if closer != nil {
					closer()
				}
				continue
			}
			rts[i] = rt
			closers = append(closers, closer)
		}
		live := rts[:0]
		for _, rt := range rts {
			if rt != nil {
				live = append(live, rt)
			}
		}
		if len(live) == 0 {
			fmt.Fprintln(os.Stderr, "h3load: no connection could be set up")
			emit(res)
			os.Exit(1)
		}
		if *warmup > 0 {
			runWorkers(*streams, *warmup, func(ctx context.Context, w int) {
				one(ctx, live[w%len(live)], false)
			})
		}
		t0 := time.Now()
		runWorkers(*streams, *dur, func(ctx context.Context, w int) {
			one(ctx, live[w%len(live)], true)
		})
		wall = time.Since(t0)
		for _, c := range closers {
			c()
		}
	} else {
		res.Mode = "newconn"
		res.Conns = 0
		t0 := time.Now()
		runWorkers(*streams, *dur, func(ctx context.Context, w int) {
			h0 := time.Now()
			hctx, cancel := context.WithTimeout(ctx, *timeout)
			rt, closer, err := dial(hctx)
			cancel()
			if err != nil {
				st.fail("handshake:"+kindOf(ctx, err), err)
				return
			}
			hs := time.Since(h0)
			if one(ctx, rt, true) == nil {
				st.mu.Lock()
				st.hs = append(st.hs, hs)
				st.mu.Unlock()
			}
			closer()
		})
		wall = time.Since(t0)
	}

	res.WallS = wall.Seconds()
	res.Requests = st.requests.Load()
	res.Errors = st.errors.Load()
	res.Bytes = st.bytes.Load()
	if wall > 0 {
		res.RPS = float64(res.Requests) / wall.Seconds()
	}
	res.P50ms, res.P90ms, res.P99ms, res.MaxMs = pct(st.lat, 0.50), pct(st.lat, 0.90), pct(st.lat, 0.99), pct(st.lat, 1)
	if *newconn {
		res.HsP50ms, res.HsP99ms = pct(st.hs, 0.50), pct(st.hs, 0.99)
	}
	if len(st.kinds) > 0 {
		res.ErrorKinds, res.ErrorSample = st.kinds, st.samples
	}
	emit(res)
}

// runWorkers runs n workers calling f in a loop until d has passed; a request in flight at
// the deadline is cancelled (its context ends), so the run ends within d plus a little.
func runWorkers(n int, d time.Duration, f func(ctx context.Context, w int)) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	end, _ := ctx.Deadline()
	var wg sync.WaitGroup
	for w := 0; w < n; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			// The clock, not only ctx.Err(): the context's timer can fire late on a busy
			// machine, and a dial whose deadline has passed fails at once, without a packet:
			// workers would spin, counting thousands of "timeouts" the server never saw.
			for ctx.Err() == nil && time.Now().Before(end) {
				f(ctx, w)
			}
		}(w)
	}
	wg.Wait()
}

// kindOf names an error for the error_kinds map; a request cut by the end of the run is
// "cut-by-end-of-run", which stats.fail does not count.
func kindOf(ctx context.Context, err error) string {
	var appErr *quic.ApplicationError
	var trErr *quic.TransportError
	var idle *quic.IdleTimeoutError
	var hsTo *quic.HandshakeTimeoutError
	var strErr *quic.StreamError
	var h3Err *http3.Error
	dl, hasDl := ctx.Deadline()
	switch {
	case ctx.Err() != nil, hasDl && !time.Now().Before(dl):
		return "cut-by-end-of-run"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.As(err, &hsTo):
		return "quic-handshake-timeout"
	case errors.As(err, &idle):
		return "quic-idle-timeout"
	case errors.As(err, &appErr):
		return fmt.Sprintf("quic-app-error-0x%x", uint64(appErr.ErrorCode))
	case errors.As(err, &trErr):
		return "quic-transport-error-" + strings.ReplaceAll(trErr.ErrorCode.String(), " ", "_")
	case errors.As(err, &strErr):
		return fmt.Sprintf("stream-reset-0x%x", uint64(strErr.ErrorCode))
	case errors.As(err, &h3Err):
		return fmt.Sprintf("h3-error-0x%x", uint64(h3Err.ErrorCode))
	}
	return "other"
}

func pct(d []time.Duration, q float64) float64 {
	if len(d) == 0 {
		return 0
	}
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	i := int(q * float64(len(d)))
	if i >= len(d) {
		i = len(d) - 1
	}
	return float64(d[i].Microseconds()) / 1000
}

func emit(r result) {
	b, _ := json.Marshal(r)
	fmt.Println(string(b))
}
