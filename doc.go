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
// one host and TCP or RDMA across hosts; "nixl" drives the NIXL library
// (package nixl/libnixl), so ecxfer and vLLM's own NIXL agents can read each
// other's blocks; "loopback" keeps both agents in one process and is for
// tests and for measuring the reactor alone.
//
// A producer and a consumer in one process (two processes exchange
// AgentMetadata and MemDescriptor over any channel they like):
//
//	prod, _ := ecxfer.New(ecxfer.Config{AgentName: "encoder-0", BlockSize: 5120, NumBlocks: 1024})
//	cons, _ := ecxfer.New(ecxfer.Config{AgentName: "prefill-0", BlockSize: 5120, NumBlocks: 1024})
//	peer, _ := cons.AddRemotePeer(prod.AgentMetadata(), prod.MemDescriptor())
//	h, _ := cons.PostRead([]int{0, 1, 2}, peer, []int{7, 8, 9}, []byte("req-42"))
//	err := cons.Wait(ctx, h)            // or spin on CheckXferState
//	_ = cons.ReleaseXferHandle(h)
//	notifs, _ := prod.WaitNotifs(ctx)   // {"prefill-0": {"req-42"}}
//
// Every method is safe for concurrent use. Errors are sentinels that work
// with errors.Is.
//
// # Threat model
//
// A peer that holds our agent metadata can open an engine connection to us
// and read any byte of the region we registered (that is the point: only
// the block region is ever registered). It can also write into that region
// and, by driving UCX directly, issue out-of-range emulated gets that crash
// us: UCX 1.13's shared-memory and TCP transports neither bounds-check
// emulated gets at the target nor enforce a read-only registration (remote
// writes land even in memory registered for remote reads only). It
// can send us notifications under any sender name it likes (the name is
// the sender's own claim). What ecxfer guarantees is about its own
// actions: a READ of ours never touches memory outside our registered
// region (local indices are checked against our own block list) nor outside
// the regions the peer advertised (every descriptor it sends is checked in
// AddRemotePeer, before any engine call); malformed metadata, descriptor
// lists and control messages are refused with typed errors by strict,
// bounded, fuzzed decoders, never crash us and never make us allocate
// without bound, with one exception: the UCX worker address and packed
// remote keys inside ucx metadata go to UCX's own parsers, which take no
// length and trust their input, so metadata forged with a valid checksum
// can crash the process inside UCX (README, "Known limits"); peer names must be 1 to 256 printable ASCII bytes without
// spaces. A peer that stalls its reads through the engine sees them end in
// ErrTimeout (READs on the direct path are memory copies, not timed out);
// one that dies, in ErrRemoteDisconnect. So: metadata is a capability. Exchange it only over
// the deployment's own trusted control plane, with peers you trust with
// your region, on networks you trust (nothing on the wire is encrypted).
package ecxfer
