package procinfo

import (
	"errors"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
)

// statLine is a /proc/<pid>/stat line in the kernel's format whose command
// name holds spaces and parentheses, with starttime (field 22) = start.
func statLine(comm string, start uint64) []byte {
	f := []string{"S"} // field 3
	for i := 4; i <= 52; i++ {
		v := strconv.Itoa(i * 7)
		if i == 22 {
			v = strconv.FormatUint(start, 10)
		}
		f = append(f, v)
	}
	return []byte("4242 (" + comm + ") " + strings.Join(f, " ") + "\n")
}

func TestParseStartTime(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []byte
		want uint64
		err  bool
	}{
		{name: "plain", in: statLine("sleep", 123456), want: 123456},
		{name: "parens and spaces in comm", in: statLine("a) b (c) 9 9", 77), want: 77},
		{name: "max", in: statLine("x", 1<<64-1), want: 1<<64 - 1},
		{name: "empty", in: nil, err: true},
		{name: "no paren", in: []byte("1 sleep S 1 2 3"), err: true},
		{name: "truncated", in: []byte("1 (sleep) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18"), err: true},
		{name: "not a number", in: []byte("1 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 -5 20"), err: true},
		{name: "overflow", in: []byte("1 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 99999999999999999999 20"), err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseStartTime(tc.in)
			if tc.err {
				if !errors.Is(err, ErrStat) {
					t.Fatalf("ParseStartTime = %d, %v; want ErrStat", got, err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("ParseStartTime = %d, %v; want %d", got, err, tc.want)
			}
		})
	}
}

func FuzzParseStartTime(f *testing.F) {
	f.Add(statLine("sleep", 99))
	f.Add(statLine("a) b", 1))
	f.Add([]byte(")"))
	f.Add([]byte("1 (x) S"))
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := ParseStartTime(b)
		if err != nil {
			if !errors.Is(err, ErrStat) {
				t.Fatalf("error %v is not ErrStat", err)
			}
			return
		}
		// A value is only ever read from after the last ')'.
		i := strings.LastIndexByte(string(b), ')')
		if i < 0 || !strings.Contains(string(b[i:]), strconv.FormatUint(v, 10)) {
			t.Fatalf("value %d does not appear after the last ')' of %q", v, b)
		}
	})
}

// child starts a process that lives until the test ends.
func child(t *testing.T) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd
}

func TestStartTime(t *testing.T) {
	leakcheck.Check(t)
	self, err := StartTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	again, err := StartTime(os.Getpid())
	if err != nil || again != self {
		t.Fatalf("second read = %d, %v; first %d", again, err, self)
	}
	c := child(t)
	cs, err := StartTime(c.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if cs < self {
		t.Fatalf("child started at %d, before this process (%d)", cs, self)
	}
	pid := c.Process.Pid
	_ = c.Process.Kill()
	_ = c.Wait()
	// Reaped, the pid is gone until the kernel recycles it; a recycled pid
	// has a later start time, which is the point of reading it.
	if s, err := StartTime(pid); err == nil && s == cs {
		t.Fatalf("reaped child %d still reads start time %d", pid, s)
	}
}

func TestStartTimeBadPID(t *testing.T) {
	for _, pid := range []int{0, -1, -1 << 31, 1 << 30} {
		if s, err := StartTime(pid); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("StartTime(%d) = %d, %v; want ErrNotExist", pid, s, err)
		}
	}
}

func TestBootID(t *testing.T) {
	id, err := BootID(64)
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`).MatchString(id) {
		t.Fatalf("boot id %q is not a UUID", id)
	}
	short, err := BootID(8)
	if err != nil || short != id[:8] {
		t.Fatalf("BootID(8) = %q, %v; want %q", short, err, id[:8])
	}
	if none, err := BootID(0); err != nil || none != "" {
		t.Fatalf("BootID(0) = %q, %v", none, err)
	}
}

func TestNSInode(t *testing.T) {
	c := child(t)
	kinds := []string{"net", "pid", "mnt"}
	seen := map[uint64]string{}
	for _, k := range kinds {
		ino, err := NSInode(k)
		if err != nil {
			t.Fatal(err)
		}
		if prev, dup := seen[ino]; dup {
			t.Fatalf("namespaces %s and %s share inode %d", prev, k, ino)
		}
		seen[ino] = k
		// A child shares this process's namespaces.
		fi, err := os.Stat("/proc/" + strconv.Itoa(c.Process.Pid) + "/ns/" + k)
		if err != nil {
			t.Fatal(err)
		}
		if ci := fi.Sys().(*syscall.Stat_t).Ino; ci != ino {
			t.Fatalf("%s namespace: child's inode %d, ours %d", k, ci, ino)
		}
	}
	for _, bad := range []string{"", "..", "../../etc/passwd", "net/x", "nosuchns"} {
		if ino, err := NSInode(bad); err == nil {
			t.Errorf("NSInode(%q) = %d, nil; want an error", bad, ino)
		}
	}
}
