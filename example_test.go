package ecxfer_test

import (
	"bytes"
	"context"
	"fmt"
	"time"

	"github.com/ecxfer/ecxfer"
)

// A producer publishes blocks; a consumer reads three of them and the
// producer learns, by a notification, that it may reuse them.
func Example() {
	const blockSize, numBlocks = 5120, 64
	prod, err := ecxfer.New(ecxfer.Config{AgentName: "encoder-0", Backend: "loopback", BlockSize: blockSize, NumBlocks: numBlocks})
	if err != nil {
		panic(err)
	}
	defer prod.Deregister()
	cons, err := ecxfer.New(ecxfer.Config{AgentName: "prefill-0", Backend: "loopback", BlockSize: blockSize, NumBlocks: numBlocks})
	if err != nil {
		panic(err)
	}
	defer cons.Deregister()

	// The producer's encoder writes embeddings into its blocks.
	for b := 7; b <= 9; b++ {
		copy(prod.Region()[b*blockSize:], bytes.Repeat([]byte{byte(b)}, blockSize))
	}

	// Metadata and descriptors travel over the control plane; here we hand
	// them over directly.
	peer, err := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
	if err != nil {
		panic(err)
	}
	h, err := cons.PostRead([]int{0, 1, 2}, peer, []int{7, 8, 9}, []byte("req-42"))
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := cons.Wait(ctx, h); err != nil {
		panic(err)
	}
	st, _ := cons.CheckXferState(h)
	_ = cons.ReleaseXferHandle(h)
	fmt.Println("state:", st, "first byte of each block:", cons.Region()[0], cons.Region()[blockSize], cons.Region()[2*blockSize])

	// The producer's reactor received the notification on its own.
	for {
		if n := prod.NewNotifs(); len(n) > 0 {
			for sender, msgs := range n {
				fmt.Printf("%s got %q from %s\n", peer, msgs[0], sender)
			}
			break
		}
		time.Sleep(time.Millisecond)
	}
	// Output:
	// state: DONE first byte of each block: 7 8 9
	// encoder-0 got "req-42" from prefill-0
}
