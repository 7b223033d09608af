package ctrl

import (
	"encoding/binary"
	"fmt"
)

// maxDepth bounds how deeply a message's msgpack values nest; a Message is
// two levels deep.
const maxDepth = 16

// checkShape walks the msgpack value that must make up all of body and
// refuses it before any decoding when it is malformed, nests deeper than
// maxDepth, or declares a string, binary, array or map longer than the
// bytes left. The decoder sizes what it allocates by those declared
// lengths (up to a million map entries, for every map, even one it only
// skips), so without the check a 40-byte frame made it allocate over
// 100 MiB, and a stream of such frames exhausted memory.
func checkShape(body []byte) error {
	end, err := skipValue(body, 0, 0)
	if err != nil {
		return err
	}
	if end != len(body) {
		return fmt.Errorf("%d bytes after the message", len(body)-end)
	}
	return nil
}

// skipValue returns the offset just past the value at off.
func skipValue(b []byte, off, depth int) (int, error) {
	if off >= len(b) {
		return 0, fmt.Errorf("truncated at byte %d", off)
	}
	c := b[off]
	off++
	var n, size int // a container's elements, or a payload's bytes
	container := false
	switch {
	case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
		return off, nil
	case c <= 0x8f: // fixmap
		n, container = 2*int(c&0x0f), true
	case c <= 0x9f: // fixarray
		n, container = int(c&0x0f), true
	case c <= 0xbf: // fixstr
		size = int(c & 0x1f)
	default:
		var width, extra int // length field's bytes; the ext type byte
		switch c {
		case 0xc4, 0xd9: // bin8, str8
			width = 1
		case 0xc5, 0xda: // bin16, str16
			width = 2
		case 0xc6, 0xdb: // bin32, str32
			width = 4
		case 0xc7, 0xc8, 0xc9: // ext8, ext16, ext32
			width, extra = 1<<(c-0xc7), 1
		case 0xca: // float32
			size = 4
		case 0xcb: // float64
			size = 8
		case 0xcc, 0xcd, 0xce, 0xcf: // uint8..uint64
			size = 1 << (c - 0xcc)
		case 0xd0, 0xd1, 0xd2, 0xd3: // int8..int64
			size = 1 << (c - 0xd0)
		case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1..16, plus the type byte
			size = 1 + 1<<(c-0xd4)
		case 0xdc, 0xde: // array16, map16
			width, container = 2, true
		case 0xdd, 0xdf: // array32, map32
			width, container = 4, true
		default: // 0xc1, never used
			return 0, fmt.Errorf("byte %d: 0x%02x is not a msgpack type", off-1, c)
		}
		if width > 0 {
			if len(b)-off < width {
				return 0, fmt.Errorf("truncated length at byte %d", off)
			}
			var l uint64
			switch width {
			case 1:
				l = uint64(b[off])
			case 2:
				l = uint64(binary.BigEndian.Uint16(b[off:]))
			case 4:
				l = uint64(binary.BigEndian.Uint32(b[off:]))
			}
			off += width
			if l > uint64(len(b)) {
				return 0, fmt.Errorf("byte %d: declares %d, the message has %d bytes", off-width-1, l, len(b))
			}
			if container {
				n = int(l)
				if c == 0xde || c == 0xdf {
					n *= 2
				}
			} else {
				size = int(l) + extra
			}
		}
	}
	if !container {
		if len(b)-off < size {
			return 0, fmt.Errorf("byte %d: %d bytes declared, %d left", off, size, len(b)-off)
		}
		return off + size, nil
	}
	// Every element takes at least a byte.
	if n > len(b)-off {
		return 0, fmt.Errorf("byte %d: %d elements declared, %d bytes left", off, n, len(b)-off)
	}
	if depth >= maxDepth {
		return 0, fmt.Errorf("byte %d: nested deeper than %d", off, maxDepth)
	}
	for range n {
		var err error
		if off, err = skipValue(b, off, depth+1); err != nil {
			return 0, err
		}
	}
	return off, nil
}
