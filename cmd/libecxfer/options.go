package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"reflect"
	"strings"
	"time"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/reactor"
)

// options is the JSON object ecx_new takes: the transport's Config in
// snake_case, durations as numbers of the unit in the name. Unknown keys
// are an error, so a misspelt option never goes unnoticed.
type options struct {
	AgentName string `json:"agent_name"`
	Backend   string `json:"backend"`
	BlockSize int    `json:"block_size"`
	NumBlocks int    `json:"num_blocks"`
	// XferTimeoutS: seconds; 0 or absent means the default (20 s),
	// negative disables the timeout.
	XferTimeoutS float64 `json:"xfer_timeout_s"`
	// PinCPU pins the reactor thread to that CPU; NUMANode picks a CPU of
	// that node and binds the region's pages there.
	PinCPU   *int `json:"pin_cpu"`
	NUMANode *int `json:"numa_node"`
	// Idle is "hybrid" (default), "spin", "yield" or "park".
	Idle          string  `json:"idle"`
	SpinForUS     float64 `json:"spin_for_us"`
	YieldForUS    float64 `json:"yield_for_us"`
	ParkTimeoutUS float64 `json:"park_timeout_us"`
	WaitSpinUS    float64 `json:"wait_spin_us"`
	BatchSize     int     `json:"batch_size"`
	SubmitRing    int     `json:"submit_ring"`
	Handles       int     `json:"handles"`
	WaitWhenBusy  bool    `json:"wait_when_busy"`
	MaxNotif      int     `json:"max_notif"`
	// ReactorOnly: callers never step in for the reactor thread
	// (reactor.Options.ReactorOnly).
	ReactorOnly bool `json:"reactor_only"`
	// Direct is "auto" (default), "on" or "off": whether READs of peers
	// on this host bypass the engine (Config.Direct). InlineBytes and
	// CopyWorkers tune that path (0: the defaults; inline_bytes negative:
	// never copy inside post_read).
	Direct      string `json:"direct"`
	InlineBytes int    `json:"inline_bytes"`
	CopyWorkers int    `json:"copy_workers"`
	// NoGather: READs of peers on other hosts go as UCX gets
	// (Config.NoGather).
	NoGather bool `json:"no_gather"`
	// LargeTCPSegments: UCX tcp segments of 256 KiB, for a fleet whose
	// every agent sets it (Config.LargeTCPSegments).
	LargeTCPSegments bool `json:"large_tcp_segments"`
}

// directModes maps the option's values to Config.Direct.
var directModes = map[string]ecxfer.DirectMode{
	"":     ecxfer.DirectAuto,
	"auto": ecxfer.DirectAuto,
	"on":   ecxfer.DirectOn,
	"off":  ecxfer.DirectOff,
}

// optionNames are the options' JSON names, exactly as spelt.
var optionNames = func() map[string]bool {
	m := map[string]bool{}
	t := reflect.TypeFor[options]()
	for i := range t.NumField() {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		m[name] = true
	}
	return m
}()

// checkKeys requires data to be one JSON object, nothing after it, whose
// keys are option names exactly as spelt, each at most once:
// encoding/json matches keys regardless of case and lets a repeated key
// win, so {"backend": "ucx", "BACKEND": "loopback"} would quietly be
// loopback.
func checkKeys(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	if tok, err := dec.Token(); err != nil {
		return err
	} else if tok != json.Delim('{') {
		return fmt.Errorf("not a JSON object")
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		key, _ := tok.(string)
		switch {
		case !optionNames[key]:
			return fmt.Errorf("unknown option %q", key)
		case seen[key]:
			return fmt.Errorf("option %q given twice", key)
		}
		seen[key] = true
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return err
		}
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return err
	}
	if _, err := dec.Token(); err != io.EOF {
		return fmt.Errorf("trailing data after the JSON object")
	}
	return nil
}

// parseOptions decodes ecx_new's JSON into a Config (without its region).
func parseOptions(data []byte) (ecxfer.Config, error) {
	if err := checkKeys(data); err != nil {
		return ecxfer.Config{}, fmt.Errorf("%w: options: %v", ecxfer.ErrConfig, err)
	}
	var o options
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&o); err != nil {
		return ecxfer.Config{}, fmt.Errorf("%w: options: %v", ecxfer.ErrConfig, err)
	}
	cfg := ecxfer.Config{
		AgentName: o.AgentName,
		Backend:   o.Backend,
		BlockSize: o.BlockSize,
		NumBlocks: o.NumBlocks,
	}
	var err error
	if cfg.XferTimeout, err = duration("xfer_timeout_s", o.XferTimeoutS, time.Second, true); err != nil {
		return ecxfer.Config{}, err
	}
	r := &cfg.Reactor
	if o.PinCPU != nil {
		r.PinCPU, r.CPU = true, *o.PinCPU
	}
	if o.NUMANode != nil {
		r.BindNUMA, r.NUMANode = true, *o.NUMANode
	}
	if o.Idle != "" {
		if r.Idle, err = reactor.ParseIdle(o.Idle); err != nil {
			return ecxfer.Config{}, fmt.Errorf("%w: %v", ecxfer.ErrConfig, err)
		}
	}
	for _, d := range []struct {
		name string
		v    float64
		dst  *time.Duration
	}{
		{"spin_for_us", o.SpinForUS, &r.SpinFor},
		{"yield_for_us", o.YieldForUS, &r.YieldFor},
		{"park_timeout_us", o.ParkTimeoutUS, &r.ParkTimeout},
		{"wait_spin_us", o.WaitSpinUS, &r.WaitSpin},
	} {
		if *d.dst, err = duration(d.name, d.v, time.Microsecond, false); err != nil {
			return ecxfer.Config{}, err
		}
	}
	for _, n := range []struct {
		name string
		v    int
	}{{"batch_size", o.BatchSize}, {"submit_ring", o.SubmitRing}, {"handles", o.Handles}, {"max_notif", o.MaxNotif},
		{"copy_workers", o.CopyWorkers}} {
		if n.v < 0 {
			return ecxfer.Config{}, fmt.Errorf("%w: %s %d must not be negative", ecxfer.ErrConfig, n.name, n.v)
		}
	}
	r.BatchSize, r.SubmitRing, r.Handles, r.MaxNotif = o.BatchSize, o.SubmitRing, o.Handles, o.MaxNotif
	r.WaitWhenBusy, r.ReactorOnly = o.WaitWhenBusy, o.ReactorOnly
	d, ok := directModes[o.Direct]
	if !ok {
		return ecxfer.Config{}, fmt.Errorf("%w: direct %q (want auto, on or off)", ecxfer.ErrConfig, o.Direct)
	}
	cfg.Direct, cfg.InlineBytes, cfg.CopyWorkers = d, o.InlineBytes, o.CopyWorkers
	cfg.NoGather, cfg.LargeTCPSegments = o.NoGather, o.LargeTCPSegments
	return cfg, nil
}

// duration converts v units to a Duration, refusing NaN, values that
// overflow, and negative values unless negOK.
func duration(name string, v float64, unit time.Duration, negOK bool) (time.Duration, error) {
	switch {
	case math.IsNaN(v) || math.IsInf(v, 0):
		return 0, fmt.Errorf("%w: %s %v out of range", ecxfer.ErrConfig, name, v)
	case v < 0 && !negOK:
		return 0, fmt.Errorf("%w: %s %v must not be negative", ecxfer.ErrConfig, name, v)
	case v < 0:
		return -1, nil // any negative value: however large
	case v >= float64(math.MaxInt64)/float64(unit):
		// >=: MaxInt64/unit rounds up to a float whose product with unit
		// is 2^63, which converts to MinInt64.
		return 0, fmt.Errorf("%w: %s %v out of range", ecxfer.ErrConfig, name, v)
	}
	d := time.Duration(v * float64(unit))
	if d == 0 && v > 0 {
		d = 1 // a positive value never means "the default"
	}
	return d, nil
}
