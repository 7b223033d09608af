package shmview

import (
	"fmt"
	"testing"
)

// BenchmarkCopy compares a guarded copy out of a view with a plain copy
// between two private buffers of the same size.
func BenchmarkCopy(b *testing.B) {
	for _, size := range []int{5120, 32 << 10, 880 * 32 << 10} {
		r, err := Alloc("bench", size)
		if err != nil {
			b.Fatal(err)
		}
		fill(r.Mem, 1)
		a, _ := r.Advert()
		v, err := Open(&a)
		if err != nil {
			b.Fatal(err)
		}
		dst := make([]byte, size)
		src := make([]byte, size)
		b.Run(fmt.Sprintf("view/%d", size), func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				if err := Copy(dst, v.Bytes()); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("plain/%d", size), func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				copy(dst, src)
			}
		})
		v.Close()
		_ = r.Close()
	}
}

func BenchmarkAcquireRelease(b *testing.B) {
	r, err := Alloc("bench", 4096)
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	a, _ := r.Advert()
	v, _ := Open(&a)
	defer v.Close()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if v.Acquire() {
				v.Release()
			}
		}
	})
}
