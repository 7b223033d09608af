// Package ctrl is the small control channel ecxfer's tools and tests use to
// swap agent metadata and commands between processes: length-prefixed
// msgpack messages over a pipe, a unix socket or TCP.
//
// Data never travels here; only the metadata a consumer needs to reach a
// producer and a few commands to drive a producer. Frames are bounded and
// decoded strictly, because the other end may be anything that connected
// to a listening port.
package ctrl

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/vmihailenco/msgpack/v5"
)

// MaxFrame bounds one message (16 MiB).
const MaxFrame = 16 << 20

// ErrFrame reports a malformed or oversized message.
var ErrFrame = errors.New("ctrl: bad frame")

// Message is one control message. Kind says what it is; the other fields
// are used as each kind needs.
type Message struct {
	Kind     string            `msgpack:"k"`
	Name     string            `msgpack:"n,omitempty"`
	Metadata []byte            `msgpack:"m,omitempty"`
	MemDesc  []byte            `msgpack:"d,omitempty"`
	Data     []byte            `msgpack:"b,omitempty"`
	Ints     map[string]int64  `msgpack:"i,omitempty"`
	Strs     map[string]string `msgpack:"s,omitempty"`
}

// Conn reads and writes messages.
type Conn struct {
	r *bufio.Reader
	w io.Writer
}

// New wraps a reader and a writer (they may be the same connection).
func New(r io.Reader, w io.Writer) *Conn {
	return &Conn{r: bufio.NewReader(r), w: w}
}

// Send writes one message.
func (c *Conn) Send(m Message) error {
	body, err := msgpack.Marshal(&m)
	if err != nil {
		return fmt.Errorf("ctrl: encode: %w", err)
	}
	if len(body) > MaxFrame {
		return fmt.Errorf("%w: %d bytes (limit %d)", ErrFrame, len(body), MaxFrame)
	}
	frame := make([]byte, 4+len(body))
	binary.BigEndian.PutUint32(frame, uint32(len(body)))
	copy(frame[4:], body)
	_, err = c.w.Write(frame)
	return err
}

// Recv reads one message. io.EOF means the other end closed cleanly
// between messages.
func (c *Conn) Recv() (Message, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(c.r, hdr[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return Message{}, fmt.Errorf("%w: truncated header", ErrFrame)
		}
		return Message{}, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > MaxFrame {
		return Message{}, fmt.Errorf("%w: %d bytes (limit %d)", ErrFrame, n, MaxFrame)
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(c.r, body); err != nil {
		return Message{}, fmt.Errorf("%w: truncated body: %v", ErrFrame, err)
	}
	return Decode(body)
}

// Decode parses one message body.
func Decode(body []byte) (Message, error) {
	if err := checkShape(body); err != nil {
		return Message{}, fmt.Errorf("%w: %v", ErrFrame, err)
	}
	var m Message
	if err := msgpack.Unmarshal(body, &m); err != nil {
		return Message{}, fmt.Errorf("%w: %v", ErrFrame, err)
	}
	if m.Kind == "" {
		return Message{}, fmt.Errorf("%w: no kind", ErrFrame)
	}
	return m, nil
}

// Expect reads one message and checks its kind.
func (c *Conn) Expect(kind string) (Message, error) {
	m, err := c.Recv()
	if err != nil {
		return m, err
	}
	if m.Kind == "error" {
		return m, fmt.Errorf("ctrl: peer reports: %s", m.Strs["error"])
	}
	if m.Kind != kind {
		return m, fmt.Errorf("%w: got %q, want %q", ErrFrame, m.Kind, kind)
	}
	return m, nil
}
