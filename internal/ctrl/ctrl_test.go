package ctrl

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
)

func TestRoundTrip(t *testing.T) {
	var buf bytes.Buffer
	c := New(&buf, &buf)
	in := Message{Kind: "hello", Name: "p", Metadata: []byte{1, 2}, MemDesc: []byte{0x90},
		Ints: map[string]int64{"blocks": 880}, Strs: map[string]string{"x": "y"}}
	require.NoError(t, c.Send(in))
	require.NoError(t, c.Send(Message{Kind: "bye"}))
	out, err := c.Recv()
	require.NoError(t, err)
	require.Equal(t, in, out)
	_, err = c.Expect("bye")
	require.NoError(t, err)
	_, err = c.Recv()
	require.ErrorIs(t, err, io.EOF)
}

func TestHostileFrames(t *testing.T) {
	huge := make([]byte, 4)
	binary.BigEndian.PutUint32(huge, MaxFrame+1)
	short := []byte{0, 0, 0, 10, 0x81}
	cases := map[string][]byte{
		"oversized": huge,
		"truncated": short,
		"half hdr":  {0, 0},
		"not map":   append([]byte{0, 0, 0, 1}, 0xc0),
		"no kind":   append([]byte{0, 0, 0, 1}, 0x80),
		"garbage":   append([]byte{0, 0, 0, 3}, 0xc1, 0xc1, 0xc1),
	}
	for name, b := range cases {
		c := New(bytes.NewReader(b), io.Discard)
		_, err := c.Recv()
		require.ErrorIs(t, err, ErrFrame, name)
	}
}

func TestExpectMismatch(t *testing.T) {
	var buf bytes.Buffer
	c := New(&buf, &buf)
	require.NoError(t, c.Send(Message{Kind: "a"}))
	_, err := c.Expect("b")
	require.ErrorIs(t, err, ErrFrame)
	require.NoError(t, c.Send(Message{Kind: "error", Strs: map[string]string{"error": "boom"}}))
	_, err = c.Expect("b")
	require.Error(t, err)
	require.Contains(t, err.Error(), "boom")
	require.False(t, errors.Is(err, ErrFrame))
}

func FuzzDecode(f *testing.F) {
	var buf bytes.Buffer
	c := New(&buf, &buf)
	_ = c.Send(Message{Kind: "hello", Name: "n", Metadata: []byte{1}, Ints: map[string]int64{"a": 1}})
	f.Add(buf.Bytes()[4:])
	f.Add([]byte{0x80})
	f.Add([]byte{0x81, 0xa1, 'k', 0xa1, 'x'})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := Decode(b)
		if err != nil {
			require.ErrorIs(t, err, ErrFrame)
			return
		}
		require.NotEmpty(t, m.Kind)
		var out bytes.Buffer
		require.NoError(t, New(&out, &out).Send(m))
		again, err := New(&out, &out).Recv()
		require.NoError(t, err)
		require.Equal(t, m.Kind, again.Kind)
	})
}

// FuzzRecv: a stream of frames (from a peer process) is read message by
// message as the framing states: a 4-byte big-endian length, at most
// MaxFrame, then a body Decode takes; a clean end between frames is
// io.EOF, anything else ErrFrame, and reading stops at the first error.
func FuzzRecv(f *testing.F) {
	var buf bytes.Buffer
	c := New(&buf, &buf)
	_ = c.Send(Message{Kind: "hello", Name: "n"})
	_ = c.Send(Message{Kind: "go", Ints: map[string]int64{"a": 1}})
	f.Add(bytes.Clone(buf.Bytes()))
	f.Add([]byte{0, 0, 0})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0, 0, 0, 1, 0x80})
	f.Fuzz(func(t *testing.T, stream []byte) {
		c := New(bytes.NewReader(stream), io.Discard)
		rest := stream
		for {
			m, err := c.Recv()
			// What the framing says of the stream's next bytes.
			switch {
			case len(rest) == 0:
				require.ErrorIs(t, err, io.EOF)
				return
			case len(rest) < 4:
				require.ErrorIs(t, err, ErrFrame, "truncated header")
				return
			}
			n := binary.BigEndian.Uint32(rest)
			if n > MaxFrame || uint64(len(rest)-4) < uint64(n) {
				require.ErrorIs(t, err, ErrFrame, "frame of %d bytes, %d left", n, len(rest)-4)
				return
			}
			want, werr := Decode(rest[4 : 4+n])
			if werr != nil {
				require.ErrorIs(t, err, ErrFrame)
				return
			}
			require.NoError(t, err)
			require.Equal(t, want, m)
			rest = rest[4+n:]
		}
	})
}

func TestStartPiped(t *testing.T) {
	leakcheck.Check(t)
	cmd := exec.Command("cat")
	stdin, stdout, err := StartPiped(cmd)
	require.NoError(t, err)
	require.Equal(t, os.Stderr, cmd.Stderr)
	c := New(stdout, stdin)
	require.NoError(t, c.Send(Message{Kind: "echo", Name: "x"}))
	m, err := c.Expect("echo")
	require.NoError(t, err)
	require.Equal(t, "x", m.Name)
	require.NoError(t, stdin.Close())
	require.NoError(t, cmd.Wait())
	require.NoError(t, stdout.Close())
}

// What a command writes just before it exits can be read after Wait: a
// goroutine that waits for the exit must not take the last message with
// it (exec's StdoutPipe is closed by Wait, and reads then fail).
func TestStartPipedKeepsOutputPastWait(t *testing.T) {
	leakcheck.Check(t)
	cmd := exec.Command("sh", "-c", "echo last words")
	stdin, stdout, err := StartPiped(cmd)
	require.NoError(t, err)
	require.NoError(t, cmd.Wait())
	b, err := io.ReadAll(stdout)
	require.NoError(t, err)
	require.Equal(t, "last words\n", string(b))
	require.NoError(t, stdout.Close())
	_ = stdin.Close() // closed by Wait already
}

// A command that cannot start and one whose pipes are already taken leave
// no descriptor open. The collector is off meanwhile: it would close an
// unreachable pipe's descriptors itself and hide the leak.
func TestStartPipedFailures(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	before := leakcheck.FDCount()
	_, _, err := StartPiped(exec.Command("/nonexistent/ecxfer-ctrl-test"))
	require.Error(t, err)
	require.Equal(t, before, leakcheck.FDCount(), "descriptors after a failed start")

	cmd := exec.Command("cat")
	cmd.Stdout = io.Discard // StdoutPipe refuses a command with a Stdout
	_, _, err = StartPiped(cmd)
	require.Error(t, err)
	require.Equal(t, before, leakcheck.FDCount(), "descriptors after a refused stdout pipe")
}

// TestDecodeBoundsAllocation: frames that declare more than they carry are
// refused before the decoder allocates for them. The first made the
// decoder allocate over 100 MiB (found by FuzzDecode, whose workers then
// ran out of memory).
func TestDecodeBoundsAllocation(t *testing.T) {
	for _, b := range [][]byte{
		[]byte("\x84\xa10\xdf0000\xdf0K00\xdf0\x00\x00\x01\x000\xe3\xc9\xfd\b\xff\xff\xff\xff000"),
		{0x81, 0xa1, 'i', 0xdf, 0xff, 0xff, 0xff, 0xff},
		{0x81, 0xa1, 's', 0xde, 0xff, 0xff},
		{0x81, 0xa1, 'b', 0xc6, 0xff, 0xff, 0xff, 0xff},
		{0x81, 0xa1, 'x', 0xdd, 0x00, 0x01, 0x00, 0x00},
		{0xdf, 0xff, 0xff, 0xff, 0xff},
		append(bytes.Repeat([]byte{0x91}, 100), 0x01), // nested 100 deep
		{0x81, 0xa1, 'k', 0xa1, 'x', 0x00},            // a trailing byte
		{0xc1},
	} {
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		_, err := Decode(b)
		runtime.ReadMemStats(&m1)
		require.ErrorIs(t, err, ErrFrame, "%x", b)
		require.Less(t, m1.TotalAlloc-m0.TotalAlloc, uint64(64<<10), "%x: decoding allocated %d bytes", b, m1.TotalAlloc-m0.TotalAlloc)
	}
	// Every kind of value the shape check walks, in a message that decodes.
	m, err := Decode([]byte("\x83\xa1k\xa2ok\xa1i\x84\xa1a\xcc\x01\xa1b\xd1\xff\x00\xa1c\xcf\x00\x00\x00\x00\x00\x00\x00\x02\xa1d\xd3\x00\x00\x00\x00\x00\x00\x00\x03\xa1m\xc4\x02\x01\x02"))
	require.NoError(t, err)
	require.Equal(t, "ok", m.Kind)
	require.Equal(t, map[string]int64{"a": 1, "b": -256, "c": 2, "d": 3}, m.Ints)
	require.Equal(t, []byte{1, 2}, m.Metadata)
}

// TestTakeStdoutOnce: standard output is taken once. A second TakeStdout
// used to succeed with a duplicate of standard error (fd 1 points there
// after the first), and the stream it was meant for went to stderr. Runs
// in a child of the test binary, whose fd 1 the parent reads.
func TestTakeStdoutOnce(t *testing.T) {
	if os.Getenv("ECXFER_CTRL_TAKE_CHILD") == "1" {
		c, err := ChildConn()
		if err != nil {
			os.Exit(3)
		}
		_, again := TakeStdout()
		msg := "refused"
		if again == nil {
			msg = "taken twice"
		}
		if c.Send(Message{Kind: "second", Name: msg}) != nil {
			os.Exit(4)
		}
		os.Exit(0)
	}
	leakcheck.Check(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestTakeStdoutOnce$")
	cmd.Env = append(os.Environ(), "ECXFER_CTRL_TAKE_CHILD=1")
	stdin, stdout, err := StartPiped(cmd)
	require.NoError(t, err)
	m, err := New(stdout, stdin).Expect("second")
	require.NoError(t, err)
	require.Equal(t, "refused", m.Name)
	require.NoError(t, cmd.Wait())
	require.NoError(t, stdout.Close())
}
