package metrics

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ecxfer/ecxfer"
)

// Handler returns an http.Handler serving the metrics of g in Prometheus'
// text format.
func Handler(g prometheus.Gatherer) http.Handler {
	return promhttp.HandlerFor(g, promhttp.HandlerOpts{})
}

// Exporter serves /metrics on a TCP address until closed.
type Exporter struct {
	ln  net.Listener
	srv *http.Server
	// Registry holds what the exporter serves: the collectors added with
	// Add, plus anything the caller registers on it.
	Registry *prometheus.Registry
	done     chan struct{}

	mu    sync.Mutex
	added map[*ecxfer.Transport]prometheus.Collector
}

// Listen starts serving /metrics on addr (host:port; port 0 picks one)
// from a new registry. It returns once the socket is listening.
func Listen(addr string) (*Exporter, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	mux := http.NewServeMux()
	mux.Handle("/metrics", Handler(reg))
	e := &Exporter{
		ln: ln,
		// A scraper that goes away, or stops reading its answer, does
		// not keep a connection (an fd and a goroutine) until Close.
		srv: &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second,
			WriteTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute},
		Registry: reg,
		done:     make(chan struct{}),
		added:    map[*ecxfer.Transport]prometheus.Collector{},
	}
	go func() {
		defer close(e.done)
		_ = e.srv.Serve(ln)
	}()
	return e, nil
}

// Addr is the address the exporter listens on.
func (e *Exporter) Addr() string { return e.ln.Addr().String() }

// Add registers a collector of t's metrics. Transports with the same
// AgentName cannot be added at once: their series would clash.
func (e *Exporter) Add(t *ecxfer.Transport, opts ...Option) error {
	if t == nil {
		return errNilTransport
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.added[t]; ok {
		return fmt.Errorf("metrics: transport %q added twice", t.AgentName())
	}
	c := NewCollector(t, opts...)
	if err := e.Registry.Register(c); err != nil {
		return err
	}
	e.added[t] = c
	return nil
}

// Remove unregisters t's collector; it reports whether t was added.
func (e *Exporter) Remove(t *ecxfer.Transport) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	c, ok := e.added[t]
	if ok {
		delete(e.added, t)
		e.Registry.Unregister(c)
	}
	return ok
}

// Close stops serving and waits for the server to exit. Scrapes in
// progress get up to a second to finish; then every connection is closed,
// including ones a client opened and sent nothing on (Shutdown alone
// would wait for those). Cutting them short is not an error.
func (e *Exporter) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	err := e.srv.Shutdown(ctx)
	if errors.Is(err, context.DeadlineExceeded) {
		err = e.srv.Close()
	}
	<-e.done
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	return err
}
