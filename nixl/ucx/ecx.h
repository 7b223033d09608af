/*
 * ecx: the C half of ecxfer's UCX engine. Everything UCX calls back into
 * lives here and only touches C memory: per-post counters, a ready list, a
 * completion queue, a notification queue and a peer-error queue. Go drains
 * those queues with one cgo call per loop turn; UCX never calls into Go.
 */
#ifndef ECXFER_ECX_H
#define ECXFER_ECX_H

#include <stdint.h>
#include <stddef.h>
#include <ucp/api/ucp.h>

#if !defined(UCP_API_VERSION) || UCP_API_VERSION < UCP_VERSION(1, 13)
#error "ecxfer needs UCX >= 1.13"
#endif

#define ECX_OP_READ 0
#define ECX_OP_WRITE 1
/* A READ from a peer that serves gathers (ECX_AM_GATHER_REQ): its ranges
 * are asked for in a few messages and answered with the bytes, instead of
 * one UCX get per range. */
#define ECX_OP_GATHER 2
/* ECX_OP_GATHER whose answers come in chunks of ECX_GATHER_CHUNK_BIG: a
 * READ of a peer that, like this agent, runs with ECX_TCP_SEG_BIG
 * segments (featBigSegments). */
#define ECX_OP_GATHER_BIG 3

/* Bytes of gets or puts posted per ecx_progress round, new posts and
 * continued ones together; a post always posts at least one range. */
#define ECX_TURN_BUDGET (4u << 20)

/* Progress calls in a row that must find nothing before ecx_arm arms the
 * worker (see there): the re-arming callback of a deactivated interface
 * needs two after a wake-up; one more for a datagram queued behind. */
#define ECX_ARM_QUIET 3
/* And how long, in nanoseconds, those calls must keep finding nothing: the
 * time a sender takes between claiming a slot of a shared-memory queue and
 * marking it written, unless it is descheduled in between (see ecx_arm). */
#define ECX_ARM_QUIET_NS 5000
/* UCX tcp transport's TX_SEG_SIZE unless UCX_TCP_TX_SEG_SIZE is set. */
#define ECX_TCP_TX_SEG "64k"

/* Active-message id of notifications. */
#define ECX_AM_NOTIF 0xEC
/* Active-message id of a notification's fragments. UCX 1.13 sends an
 * active message larger than its short path (92 bytes of header and
 * payload over shared memory with UCX's defaults) only after resolving the
 * receiver's endpoint id, and an endpoint that did so is destroyed only
 * with its worker: closing it after its peer died left the peer's
 * shared-memory segments (about 4 MiB) mapped until the agent closed.
 * Toward a same-host peer that reassembles them, a notification whose
 * name and payload exceed the endpoint's short path goes as fragments
 * that each stay on it. A fragment is an ECX_FRAG_HDR-byte header,
 * little-endian: the sender's token (u64), the fragment's offset (u32)
 * and the total (u32) of the byte stream
 *   name length (u16) | name | payload,
 * then at most ECX_FRAG_MAX_DATA bytes of the stream from that offset. */
#define ECX_AM_NOTIF_FRAG 0xED
#define ECX_FRAG_HDR 16u
#define ECX_FRAG_MAX_DATA 8192u
/* The least a fragment carries: an endpoint whose short path is shorter
 * than header and this gets notifications whole. */
#define ECX_FRAG_MIN_DATA 16u
/* The largest notification the handler accepts (enginekit.MaxNotifLimit:
 * no engine may be configured for more), and the longest sender name
 * (an agent name is at most 256 bytes). Larger ones are counted as dropped
 * and never copied: a peer declares the lengths. */
#define ECX_NOTIF_MAX_PAYLOAD (1u << 20)
#define ECX_NOTIF_MAX_NAME 256u

/* The most notifications that may wait for room in one receiver's queue
 * (a receiver that stopped taking them: stopped or hung, not dead); one
 * more is refused (UCS_ERR_NO_RESOURCE). Without a bound they piled up
 * without end, and every progress call walked them all. */
#define ECX_NOTIF_WAIT_MAX 4096u

/* Gathered READs, for peers reached over tcp (error mode PEER). UCX 1.13
 * has no RMA over tcp: it emulates every get with a request the data
 * owner answers, one send per get, and the owner's answer path aborts the
 * process when the reader's endpoint has failed meanwhile (a reader
 * killed with gets queued at the owner: "Fatal: unexpected error" in
 * ucp_get_req_handler). A gathered READ asks for its ranges with a few
 * active messages, and the owner answers each with the bytes packed into
 * active messages of its own, whose failure it handles.
 *
 * A request (ECX_AM_GATHER_REQ, sent with UCP_AM_SEND_FLAG_REPLY) is an
 * ECX_GREQ_HDR-byte header, little-endian: the READ's id at the reader
 * (u64), the offset in the READ's byte stream where this request's bytes
 * start (u64), the number of ranges (u32), the chunk size the answers
 * are cut in (u32: 0 for ECX_GATHER_CHUNK, or ECX_GATHER_CHUNK_BIG, which
 * only an owner with ECX_TCP_SEG_BIG segments serves; builds before it
 * send 0 and owners before it ignore the field, so a reader names the
 * big size only to a peer that says it runs with big segments,
 * featBigSegments), the bytes asked for (u64); then the
 * ranges, each its address (u64) and length (u64) in the owner's
 * registered memory. The stream is the ranges' bytes in order.
 *
 * An answer (ECX_AM_GATHER_DATA) is an ECX_GDATA_HDR-byte header: the
 * READ's id (u64), the stream offset of its bytes (u64: its request's
 * offset plus a multiple of the chunk size), a ucs_status_t (i32) and the
 * length of its bytes (u32); then a chunk of the stream (less at the end
 * of a request). An answer with a status other than UCS_OK carries no bytes
 * and refuses the request at its offset: UCS_ERR_NO_RESOURCE while the
 * owner has ECX_GATHER_MAX_OUT bytes of answers in flight, or the reader
 * half of that (the reader asks again later), UCS_ERR_INVALID_PARAM or
 * UCS_ERR_INVALID_ADDR for a request it will not serve (a malformed one,
 * ranges outside its registered memory), which fails the READ (the
 * reader takes any other status for a refusal, UCS_ERR_REJECTED). The id
 * is random (gather_id). */
#define ECX_AM_GATHER_REQ 0xEE
#define ECX_AM_GATHER_DATA 0xEF
#define ECX_GREQ_HDR 32u
#define ECX_GDATA_HDR 24u
/* Bytes per answer: header and bytes stay within one 64 KiB tcp segment
 * (ECX_TCP_TX_SEG). */
#define ECX_GATHER_CHUNK (60u << 10)
/* UCX tcp segments (TX_SEG_SIZE and RX_SEG_SIZE) of an agent made with
 * big_segs, and the chunks of the answers between two such agents: fewer,
 * larger messages (each a system call at both ends and a trip through
 * UCX) made READs across two network namespaces 5-35% faster. A peer with
 * UCX's 64 KiB receive segments cannot take such a message, and UCX 1.13
 * does not tell a sender the peer's size: both ends must use them. */
#define ECX_TCP_SEG_BIG "256k"
#define ECX_GATHER_CHUNK_BIG (252u << 10)
/* The most a request asks for, in bytes and in ranges (its ranges then
 * fit one segment too). */
#define ECX_GATHER_REQ_BYTES (64u * ECX_GATHER_CHUNK)
#define ECX_GATHER_REQ_RANGES 2048u
/* Requests of one READ asked and not yet fully answered. */
#define ECX_GATHER_WINDOW 4u
/* An owner's bytes of answers in flight, over all readers, past which it
 * refuses requests as busy; one reader's may fill half of it. A reader
 * with none in flight is served up to twice it (gather_req_cb). */
#define ECX_GATHER_MAX_OUT (64u << 20)
/* Refusals to one reader still unsent past which the owner drops that
 * reader's requests unanswered: it has stopped taking what it is sent.
 * An honest reader has at most one refusal on the way per request it
 * has asked, ECX_GATHER_WINDOW per READ: this is a window for each of
 * 4,096 READs (the reactor's default handle table), a few MiB of UCX
 * requests at most. */
#define ECX_GATHER_MAX_REFUSED (4096u * ECX_GATHER_WINDOW)
/* Answer buffers of the largest request's size kept for the next
 * requests once their sends are done, at most this many; requests of
 * ECX_GBUF_KEEP_MIN bytes or more use them. A fresh allocation of that
 * size was mapped, page-faulted and zeroed by the kernel at every request
 * and given back at every free. */
#define ECX_GBUF_CACHE 4u
#define ECX_GBUF_KEEP_MIN (128u << 10)
/* How long a reader waits before asking again after UCS_ERR_NO_RESOURCE. */
#define ECX_GATHER_RETRY_NS 200000ull
/* The reader's table of READs waiting for answers, by id. */
#define ECX_GATHER_BUCKETS 256u
/* Random gathered-READ ids drawn from the kernel at a time (256 bytes). */
#define ECX_GATHER_IDS 32u

/* One merged piece of a transfer. */
typedef struct ecx_range {
    uint64_t local;
    uint64_t remote;
    uint64_t len;
    uint32_t rkey; /* index into the peer's rkey array */
    uint32_t pad;
} ecx_range_t;

/* One drained completion. */
typedef struct ecx_completion {
    uint64_t id;
    int32_t status; /* ucs_status_t */
    int32_t pad;    /* 0, or ECX_ORPHAN_END */
} ecx_completion_t;

/* pad of a cancelled post whose last UCX operation has now called back. */
#define ECX_ORPHAN_END 1

/* One received notification: header (sender name) then payload; for a
 * fragment (frag 1), its ECX_FRAG_HDR header then its bytes. */
typedef struct ecx_notif {
    struct ecx_notif *next;
    uint32_t hlen;
    uint32_t plen;
    uint32_t frag;
    uint32_t pad;
    char data[];
} ecx_notif_t;

/* Where the bytes of a notification start. */
enum { ECX_NOTIF_DATA_OFF = offsetof(ecx_notif_t, data) };

/* One endpoint error reported by UCX. */
typedef struct ecx_peer_err {
    struct ecx_peer_err *next;
    uint64_t peer;
    int32_t status;
    int32_t pad;
} ecx_peer_err_t;

typedef struct ecx_post ecx_post_t;
typedef struct ecx_close ecx_close_t;
typedef struct ecx_ep_arg ecx_ep_arg_t;

/* A registered region, for the owner's check of gather requests. */
typedef struct ecx_region {
    uint64_t addr;
    uint64_t len;
} ecx_region_t;

/* Counters of gathered READs (read by Go without a call). */
typedef struct ecx_gather_stats {
    uint64_t served;   /* requests answered with bytes */
    uint64_t busy;     /* requests refused for ECX_GATHER_MAX_OUT */
    uint64_t refused;  /* requests refused as malformed or out of bounds */
    uint64_t dropped;  /* requests not answered at all (no reply endpoint,
                          out of memory) */
    uint64_t late;     /* answers for READs no longer waiting (released) */
    uint64_t bad;      /* answers that do not fit the READ they name */
    uint64_t retries;  /* requests asked again after UCS_ERR_NO_RESOURCE */
    uint64_t zc_chunks;   /* answers sent out of registered memory */
    uint64_t copy_chunks; /* answers copied into an answer buffer first */
} ecx_gather_stats_t;

typedef struct ecx_ctx {
    ucp_context_h context;
    ucp_worker_h worker;
    int efd;

    char *name; /* AM header of every notification we send */
    uint32_t name_len;
    uint64_t token; /* names this context in the fragments it sends */

    ecx_post_t *live;       /* every post not yet freed */
    ecx_post_t *ready_head; /* posts whose UCX operations all finished */
    ecx_post_t *ready_tail;
    ecx_post_t *comp_head;  /* completed posts, for Go */
    ecx_post_t *comp_tail;
    ecx_notif_t *notif_head;
    ecx_notif_t *notif_tail;
    ecx_peer_err_t *err_head;
    ecx_peer_err_t *err_tail;
    ecx_close_t *closing;   /* endpoint closes in progress */
    ecx_post_t *posting;    /* posts with ranges not yet posted */
    ecx_post_t *sending;    /* posts with notification pieces not yet sent,
                               each peer's in order (read by Go without a
                               call) */
    ecx_post_t *sending_tail;
    uint64_t budget;        /* bytes left to post this round */
    uint8_t last_in_rounds; /* the last ecx_post left ranges for later
                               rounds (read by Go without a call) */

    uint64_t nlive;          /* posts alive */
    uint64_t notif_dropped;  /* notifications received and not queued */
    uint64_t notif_undelivered; /* waiting ones dropped unsent with their
                                   endpoint */
    uint32_t notif_wait_max;    /* ECX_NOTIF_WAIT_MAX (tests lower it) */
    int test_fail_sends;     /* tests: a gathered READ's requests fail
                                their endpoint inside the send, as UCX
                                does when the send finds the peer's
                                connection gone (gather_send) */
    uint32_t test_gather_chunk; /* tests: when not 0, the chunk size every
                                   gathered READ asks its answers in */
    int big_segs;            /* tcp segments of ECX_TCP_SEG_BIG both ways */
    uint64_t list_faults;    /* posts found on the ready list or the
                                completion queue when put there again */
    int shm;                 /* a shared-memory transport is among the
                                context's (context_has_shm) */
    int send_rndv;           /* tests: send notifications by rendezvous, as
                                a sender that does not force eager would */

    /* Gathered READs. As owner: the registered regions, sorted by
     * address, and the bytes of answers in flight. As reader: the READs
     * waiting for answers, by id, and those to ask again. */
    ecx_region_t *regions;
    uint32_t nregions;
    uint32_t capregions;
    uint64_t gather_out;
    uint64_t gather_max_out;     /* ECX_GATHER_MAX_OUT (tests lower it) */
    uint32_t gather_max_refused; /* ECX_GATHER_MAX_REFUSED (tests lower it) */
    struct ecx_gbuf *gbufs; /* answers in flight */
    struct ecx_gbuf *gfree; /* full-size buffers kept for reuse */
    uint32_t ngfree;
    uint64_t gbuf_allocs;   /* full-size buffers allocated (tests) */
    ecx_post_t *gtab[ECX_GATHER_BUCKETS];
    ecx_post_t *gretry;
    uint64_t glast;                /* the last gathered READ's id (tests) */
    uint64_t gids[ECX_GATHER_IDS]; /* random ids not handed out yet */
    uint32_t ngids;
    ecx_gather_stats_t gstats;
} ecx_ctx_t;

/* Creation and teardown. */
/* big_segs: UCX tcp segments of ECX_TCP_SEG_BIG both ways, unless
 * UCX_TCP_TX_SEG_SIZE or UCX_TCP_RX_SEG_SIZE is set (c->big_segs says
 * whether they were set). */
int ecx_create(const char *name, uint32_t name_len, int big_segs, ecx_ctx_t **out);
void ecx_destroy(ecx_ctx_t *c);

/* Worker address, copied into buf (caller gives capacity); returns the
 * address length or a negative ucs_status_t. */
int64_t ecx_worker_address(ecx_ctx_t *c, void *buf, size_t cap);

/* Memory. */
int ecx_mem_map(ecx_ctx_t *c, void *addr, size_t len, int allocate,
                ucp_mem_h *memh_out, void **addr_out);
int ecx_mem_unmap(ecx_ctx_t *c, ucp_mem_h memh);
/* The regions gather requests may read: registered memory, added after
 * ecx_mem_map and removed before ecx_mem_unmap. Regions do not overlap. */
int ecx_region_add(ecx_ctx_t *c, uint64_t addr, uint64_t len);
void ecx_region_del(ecx_ctx_t *c, uint64_t addr);
/* Whether an answer sent out of registered memory still reads some of
 * [addr, addr+len): its send has not called back. */
int ecx_region_busy(const ecx_ctx_t *c, uint64_t addr, uint64_t len);
/* The owner's check of a gather request's n ranges (little-endian u64
 * address and length pairs, as the request carries them) asking for bytes
 * in all: 0 to serve it, else the status it is refused with. */
int ecx_gather_check(const ecx_ctx_t *c, const void *ranges, uint32_t n, uint64_t bytes);
/* Tests: what the owner's handler makes of a gather request (header and
 * ranges as they arrive): ECX_GREQ_DROPPED for a header it drops unread,
 * else 0 with the number of answer chunks, the bytes copied into the
 * answers' buffer and the chunks sent from registered memory, or the
 * status it is refused with. */
#define ECX_GREQ_DROPPED 1
int ecx_gather_req_plan(const ecx_ctx_t *c, const void *header, size_t header_length,
                        const void *ranges, size_t length, uint32_t *nch, uint64_t *copied,
                        uint32_t *zc);
/* Tests: hands an answer to the reader's handler as if it had arrived. */
void ecx_gather_inject(ecx_ctx_t *c, const void *header, size_t header_length,
                       const void *data, size_t length);
/* Packs memh's rkey into buf; returns the length or a negative status. */
int64_t ecx_rkey_pack(ecx_ctx_t *c, ucp_mem_h memh, void *buf, size_t cap);

/* Endpoints. peer is an opaque tag reported back on endpoint errors. */
int ecx_ep_create(ecx_ctx_t *c, const void *addr, int peer_mode,
                  uint64_t peer, ucp_ep_h *out, ecx_ep_arg_t **arg_out);
/* Closes ep (force or flush) and, once the close completed, frees arg.
 * Completion is tracked internally. */
void ecx_ep_close(ecx_ctx_t *c, ucp_ep_h ep, ecx_ep_arg_t *arg, int force);
/* Like ecx_ep_close, and destroys the n rkeys of the malloc'ed array rkeys
 * (then frees it) once no operation can use them any more: right away for
 * a forced close, after the flush otherwise. Notifications to ep still
 * waiting for room in the peer's queue are dropped, or with drain (a peer
 * still alive) sent first, the close starting once they are (within
 * ECX_DRAIN_NS, after which the rest are dropped). */
void ecx_ep_close_rkeys(ecx_ctx_t *c, ucp_ep_h ep, ecx_ep_arg_t *arg, int force,
                        ucp_rkey_h *rkeys, uint32_t n, int drain);
#define ECX_DRAIN_NS 5000000000ull
/* How long a removed peer's endpoint that may still be in its wire-up is
 * flushed before it is closed by force (ecx_ep_close_rkeys, force 2). */
#define ECX_WIRE_NS 1000000000ull
void ecx_version(uint32_t *major, uint32_t *minor);
/* 1 if one of ep's lanes runs over a shared-memory transport (sysv or
 * posix), 0 if none does, -1 if it cannot tell. Reads ucp_ep_print_info. */
int ecx_ep_shm_lanes(ucp_ep_h ep);
/* The longest header and payload ep sends an active message of on UCX's
 * short path (ucp_ep_print_info's am_send line); 0 if it cannot tell. */
uint32_t ecx_ep_short_max(ucp_ep_h ep);
int ecx_rkey_unpack(ucp_ep_h ep, const void *buf, ucp_rkey_h *out);
void ecx_rkey_destroy(ucp_rkey_h rkey);
/* Destroys the n rkeys of rkeys and frees arg, leaving the endpoint to
 * ucp_worker_destroy (an endpoint in error mode NONE cannot be force
 * closed). */
void ecx_ep_abandon(ecx_ep_arg_t *arg, ucp_rkey_h *rkeys, uint32_t n);
/* Where remote address raddr of rkey is mapped in this process, for
 * shared-memory rkeys (ucp_rkey_ptr); a negative status otherwise. */
int ecx_rkey_ptr(ucp_rkey_h rkey, uint64_t raddr, void **out);

/* How notifications go to a peer (ecx_post, ecx_send_notif): short_max is
 * 0 or, for an endpoint in error mode NONE, its ecx_ep_short_max: then a
 * notification is only ever sent on UCX's short path, retried from
 * ecx_progress while the peer's queue is full (behind earlier ones to the
 * same dest, the receiving worker), whole when its name and payload fit
 * and in fragments when not and the peer reassembles them (frag); only a
 * longer one to a peer that does not is sent as before. */
typedef struct ecx_notif_to {
    uint32_t short_max;
    int32_t frag;
    uint64_t dest;
} ecx_notif_to_t;

/* Transfers. Posts every range with one call; *out is the post to cancel
 * with ecx_post_cancel (valid until drained or cancelled). Returns 0 or a
 * negative status (then nothing was posted). */
int ecx_post(ecx_ctx_t *c, uint64_t id, ucp_ep_h ep, int op,
             const ecx_range_t *r, uint32_t n, ucp_rkey_h *rkeys,
             const void *notif, uint32_t notif_len, const ecx_notif_to_t *to,
             ecx_post_t **out);
/* Cancels a post: its completion will not be reported. Returns 1 when no
 * UCX operation of it is outstanding (nothing of it will touch memory
 * again), 0 when some are: UCX cannot call gets back, and ecx_drain
 * reports the end of those with ECX_ORPHAN_END in pad. */
int ecx_post_cancel(ecx_ctx_t *c, ecx_post_t *p);
/* Sends a notification outside any transfer (fire and forget). */
int ecx_send_notif(ecx_ctx_t *c, ucp_ep_h ep, const void *msg, uint32_t len,
                   const ecx_notif_to_t *to);

/* Progress: drives the worker until idle (bounded), then advances ready
 * posts and pending endpoint closes. Returns the number of events. */
uint32_t ecx_progress(ecx_ctx_t *c);
/* Copies up to max completions out; returns the count. */
uint32_t ecx_drain(ecx_ctx_t *c, ecx_completion_t *out, uint32_t max);
/* Detaches the notification list (free with ecx_notif_free). */
ecx_notif_t *ecx_notif_take(ecx_ctx_t *c);
void ecx_notif_free(ecx_notif_t *n);
/* Detaches the endpoint error list (free with ecx_err_free). */
ecx_peer_err_t *ecx_err_take(ecx_ctx_t *c);
void ecx_err_free(ecx_peer_err_t *e);

/* Arm: 1 armed, 0 busy (events pending), negative status on error. */
int ecx_tls_has_tcp(const char *tls);
int ecx_devices_have_tcp(const char *devs);
int ecx_arm(ecx_ctx_t *c);

/* ecx_progress and ecx_arm with the context's address as an integer, for
 * the calls a reactor makes in a loop: Go checks every pointer argument
 * of a cgo call for Go memory (the context has pointers, so the check
 * runs), which was a fifth of an idle Progress (BenchmarkProgressIdle:
 * 65 ns, 51 without), and the context is C memory. */
static inline uint32_t ecx_progress_at(uintptr_t c) { return ecx_progress((ecx_ctx_t *)c); }
static inline int ecx_arm_at(uintptr_t c) { return ecx_arm((ecx_ctx_t *)c); }

/* Pending endpoint closes. */
uint32_t ecx_closing(ecx_ctx_t *c);
/* Notifications waiting for room in ep's peer's queue (every peer's for a
 * NULL ep). */
uint32_t ecx_waiting(ecx_ctx_t *c, ucp_ep_h ep);
void *ecx_flush_start(ecx_ctx_t *c);
int ecx_flush_running(void *req);
void ecx_flush_end(void *req);

const char *ecx_status_string(int status);
int ecx_mem_page_touch(void *addr, size_t len);

#endif
