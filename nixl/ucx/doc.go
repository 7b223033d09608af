// Package ucx is ecxfer's transfer engine: a nixl.Agent over UCX's UCP
// layer (UCX >= 1.13, cgo, `pkg-config ucx`). A consumer READs blocks from
// a producer's registered memory with one-sided gets and, once the data has
// landed, the producer is told by an active message.
//
// # Shape
//
// One UCP context (RMA, AM, WAKEUP), one worker in serialized mode: the
// Agent is driven by one goroutine at a time, not always on the same
// thread (it is a nixl.AnyThread: the reactor lets a caller polling a READ
// progress it while the reactor thread stands aside). UCX is tuned through its own
// environment variables (UCX_TLS, UCX_NET_DEVICES, ...), which this package
// never sets, with one default of its own in the context's configuration:
// the tcp transport's send segment is 64 KiB (UCX's is 8 KiB), unless
// UCX_TCP_TX_SEG_SIZE is set, so that a get of a block of up to 64 KiB,
// which UCX emulates over tcp, is answered with one send (see ecx_create).
//
// PostXfer posts the gets (or puts) of a request with one cgo call, from a
// C array of merged ranges built by MakeXfer, cut into pieces of at most
// 1 MiB. A round (from one Progress to the next) posts at most 4 MiB, new
// requests and the rest of earlier ones together, though every new request
// posts at least one piece: the rest of a large request goes out in later
// Progress calls, oldest first, so a one-block READ behind a 256 MiB one
// is not held up for the whole copy (UCX-allocated memory over shared
// memory is copied inside ucp_get_nbx), and releasing it, or a timeout,
// stops it between pieces. UCX completion callbacks are C
// functions that only count down a per-request C struct; when the last
// operation of a request has called back (for a WRITE, the endpoint flush
// that follows the puts), the request goes on a C ready list. Progress (one
// cgo call) drives the worker until idle and walks that list: a request with
// a notification sends it then (ucp_am_send_nbx, eager, header = our name),
// strictly after its data landed; the others move to a C completion queue
// that PollCompletions/XferStatus drain with one cgo call. A request
// completes (Err nil) when its data has landed and its notification's send
// has completed locally. UCX never calls into Go and no cgo.Handle exists.
//
// A READ of a peer in error mode PEER (another host: tcp, where UCX
// emulates each get with a request the peer answers) that advertises
// featGather is gathered instead (ECX_OP_GATHER, see ecx.h): it asks for
// its ranges in a few active messages, the peer checks them against its
// registered memory and answers with the bytes in 60 KiB active messages
// sent from its handler (252 KiB ones between two agents with
// Config.LargeTCPSegments, featBigSegments), and the READ completes when
// every chunk has been copied into place. UCX's answer path for emulated gets aborts the
// process when the reader's endpoint failed meanwhile; the gather's
// answers are this package's own sends, whose failure it handles.
//
// A get has landed when it calls back, so a READ needs no flush. When all
// gets complete inside ucp_get_nbx (UCX-allocated memory over shared memory
// is a plain copy), the notification goes out inside the call that posted
// the last piece. (ecxfer's reactor passes no notification: it sends it
// itself once the READ is published DONE.)
//
// Received notifications are copied, inside the AM handler, into a C queue
// that GetNotifs drains. Senders force eager protocol and notifications are
// limited to Config.MaxNotif (nixl.DefaultMaxNotif, 64 KiB, by default;
// MakeXfer and SendNotif refuse larger ones with ErrInvalidParam), so the
// handler never has to fetch rendezvous data. A message that arrives by
// rendezvous anyway (from a sender that does not force eager) is dropped
// there and counted; DroppedNotifs (nixl.NotifDropper) reports the count.
//
// # Memory
//
// RegisterMem maps caller memory (outside the Go heap). AllocMem uses
// UCP_MEM_MAP_ALLOCATE and touches every page: on this project's hosts, gets
// from UCX-allocated memory over shared memory are truly one-sided (the
// producer need not progress), while gets from caller memory are emulated
// with active messages and only complete while the owner progresses.
// A same-host peer's emulated gets travel through this worker's
// shared-memory receive queue, shared by all its same-host peers; a peer
// that dies in the middle of an answer can leave that queue stuck for all
// of them. SharedQueueGets (nixl.SharedQueueGetter) reports such peers
// (ucp_ep_print_info shows a sysv or posix lane) so that the caller can
// refuse them or read them some other way.
// Emulated gets are not bounds-checked by the target, so PrepDlist checks
// every remote descriptor against the regions the peer advertised, and each
// range is split where it would cross from one region (rkey) into the next.
//
// # Metadata
//
// A versioned msgpack blob: [magic, version, body, xxhash64(body)] (version
// 2 from an agent with LargeTCPSegments, so that builds from before it,
// which read version 1 alone, refuse it; 1 from every other), the body
// holding name, host identity (kernel boot id, network- and pid-namespace
// inodes), pid and process start time, UCX version, worker address and
// regions [addr, len, packed rkey]. Decoding is strict and bounded and pure
// Go; magic, version and checksum are checked first, then every kind and
// length, region overlap, the UCX major version and the worker address
// format nibble. Only bytes of a blob that passed all of this reach UCX,
// whose address and rkey parsers take no length and trust their input: a
// blob crafted with a valid checksum can still feed UCX bad bytes. Metadata
// must come from peers of the same deployment. The regions a blob claims
// are not taken on trust for a peer on this host, whose memory this
// process reads directly: each must lie inside the segment UCX mapped here
// for its rkey or, for caller memory, inside one mapping of the peer
// process, or the peer is refused (truth.go). A peer on another host
// serves every get from its own memory, so its claims are not checked.
//
// # Error handling mode and liveness
//
// UCX 1.13's error-handling mode decides both speed and what we learn about
// a dead peer:
//
//   - Same host (boot id and both namespaces match): UCP_ERR_HANDLING_MODE_NONE,
//     the default of ErrModeAuto. Shared-memory transports are allowed, but
//     UCX never reports a dead peer: gets to a killed peer's registered
//     memory hang forever and gets to its UCX-allocated memory keep
//     "succeeding" on the leftover segment. Liveness therefore comes from a
//     pidfd (pidfd_open on the advertised pid, checked against the process
//     start time so a recycled pid is not mistaken for the peer). The pidfd
//     is in the EventFD epoll set, polled by Arm before every sleep, by
//     Progress at most every LivenessPoll (10 ms; it looks at the clock
//     every 64th call, so on a loop slower than 156 µs a turn, every 64
//     turns) and by PostXfer before the first
//     post to a same-host peer after each Progress: a READ posted after
//     the peer's death (its pidfd readable) fails with ErrRemoteDisconnect
//     instead of reading the segment the dead peer left behind. The cost is
//     one poll(2) per loop turn that posts.
//   - Other hosts: UCP_ERR_HANDLING_MODE_PEER. UCX keepalive detects the
//     death, fails outstanding operations (UCS_ERR_ENDPOINT_TIMEOUT, ...)
//     and calls the endpoint error callback, which queues the peer in C for
//     Progress to handle.
//   - Same host over tcp alone: PEER as well, when either end's UCX has
//     no shared-memory transport (UCX_TLS=tcp; featTCPAlone in its
//     metadata) and the peer is of a build that applies this rule
//     (featModeRule), so that both ends agree: UCX refuses a connection
//     whose ends differ. Shared memory is out of reach for the pair
//     anyway, and over tcp mode NONE left UCX's emulated gets, whose
//     answering side aborts when the reader's endpoint has failed, and an
//     abort in the purge of a wire-up request; PEER makes the pair's
//     READs gathered ones, as across hosts. The pidfd is kept too.
//   - ErrModePeer forces PEER for every peer. Its cost: in UCX 1.13 PEER
//     cannot use shared memory, so same-host peers go over tcp, roughly 8x
//     slower. ErrModeNone forces NONE: remote deaths go unnoticed.
//
// When a peer dies, every in-flight request to it completes with
// ErrRemoteDisconnect at once and its C requests are orphaned (freed when
// their last UCX operation calls back, whose end is reported to Go only so
// that it can let go of the memory they wrote). Its endpoint
// is closed: in PEER mode with UCP_EP_CLOSE_FLAG_FORCE; in NONE mode with a
// flush, because UCX 1.13 refuses a forced close there (INVALID_PARAM, and
// nothing is closed). The rkeys go once the close completes. But UCX 1.13
// destroys an endpoint whose id it has resolved (a wireup exchange with
// the peer) only with the worker: its close completes and the endpoint,
// with its mappings of the peer's segments (about 4 MiB), stays until
// Close. UCX resolves it for an emulated get (caller memory on the engine
// path), when it unpacks such an rkey, and for any active message it
// cannot send at once on its short path (92 bytes of header and payload
// over shared memory with UCX's defaults, or any size while the peer's
// receive queue is full). So on NONE-mode endpoints:
//   - Same-host caller memory (recognised from the peer's own mappings)
//     has its rkeys unpacked only before the first transfer.
//   - Notifications are sent on the short path only
//     (UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL): one that finds the peer's queue
//     full waits in C, with every later one to that peer, and is retried from
//     Progress; at most ECX_NOTIF_WAIT_MAX (4,096) wait for one peer, and
//     SendNotif refuses one more (ErrBackend, "no resource"); one whose
//     name and payload exceed the endpoint's short
//     path (read from ucp_ep_print_info) goes in fragments that fit it,
//     to a peer whose metadata says it reassembles them (featFragNotifs,
//     see frag.go). A peer of an older build gets it whole, as before.
//   - Notifications still waiting when the peer is dropped alive go
//     before its endpoint closes (within ECX_DRAIN_NS); a dead peer's are
//     dropped. A peer that died with its receive queue full cannot have
//     its endpoint flushed: that close never completes (until Close).
//
// (The transport sends notifications to peers it reads directly over a
// socket of its own, so those endpoints carry nothing.) Emulated gets a
// dead peer never answered are released with the worker too (UCX then
// warns about unreturned requests).
//
// InvalidateRemoteMetadata ends in-flight requests with ErrRemoteDisconnect
// and closes the endpoint the same way. Close gives PEER-mode endpoints a
// flushed close (a forced one lost notifications already handed to the
// socket), waits at most 250 ms for pending closes, leaves NONE-mode
// endpoints to the worker (their rkeys are destroyed after its last
// progress call), and destroys the worker and context.
//
// ReleaseXfer of an in-flight request calls ucp_request_cancel on its
// outstanding operations (in UCX 1.13 this does not stop RMA already under
// way: those gets may still land) and orphans it: no notification is sent
// and nothing is reported. Until the orphan's last get has called back,
// its local ranges are fenced: a READ posted into them is held, in flight
// with nothing posted, so a late reply cannot overwrite its bytes
// (fence.go).
package ucx
