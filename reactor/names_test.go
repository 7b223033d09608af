package reactor

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestValidName(t *testing.T) {
	for _, ok := range []string{"a", "prefill-0", "~!#", strings.Repeat("x", 256)} {
		require.True(t, ValidName(ok), "%q", ok)
	}
	for _, bad := range []string{"", " ", "a b", "a\tb", "a\x00", "\x7f", "caf\xc3\xa9", "\xff", strings.Repeat("x", 257)} {
		require.False(t, ValidName(bad), "%q", bad)
	}
}

// QuoteName quotes a name for an error message, whatever it holds, and
// cuts one longer than a valid name can be so that a hostile peer's name
// of megabytes does not land in every error and log line.
func TestQuoteName(t *testing.T) {
	require.Equal(t, `"prefill-0"`, QuoteName("prefill-0"))
	require.Equal(t, `"a\x00b\n"`, QuoteName("a\x00b\n"))
	long := strings.Repeat("y", 256)
	require.Equal(t, `"`+long+`"`, QuoteName(long))
	q := QuoteName(strings.Repeat("z", 1<<20))
	require.Equal(t, `"`+strings.Repeat("z", 256)+`"... (1048576 bytes)`, q)
	require.Less(t, len(QuoteName(strings.Repeat("\xff", 1<<20))), 2048, "escaped bytes are cut too")
}
