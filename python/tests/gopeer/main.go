// Command gopeer is the Go side of the Python <-> Go tests
// (python/tests/test_go_interop.py): a producer or a consumer on the Go
// transport, speaking JSON lines prefixed "@@ " on stdout and reading JSON
// lines on stdin. UCX logs to stdout too: its lines are moved to stderr
// (ctrl.TakeStdout), so a log line without a newline cannot swallow ours.
//
//	gopeer producer NAME NUM_BLOCKS BLOCK_SIZE SEED
//	gopeer consumer NAME NUM_BLOCKS BLOCK_SIZE
//
// Blocks hold byte (b*131 + seed + 7*j) mod 256 at offset j of block b,
// the formula of the Python tests.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/ecxfer/ecxfer"
	"github.com/ecxfer/ecxfer/internal/ctrl"
)

func fill(dst []byte, seed, b int) {
	for j := range dst {
		dst[j] = byte(b*131 + seed + 7*j)
	}
}

// out is the protocol stream: the real stdout, fd 1 being stderr.
var out = os.Stdout

func say(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	fmt.Fprintf(out, "@@ %s\n", b)
}

type blobs struct {
	MD   []byte `json:"md"`
	Desc []byte `json:"desc"`
}

type job struct {
	blobs
	Seed  int `json:"seed"`
	Reads []struct {
		Local  []int  `json:"local"`
		Remote []int  `json:"remote"`
		Notif  string `json:"notif"`
	} `json:"reads"`
}

func main() {
	if len(os.Args) < 5 {
		fmt.Fprintln(os.Stderr, "usage: gopeer producer|consumer NAME NUM_BLOCKS BLOCK_SIZE [SEED]")
		os.Exit(2)
	}
	var err error
	if out, err = ctrl.TakeStdout(); err != nil {
		fmt.Fprintln(os.Stderr, "gopeer:", err)
		os.Exit(1)
	}
	nums := make([]int, 0, 3)
	for _, a := range os.Args[3:] {
		n, err := strconv.Atoi(a)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		nums = append(nums, n)
	}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<24)
	if err := run(os.Args[1], os.Args[2], nums, in); err != nil {
		say(map[string]string{"error": err.Error()})
		os.Exit(1)
	}
}

func run(role, name string, nums []int, in *bufio.Scanner) error {
	nb, bs := nums[0], nums[1]
	t, err := ecxfer.New(ecxfer.Config{AgentName: name, BlockSize: bs, NumBlocks: nb})
	if err != nil {
		return err
	}
	defer func() { _ = t.Deregister() }()
	say(blobs{MD: t.AgentMetadata(), Desc: t.MemDescriptor()})
	hear := func(v any) error {
		if !in.Scan() {
			return fmt.Errorf("stdin closed: %v", in.Err())
		}
		return json.Unmarshal(in.Bytes(), v)
	}
	switch role {
	case "producer":
		if len(nums) < 3 {
			return fmt.Errorf("producer needs a seed")
		}
		err = produce(t, nb, bs, nums[2], hear)
	case "consumer":
		err = consume(t, bs, hear)
	default:
		return fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		return err
	}
	var quit any
	_ = hear(&quit)
	return nil
}

// produce fills the region's nb blocks of bs bytes, waits for as many notifications as it is told
// to expect (at most 30 s) and reports them.
func produce(t *ecxfer.Transport, nb, bs, seed int, hear func(any) error) error {
	region := t.Region()
	for b := 0; b < nb; b++ {
		fill(region[b*bs:(b+1)*bs], seed, b)
	}
	var want struct {
		ExpectNotifs int `json:"expect_notifs"`
	}
	if err := hear(&want); err != nil {
		return err
	}
	var got [][2]string
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for len(got) < want.ExpectNotifs {
		m, err := t.WaitNotifs(ctx)
		if err != nil {
			break
		}
		for sender, msgs := range m {
			for _, msg := range msgs {
				got = append(got, [2]string{sender, string(msg)})
			}
		}
	}
	say(map[string]any{"notifs": got})
	return nil
}

// consume (blocks of bs bytes) adds the producer it is given, does the READs it is told to and
// reports each one's state and the local blocks whose bytes are wrong.
func consume(t *ecxfer.Transport, bs int, hear func(any) error) error {
	var j job
	if err := hear(&j); err != nil {
		return err
	}
	peer, err := t.AddRemotePeer(j.MD, j.Desc)
	if err != nil {
		return err
	}
	type result struct {
		State     string `json:"state"`
		Error     string `json:"error,omitempty"`
		BadBlocks []int  `json:"bad_blocks"`
	}
	var results []result
	region := t.Region()
	want := make([]byte, bs)
	for _, rd := range j.Reads {
		h, err := t.PostRead(rd.Local, peer, rd.Remote, []byte(rd.Notif))
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		werr := t.Wait(ctx, h)
		cancel()
		r := result{State: "DONE", BadBlocks: []int{}}
		if werr != nil {
			r.State, r.Error = "ERR", werr.Error()
		}
		_ = t.ReleaseXferHandle(h)
		for k, loc := range rd.Local {
			fill(want, j.Seed, rd.Remote[k])
			if string(region[loc*bs:(loc+1)*bs]) != string(want) {
				r.BadBlocks = append(r.BadBlocks, loc)
			}
		}
		results = append(results, r)
	}
	say(map[string]any{"results": results})
	return nil
}
