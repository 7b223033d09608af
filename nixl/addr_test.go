package nixl

import (
	"testing"
	"unsafe"
)

func TestAddr(t *testing.T) {
	if got := Addr(nil); got != 0 {
		t.Fatalf("Addr(nil) = %#x, want 0", got)
	}
	b := make([]byte, 8)
	if got, want := Addr(b), uint64(uintptr(unsafe.Pointer(&b[0]))); got != want {
		t.Fatalf("Addr(b) = %#x, want %#x", got, want)
	}
	if got, want := Addr(b[3:]), uint64(uintptr(unsafe.Pointer(&b[3]))); got != want {
		t.Fatalf("Addr(b[3:]) = %#x, want %#x", got, want)
	}
}
