// Package ecxfer is a data plane for encoder-cache (EC) blocks: a consumer
// process READs fixed-size blocks of multimodal embeddings straight out of
// a producer process's registered memory, one-sided, and the producer is
// told by a notification when a read is done. It implements vLLM's EC
// data-plane transport, DataTransport, with vLLM's wire formats (the agent
// metadata blob and the msgpack memory descriptor list).
//
// Where vLLM's Python transport wraps one engine agent behind a global lock
// and makes progress only while a caller is inside it, a Transport gives
// the engine to one reactor thread (see package reactor) and talks to it
// through lock-free rings. PostRead validates and queues; the reactor
// batches, posts, progresses the engine, and publishes each transfer's
// state in a handle table, so CheckXferState is one atomic load and a
// producer's notifications and the reads of its memory make progress
// without any call from its owner.
//
// Backends: "ucx" (the default) moves bytes with UCX, over shared memory on
// one host and TCP or RDMA across hosts; "loopback" keeps both agents in one
// process and is for tests and for measuring the reactor alone.
//
// A producer and a consumer in one process (two processes exchange
// AgentMetadata and MemDescriptor over any channel they like):
//
//	prod, _ := ecxfer.New(ecxfer.Config{AgentName: "encoder-0", BlockSize: 5120, NumBlocks: 1024})
//	cons, _ := ecxfer.New(ecxfer.Config{AgentName: "prefill-0", BlockSize: 5120, NumBlocks: 1024})
//	peer, _ := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
//	h, _ := cons.PostRead([]int{0, 1, 2}, peer, []int{7, 8, 9}, []byte("req-42"))
//	err := cons.Wait(ctx, h)      // or spin on CheckXferState
//	_ = cons.ReleaseXferHandle(h)
//	notifs := prod.NewNotifs()    // {"prefill-0": {"req-42"}}
//
// Every method is safe for concurrent use. Errors are sentinels that work
// with errors.Is.
//
// # Threat model
//
// A peer that holds our agent metadata can open an engine connection to us
// and read any byte of the region we registered (that is the point: only
// the block region is ever registered), and it can send us notifications
// under the name in its own metadata (names are not authenticated). It
// cannot make a READ of ours touch memory outside our registered region
// (local indices are checked against our own block list), nor outside the
// regions it advertised (every descriptor it sends is checked against them
// in AddRemotePeer, before any engine call, because UCX's emulated gets are
// not bounds-checked by the target); it cannot crash us or make us allocate
// without bound with malformed metadata, descriptor lists or control
// messages (strict decoders with size and count limits, fuzzed). It can
// stall its own reads, which end in ErrTimeout, and it can die, which ends
// them in ErrRemoteDisconnect. Not defended: UCX parses worker addresses and
// packed keys without lengths, so a blob crafted by someone who computes
// our checksum can still feed UCX bad bytes; and nothing on the wire is
// encrypted. Exchange metadata over the deployment's own trusted control
// plane, on trusted networks.
package ecxfer
