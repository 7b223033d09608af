package descriptors

import "testing"

// 880 blocks is the largest image the design targets.
const benchBlocks = 880

func BenchmarkEncode880(b *testing.B) {
	l := BuildBlockDescs(blockBase, benchBlocks, 5120, 0)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Encode(l); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchBlocks), "ns/desc")
}

func BenchmarkDecode880(b *testing.B) {
	enc, err := Encode(BuildBlockDescs(blockBase, benchBlocks, 5120, 0))
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(enc)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Decode(enc); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchBlocks), "ns/desc")
}

func benchMergeRuns(b *testing.B, li, ri []int) {
	local := BuildBlockDescs(0x100000, benchBlocks, 5120, 0)
	remote := BuildBlockDescs(blockBase, benchBlocks, 5120, 0)
	dst := make([]Range, 0, benchBlocks)
	b.ReportAllocs()
	for b.Loop() {
		var err error
		if dst, err = MergeRuns(dst, local, remote, li, ri); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchBlocks), "ns/desc")
}

func BenchmarkMergeRuns880Contiguous(b *testing.B) {
	benchMergeRuns(b, seq(0, benchBlocks), seq(0, benchBlocks))
}

func BenchmarkMergeRuns880Scattered(b *testing.B) {
	benchMergeRuns(b, scatteredIdx(benchBlocks), scatteredIdx(benchBlocks))
}
