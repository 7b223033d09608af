package libnixl

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
)

// appendRecord writes one record the way ecxnixl_notifs does.
func appendRecord(buf []byte, sender string, msg []byte) []byte {
	buf = binary.NativeEndian.AppendUint32(buf, uint32(len(sender)))
	buf = binary.NativeEndian.AppendUint32(buf, uint32(len(msg)))
	buf = append(buf, sender...)
	buf = append(buf, msg...)
	for len(buf)%recAlign != 0 {
		buf = append(buf, 0xee)
	}
	return buf
}

type rec struct {
	sender string
	msg    []byte
}

func records(rs ...rec) []byte {
	var buf []byte
	for _, r := range rs {
		buf = appendRecord(buf, r.sender, r.msg)
	}
	return buf
}

func TestParseNotifsWellFormed(t *testing.T) {
	rs := []rec{
		{"prod-a", []byte("hello")},
		{"prod-b", nil},
		{"prod-a", bytes.Repeat([]byte{7}, 16)}, // no padding needed
		{"", []byte("x")},
	}
	buf := records(rs...)
	dst := map[string][][]byte{"prod-a": {[]byte("earlier")}}
	n, err := parseNotifs(buf, len(rs), dst)
	require.NoError(t, err)
	require.Equal(t, len(rs), n)
	require.Equal(t, [][]byte{[]byte("earlier"), []byte("hello"), bytes.Repeat([]byte{7}, 16)}, dst["prod-a"])
	require.Len(t, dst["prod-b"], 1)
	require.Empty(t, dst["prod-b"][0])
	require.Equal(t, [][]byte{[]byte("x")}, dst[""])

	// Messages are copies: the shim's buffer is reused on the next call.
	for i := range buf {
		buf[i] = 0
	}
	require.Equal(t, []byte("hello"), dst["prod-a"][1])

	n, err = parseNotifs(nil, 0, dst)
	require.NoError(t, err)
	require.Zero(t, n)
}

func TestParseNotifsHostile(t *testing.T) {
	good := records(rec{"p", []byte("12345")}, rec{"q", []byte("abc")})
	first := int(recordSize(1, 5))
	overSender := records(rec{"p", []byte("12345")})
	binary.NativeEndian.PutUint32(overSender[recSenderLenOff:], 1<<31)
	overMsg := append([]byte(nil), good...)
	binary.NativeEndian.PutUint32(overMsg[first+recMsgLenOff:], 0xffffffff)
	msgIntoPad := records(rec{"p", []byte("12345")})
	binary.NativeEndian.PutUint32(msgIntoPad[recMsgLenOff:], 6) // 8+1+6 = 15, pads to 16: fits
	msgPastPad := records(rec{"p", []byte("12345")})
	binary.NativeEndian.PutUint32(msgPastPad[recMsgLenOff:], 8) // needs 24 of 16

	cases := []struct {
		name  string
		buf   []byte
		count int
		n     int // records delivered
		ok    bool
	}{
		{"all", good, 2, 2, true},
		{"fewer counted than written", good, 1, 1, false},
		{"more counted than written", good, 3, 2, false},
		{"header cut", good[:first+4], 2, 1, false},
		{"body cut", good[:len(good)-1], 2, 1, false},
		{"padding missing", good[:first+recHeaderLen+1+3], 2, 1, false},
		{"sender past the end", overSender, 1, 0, false},
		{"message past the end", overMsg, 2, 1, false},
		{"message into padding", msgIntoPad, 1, 1, true},
		{"message past padding", msgPastPad, 1, 0, false},
		{"empty buffer, one counted", nil, 1, 0, false},
		{"bytes but none counted", good, 0, 0, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dst := map[string][][]byte{}
			n, err := parseNotifs(tc.buf, tc.count, dst)
			require.Equal(t, tc.n, n)
			if tc.ok {
				require.NoError(t, err)
			} else {
				require.Error(t, err)
			}
			got := 0
			for _, ms := range dst {
				got += len(ms)
			}
			require.Equal(t, tc.n, got, "messages delivered")
		})
	}
}

// FuzzParseNotifs: any bytes and count are parsed without a panic or a
// read outside buf; what is delivered is a prefix of the records, and a
// clean parse re-encodes to exactly the input.
func FuzzParseNotifs(f *testing.F) {
	f.Add(records(rec{"prod", []byte("hello")}, rec{"other", nil}), 2)
	f.Add(records(rec{"", bytes.Repeat([]byte{1}, 40)}), 1)
	f.Add([]byte{1, 0, 0, 0, 255, 255, 255, 255, 'x'}, 1)
	f.Add([]byte{}, 0)
	f.Fuzz(func(t *testing.T, buf []byte, count int) {
		if count < 0 || count > 1<<16 {
			return
		}
		in := append([]byte(nil), buf...)
		dst := map[string][][]byte{}
		var order []rec
		n, err := parseNotifs(buf, count, dst)
		if n < 0 || n > count {
			t.Fatalf("delivered %d of %d", n, count)
		}
		if err == nil && n != count {
			t.Fatalf("no error but %d of %d delivered", n, count)
		}
		if !bytes.Equal(in, buf) {
			t.Fatal("parseNotifs modified its input")
		}
		// Re-read the delivered records in order and check them against
		// the bytes they came from.
		off := 0
		seen := map[string]int{}
		for i := 0; i < n; i++ {
			hl := int(binary.NativeEndian.Uint32(buf[off+recSenderLenOff:]))
			ml := int(binary.NativeEndian.Uint32(buf[off+recMsgLenOff:]))
			name := string(buf[off+recHeaderLen:][:hl])
			msg := dst[name][seen[name]]
			seen[name]++
			if !bytes.Equal(msg, buf[off+recHeaderLen+hl:][:ml]) {
				t.Fatalf("record %d: message differs from its bytes", i)
			}
			order = append(order, rec{name, msg})
			off += int(recordSize(uint64(hl), uint64(ml)))
		}
		total := 0
		for _, ms := range dst {
			total += len(ms)
		}
		if total != n {
			t.Fatalf("%d messages in dst, %d delivered", total, n)
		}
		if err == nil {
			// Padding bytes are not checked, so compare lengths and
			// the re-encoded records with padding taken from the input.
			re := records(order...)
			if len(re) != len(buf) {
				t.Fatalf("clean parse of %d bytes re-encodes to %d", len(buf), len(re))
			}
		}
	})
}
