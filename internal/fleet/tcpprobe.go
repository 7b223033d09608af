package fleet

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"time"
)

// TCPResult is a link's own TCP figures.
type TCPResult struct {
	Bytes          int64
	Duration       time.Duration
	Pings          int
	RTTP50, RTTP99 time.Duration
}

// GBps is the one-stream throughput.
func (r *TCPResult) GBps() float64 { return float64(r.Bytes) / r.Duration.Seconds() / 1e9 }

// TCPServe answers probes on addr until ctx ends: each connection starts
// with one byte, 's' (sink: read and discard until EOF, then reply with the
// byte count) or 'p' (echo single bytes).
func TCPServe(ctx context.Context, addr string, log io.Writer) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	fmt.Fprintf(log, "tcp-serve: listening on %s\n", l.Addr())
	go func() { <-ctx.Done(); _ = l.Close() }()
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		go serveProbe(c)
	}
}

func serveProbe(c net.Conn) {
	defer c.Close()
	var kind [1]byte
	if _, err := io.ReadFull(c, kind[:]); err != nil {
		return
	}
	switch kind[0] {
	case 's':
		// Drained 1 MiB at a time, as the sender writes: io.Copy into
		// io.Discard reads 8 KiB at a time, and a read(2) per 8 KiB made
		// the link look slower than it is (1.4-1.6x on loopback), and
		// ecxfer's figures as a share of it larger.
		buf := make([]byte, 1<<20)
		var n int64
		for {
			k, err := c.Read(buf)
			n += int64(k)
			if err != nil {
				break
			}
		}
		_, _ = c.Write(binary.LittleEndian.AppendUint64(nil, uint64(n)))
	case 'p':
		var b [1]byte
		for {
			if _, err := io.ReadFull(c, b[:]); err != nil {
				return
			}
			if _, err := c.Write(b[:]); err != nil {
				return
			}
		}
	}
}

// probeSlack is how long past its own length a probe waits for a far end
// that stops answering (one that accepted and then went silent held the
// probe for as long as it kept the connection).
var probeSlack = 10 * time.Second // a variable for tests

// TCPProbe streams to a TCPServe for d on one connection and then
// ping-pongs single bytes for up to a second on another. It gives up
// probeSlack after it should have finished, and when ctx ends.
func TCPProbe(ctx context.Context, addr string, d time.Duration) (*TCPResult, error) {
	r, err := tcpProbe(ctx, addr, d)
	if err != nil && ctx.Err() != nil {
		return nil, fmt.Errorf("tcp probe: interrupted: %w", ctx.Err())
	}
	return r, err
}

func tcpProbe(ctx context.Context, addr string, d time.Duration) (*TCPResult, error) {
	r := &TCPResult{}
	var dialer net.Dialer
	dctx, cancel := context.WithTimeout(ctx, probeSlack)
	defer cancel()
	c, err := dialer.DialContext(dctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(d + probeSlack))
	defer context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })()
	buf := make([]byte, 1<<20)
	if _, err := c.Write([]byte{'s'}); err != nil {
		c.Close()
		return nil, err
	}
	start := time.Now()
	for time.Since(start) < d && ctx.Err() == nil {
		n, err := c.Write(buf)
		r.Bytes += int64(n)
		if err != nil {
			c.Close()
			return nil, err
		}
	}
	_ = c.(*net.TCPConn).CloseWrite()
	var ack [8]byte
	_, err = io.ReadFull(c, ack[:])
	r.Duration = time.Since(start) // until the far end has everything
	c.Close()
	if err != nil {
		return nil, fmt.Errorf("tcp probe: %w", err)
	}
	if got := int64(binary.LittleEndian.Uint64(ack[:])); got != r.Bytes {
		return nil, fmt.Errorf("tcp probe: sent %d bytes, the far end got %d", r.Bytes, got)
	}

	// A dial context of its own: the first one's time ran on through the
	// stream, which made any --duration of probeSlack or more fail here.
	pctx, pcancel := context.WithTimeout(ctx, probeSlack)
	defer pcancel()
	p, err := dialer.DialContext(pctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	defer p.Close()
	_ = p.SetDeadline(time.Now().Add(time.Second + probeSlack))
	defer context.AfterFunc(ctx, func() { _ = p.SetDeadline(time.Now()) })()
	_ = p.(*net.TCPConn).SetNoDelay(true)
	if _, err := p.Write([]byte{'p'}); err != nil {
		return nil, err
	}
	var rtts []time.Duration
	b := []byte{1}
	for t0 := time.Now(); time.Since(t0) < time.Second && len(rtts) < 20000; {
		s := time.Now()
		if _, err := p.Write(b); err != nil {
			return nil, err
		}
		if _, err := io.ReadFull(p, b); err != nil {
			return nil, err
		}
		rtts = append(rtts, time.Since(s))
	}
	sortDurations(rtts)
	r.Pings = len(rtts)
	r.RTTP50, r.RTTP99 = quantile(rtts, 0.5), quantile(rtts, 0.99)
	return r, nil
}
