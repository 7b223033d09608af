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
package ecxfer
