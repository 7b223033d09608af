/*
 * See ecx.h. Serialized: the worker is created in UCS_THREAD_MODE_SERIALIZED
 * and every function here runs on the goroutine that drives the Agent at
 * the time (the reactor thread, or a caller the reactor handed the engine
 * to), one at a time, so no locking. UCX callbacks run inside ucp_worker_progress (or inside a
 * forced endpoint close) and only update C state.
 */
#include "ecx.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

/* Space reserved by UCX in front of every request we get back: the index of
 * the operation inside its post, so a callback can clear its slot. */
typedef struct ecx_ureq {
    uint32_t idx;
} ecx_ureq_t;

enum { PH_DATA = 0, PH_AM = 1 };

/* A gathered READ at the reader (see ECX_OP_GATHER in ecx.h). Its byte
 * stream is its ranges' bytes in order; request k asks for the stream's
 * bytes [req_at[k], req_at[k+1]), in chunks of chunk bytes, all but the
 * last whole. */
typedef struct ecx_gather {
    uint64_t id;
    uint32_t chunk;              /* bytes per answer */
    struct ecx_post *tab_next;   /* c->gtab chain */
    struct ecx_post *retry_next; /* c->gretry */
    uint64_t total;              /* bytes of the READ */
    uint64_t retry_at;           /* CLOCK_MONOTONIC ns */
    uint32_t nchunks, got;
    uint32_t nreq, sent;         /* requests, those sent so far */
    uint32_t answered;           /* requests fully answered */
    uint8_t waiting;             /* on c->gtab: answers still to come */
    uint8_t on_retry;
    uint64_t *at;     /* nranges + 1 stream offsets of the ranges */
    uint64_t *req_at; /* nreq + 1 stream offsets of the requests */
    uint32_t *req_chunk0; /* nreq + 1: the number of request k's first chunk */
    uint32_t *req_left; /* chunks still to come, per request */
    uint8_t *resend;  /* per request: asked again once retry_at passes */
    uint8_t *bits;    /* per chunk: arrived */
    char *msgs;       /* the requests, each header then ranges */
    uint32_t *msg_at; /* nreq + 1 offsets into msgs */
} ecx_gather_t;

struct ecx_post {
    ecx_post_t *live_next;
    ecx_post_t *live_prev;
    ecx_post_t *q_next; /* ready list or completion queue */
    ecx_ctx_t *ctx;
    uint64_t id;
    ucp_ep_h ep;
    uint32_t outstanding; /* UCX operations that have not called back */
    uint32_t nreqs;       /* slots in reqs: ops, then one for flush/AM */
    int32_t status;       /* first failure */
    uint8_t phase;
    uint8_t orphaned; /* cancelled: its end reported as ECX_ORPHAN_END */
    uint8_t silent;   /* fire-and-forget notification: never reported */
    uint8_t queued;   /* on the completion queue */
    uint8_t on_ready; /* on the ready list */
    uint32_t notif_len;
    char *notif;
    uint8_t imm;        /* the notification goes on the short path only */
    uint64_t dest;      /* its receiver: the worker its endpoint reaches */
    uint8_t on_sending; /* on c->sending */
    uint32_t am_next;   /* its next piece to send (whole: one piece) */
    ecx_post_t *sending_next;
    uint32_t nfrags;    /* the notification goes as this many fragments, */
    uint32_t frag_data; /* of this many bytes of the stream (the last fewer), */
    char *frags;        /* laid out here, ECX_FRAG_HDR + frag_data apart */
    /* Posting in rounds: ranges [next, nranges) are still to be posted.
     * ranges and rkeys belong to Go and stay valid until the post is
     * cancelled, which takes it off the posting list first. */
    ecx_post_t *posting_next;
    const ecx_range_t *ranges;
    ucp_rkey_h *rkeys;
    uint32_t next;
    uint32_t nranges;
    int op;
    uint8_t on_posting;
    ecx_gather_t *g; /* a gathered READ's state (ECX_OP_GATHER), else NULL */
    void *reqs[]; /* outstanding UCX requests (NULL once called back) */
};

/* The answers of one request: their headers, then the bytes. */
typedef struct ecx_gbuf {
    struct ecx_gbuf *next, *prev;
    ecx_ctx_t *ctx;
    uint32_t refs;
    uint64_t bytes;
    uint64_t lo, hi; /* registered memory its sends read (lo >= hi: none) */
    ucp_ep_h ep;     /* the reader's endpoint they go to (compared, never used) */
    int full; /* of ECX_GBUF_FULL bytes of data: may be kept for reuse */
    char data[];
} ecx_gbuf_t;

/* The data of a buffer that holds any request's answers: the headers of
 * every chunk, then the bytes of those copied. */
#define ECX_GBUF_FULL \
    ((size_t)(ECX_GATHER_REQ_BYTES / ECX_GATHER_CHUNK) * ECX_GDATA_HDR + ECX_GATHER_REQ_BYTES)

/* Gathered READs (ECX_OP_GATHER; defined with the posting code below). */
static int data_done(const ecx_post_t *p);
static void gather_stop(ecx_post_t *p);
static void gather_fail(ecx_post_t *p, ucs_status_t st);
static void gather_free(ecx_post_t *p);
static void gather_ep_failed(ecx_ctx_t *c, ucp_ep_h ep, ucs_status_t st);
static ucs_status_t gather_req_cb(void *arg, const void *header, size_t header_length,
                                  void *data, size_t length, const ucp_am_recv_param_t *param);
static ucs_status_t gather_data_cb(void *arg, const void *header, size_t header_length,
                                   void *data, size_t length, const ucp_am_recv_param_t *param);
static uint32_t gather_retries(ecx_ctx_t *c);
static void gather_post_some(ecx_post_t *p);
static ecx_gather_t *gather_new(ecx_ctx_t *c, const ecx_range_t *r, uint32_t n, int big);

struct ecx_close {
    ecx_close_t *next;
    void *req;         /* NULL: not started, ep's notifications go first */
    void *flush;       /* a flush of ep before its forced close (force 2) */
    ucp_ep_h ep;       /* for one not started: */
    int force;
    uint64_t deadline; /* CLOCK_MONOTONIC ns */
    ecx_ep_arg_t *arg; /* freed once the close completed */
    ucp_rkey_h *rkeys; /* destroyed once the close completed */
    uint32_t nrkeys;
};

static void rkeys_free(ucp_rkey_h *rkeys, uint32_t n)
{
    uint32_t i;
    if (rkeys == NULL) {
        return;
    }
    for (i = 0; i < n; i++) {
        if (rkeys[i] != NULL) {
            ucp_rkey_destroy(rkeys[i]);
        }
    }
    free(rkeys);
}

static void put_le32(unsigned char *b, uint32_t v)
{
    b[0] = (unsigned char)v;
    b[1] = (unsigned char)(v >> 8);
    b[2] = (unsigned char)(v >> 16);
    b[3] = (unsigned char)(v >> 24);
}

/* Lays out the nfrags fragments of c's name and notif at dst, data bytes
 * of the stream in each (fewer in the last). */
static void frags_build(ecx_ctx_t *c, char *dst, uint32_t nfrags, uint32_t data,
                        const void *notif, uint32_t notif_len)
{
    uint32_t total = 2 + c->name_len + notif_len, i, at, k, n, part;
    unsigned char len2[2] = {(unsigned char)c->name_len, (unsigned char)(c->name_len >> 8)};
    /* The stream's three pieces, in order. */
    const unsigned char *piece[3] = {len2, (const unsigned char *)c->name, notif};
    uint32_t plen[3] = {2, c->name_len, notif_len};
    uint32_t pi = 0, po = 0; /* where the stream is: piece, offset in it */
    for (i = 0; i < nfrags; i++) {
        unsigned char *f = (unsigned char *)dst + (size_t)i * (ECX_FRAG_HDR + data);
        at = i * data;
        n = total - at < data ? total - at : data;
        put_le32(f, (uint32_t)c->token);
        put_le32(f + 4, (uint32_t)(c->token >> 32));
        put_le32(f + 8, at);
        put_le32(f + 12, total);
        for (k = 0; k < n; k += part) {
            while (po == plen[pi]) {
                pi++;
                po = 0;
            }
            part = plen[pi] - po < n - k ? plen[pi] - po : n - k;
            memcpy(f + ECX_FRAG_HDR + k, piece[pi] + po, part);
            po += part;
        }
    }
}

/* The bytes of the stream each fragment of a notif_len-byte notification
 * of c's carries toward an endpoint whose short path takes short_max
 * bytes: 0 when it goes whole. */
static uint32_t frag_data_of(const ecx_ctx_t *c, uint32_t notif_len, uint32_t short_max, int frag)
{
    uint32_t data;
    if (!frag || short_max < ECX_FRAG_HDR + ECX_FRAG_MIN_DATA ||
        (uint64_t)c->name_len + notif_len <= short_max) {
        return 0;
    }
    data = short_max - ECX_FRAG_HDR;
    return data < ECX_FRAG_MAX_DATA ? data : ECX_FRAG_MAX_DATA;
}

/* Allocates a post with nops request slots for its operations and one for
 * its notification (fragments, sent on the short path only, need none),
 * with its own copy of notif or its fragments, linked on c's live list
 * until post_free; NULL when out of memory. */
static ecx_post_t *post_new(ecx_ctx_t *c, ucp_ep_h ep, uint32_t nops,
                            const void *notif, uint32_t notif_len,
                            const ecx_notif_to_t *to)
{
    uint32_t short_max = to != NULL ? to->short_max : 0;
    int frag = to != NULL && to->frag;
    uint32_t data = frag_data_of(c, notif_len, short_max, frag);
    uint64_t total = 2 + (uint64_t)c->name_len + notif_len;
    uint32_t nfrags = data > 0 ? (uint32_t)((total + data - 1) / data) : 0;
    uint32_t nreqs = nops + 1;
    size_t head = sizeof(ecx_post_t) + (size_t)nreqs * sizeof(void *);
    size_t body = nfrags > 0 ? (size_t)nfrags * (ECX_FRAG_HDR + data) : notif_len;
    ecx_post_t *p = malloc(head + body);
    if (p == NULL) {
        return NULL;
    }
    memset(p, 0, head);
    p->ctx = c;
    p->ep = ep;
    p->nreqs = nreqs;
    p->status = UCS_OK;
    p->notif_len = notif_len;
    p->imm = nfrags > 0 || (short_max > 0 && (uint64_t)c->name_len + notif_len <= short_max);
    p->dest = to != NULL ? to->dest : 0;
    if (nfrags > 0) {
        p->nfrags = nfrags;
        p->frag_data = data;
        p->frags = (char *)&p->reqs[nreqs];
        frags_build(c, p->frags, nfrags, data, notif, notif_len);
    } else {
        p->notif = (char *)&p->reqs[nreqs];
        if (notif_len > 0) {
            memcpy(p->notif, notif, notif_len);
        }
    }
    p->live_next = c->live;
    if (c->live != NULL) {
        c->live->live_prev = p;
    }
    c->live = p;
    c->nlive++;
    return p;
}

static void post_free(ecx_post_t *p)
{
    ecx_ctx_t *c = p->ctx;
    if (p->live_prev != NULL) {
        p->live_prev->live_next = p->live_next;
    } else {
        c->live = p->live_next;
    }
    if (p->live_next != NULL) {
        p->live_next->live_prev = p->live_prev;
    }
    c->nlive--;
    if (p->g != NULL) {
        gather_free(p);
    }
    free(p);
}

/* The ready list and the completion queue share q_next: a post on either
 * is not put on either again (counted in list_faults, which tests check
 * stays 0): twice on one list made it a cycle that ecx_progress walked
 * forever. */
static void ready_push(ecx_post_t *p)
{
    ecx_ctx_t *c = p->ctx;
    if (p->on_ready || p->queued) {
        c->list_faults++;
        return;
    }
    p->on_ready = 1;
    p->q_next = NULL;
    if (c->ready_tail != NULL) {
        c->ready_tail->q_next = p;
    } else {
        c->ready_head = p;
    }
    c->ready_tail = p;
}

static void comp_push(ecx_post_t *p)
{
    ecx_ctx_t *c = p->ctx;
    if (p->on_ready || p->queued) {
        c->list_faults++;
        return;
    }
    p->q_next = NULL;
    p->queued = 1;
    if (c->comp_tail != NULL) {
        c->comp_tail->q_next = p;
    } else {
        c->comp_head = p;
    }
    c->comp_tail = p;
}

static void op_cb(void *request, ucs_status_t status, void *user_data)
{
    ecx_post_t *p = user_data;
    ecx_ureq_t *u = request;
    if (u->idx < p->nreqs) {
        p->reqs[u->idx] = NULL;
    }
    if (status != UCS_OK && p->status == UCS_OK) {
        p->status = status;
    }
    ucp_request_free(request);
    if (status != UCS_OK && p->g != NULL && p->phase == PH_DATA) {
        /* A request that did not go: its answers will not come. */
        gather_stop(p);
    }
    if (--p->outstanding == 0 && data_done(p) && !p->on_posting) {
        ready_push(p);
    }
}

/* Tracks a UCX status pointer returned by an nbx call: NULL means done,
 * an error pointer is recorded, a request is remembered in slot idx. */
static void track(ecx_post_t *p, ucs_status_ptr_t sp, uint32_t idx)
{
    if (sp == NULL) {
        return;
    }
    if (UCS_PTR_IS_ERR(sp)) {
        if (p->status == UCS_OK) {
            p->status = UCS_PTR_STATUS(sp);
        }
        return;
    }
    ((ecx_ureq_t *)sp)->idx = idx;
    p->reqs[idx] = sp;
    p->outstanding++;
}

static ucp_request_param_t op_param(ecx_post_t *p)
{
    ucp_request_param_t prm;
    memset(&prm, 0, sizeof(prm));
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    prm.cb.send = op_cb;
    prm.user_data = p;
    return prm;
}

/* Sends the pieces of p's notification not sent yet (its fragments, or it
 * whole) on UCX's short path only: UCX 1.13 resolves the receiver's
 * endpoint id for any active message it cannot send at once (see
 * ECX_AM_NOTIF_FRAG). Returns 0 while the peer's queue is full (the rest
 * waits on c->sending), 1 once every piece has gone or one failed (in
 * p->status). A piece sent on the short path has completed. */
static int send_pieces(ecx_post_t *p)
{
    ecx_ctx_t *c = p->ctx;
    uint32_t pieces = p->nfrags > 0 ? p->nfrags : 1, n;
    uint32_t total = 2 + c->name_len + p->notif_len;
    ucp_request_param_t prm;
    ucs_status_ptr_t sp;
    memset(&prm, 0, sizeof(prm));
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL;
    prm.flags = UCP_AM_SEND_FLAG_EAGER;
    while (p->am_next < pieces) {
        if (p->nfrags > 0) {
            char *f = p->frags + (size_t)p->am_next * (ECX_FRAG_HDR + p->frag_data);
            n = total - p->am_next * p->frag_data;
            if (n > p->frag_data) {
                n = p->frag_data;
            }
            sp = ucp_am_send_nbx(p->ep, ECX_AM_NOTIF_FRAG, f, ECX_FRAG_HDR, f + ECX_FRAG_HDR, n, &prm);
        } else {
            sp = ucp_am_send_nbx(p->ep, ECX_AM_NOTIF, c->name, c->name_len, p->notif,
                                 p->notif_len, &prm);
        }
        if (UCS_PTR_IS_ERR(sp)) {
            if (UCS_PTR_STATUS(sp) == UCS_ERR_NO_RESOURCE) {
                return 0;
            }
            if (p->status == UCS_OK) {
                p->status = UCS_PTR_STATUS(sp);
            }
            return 1;
        }
        if (sp != NULL) {
            /* Not expected with FORCE_IMM_CMPL; UCX releases it when done. */
            ucp_request_free(sp);
        }
        p->am_next++;
    }
    return 1;
}

/* How many notifications wait over ep, or, for a NULL ep, to the
 * receiver dest; at most max are counted. */
static uint32_t waiting(const ecx_ctx_t *c, ucp_ep_h ep, uint64_t dest, uint32_t max)
{
    const ecx_post_t *p;
    uint32_t n = 0;
    for (p = c->sending; p != NULL && n < max; p = p->sending_next) {
        if (ep != NULL ? p->ep == ep : p->dest == dest) {
            n++;
        }
    }
    return n;
}

static int sending_to(const ecx_ctx_t *c, ucp_ep_h ep)
{
    return waiting(c, ep, 0, 1) > 0;
}

static int sending_dest(const ecx_ctx_t *c, uint64_t dest)
{
    return waiting(c, NULL, dest, 1) > 0;
}

static void sending_append(ecx_post_t *p)
{
    ecx_ctx_t *c = p->ctx;
    p->sending_next = NULL;
    p->on_sending = 1;
    if (c->sending_tail != NULL) {
        c->sending_tail->sending_next = p;
    } else {
        c->sending = p;
    }
    c->sending_tail = p;
}

static void sending_remove(ecx_post_t *p)
{
    ecx_ctx_t *c = p->ctx;
    ecx_post_t **at, *prev = NULL;
    for (at = &c->sending; *at != NULL; prev = *at, at = &(*at)->sending_next) {
        if (*at == p) {
            *at = p->sending_next;
            if (c->sending_tail == p) {
                c->sending_tail = prev;
            }
            break;
        }
    }
    p->on_sending = 0;
}

/* The end of a post whose operations and notification are done. */
static void post_end(ecx_post_t *p)
{
    if (p->silent) {
        post_free(p);
        return;
    }
    comp_push(p);
}

static void send_am(ecx_post_t *p)
{
    ecx_ctx_t *c = p->ctx;
    ucp_request_param_t prm = op_param(p);
    ucs_status_ptr_t sp;
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    /* Eager only: the receiver copies the message inside its handler and
     * never has to fetch rendezvous data. Notifications are size-limited
     * on the Go side. */
    prm.flags = c->send_rndv ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER;
    p->phase = PH_AM;
    if (p->imm) {
        /* Behind notifications to the same receiver still waiting (over
         * this endpoint, or an older one to the same worker), so that none
         * overtakes another and fragments of two never interleave. */
        p->am_next = 0;
        if (sending_dest(c, p->dest) || !send_pieces(p)) {
            sending_append(p);
        }
        return;
    }
    sp = ucp_am_send_nbx(p->ep, ECX_AM_NOTIF, c->name, c->name_len, p->notif,
                         p->notif_len, &prm);
    track(p, sp, p->nreqs - 1);
}

/* Moves a post whose UCX operations have all called back one step on. */
static void advance(ecx_post_t *p)
{
    if (p->orphaned) {
        /* ecx_drain reports its end: Go holds the memory it wrote
         * registered until then. */
        comp_push(p);
        return;
    }
    if (p->phase == PH_DATA && p->status == UCS_OK && p->notif_len > 0) {
        send_am(p);
        if (p->outstanding > 0 || p->on_sending) {
            return;
        }
    }
    post_end(p);
}

/* Queues a copy of a received message for Go (counted as dropped if it
 * cannot be allocated). */
static void notif_queue(ecx_ctx_t *c, const void *header, size_t header_length,
                        const void *data, size_t length, uint32_t frag)
{
    ecx_notif_t *n = malloc(sizeof(*n) + header_length + length);
    if (n == NULL) {
        c->notif_dropped++;
        return;
    }
    n->next = NULL;
    n->hlen = (uint32_t)header_length;
    n->plen = (uint32_t)length;
    n->frag = frag;
    if (header_length > 0) {
        memcpy(n->data, header, header_length);
    }
    if (length > 0) {
        memcpy(n->data + header_length, data, length);
    }
    if (c->notif_tail != NULL) {
        c->notif_tail->next = n;
    } else {
        c->notif_head = n;
    }
    c->notif_tail = n;
}

static ucs_status_t am_cb(void *arg, const void *header, size_t header_length,
                          void *data, size_t length,
                          const ucp_am_recv_param_t *param)
{
    ecx_ctx_t *c = arg;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        /* Senders force eager; a rendezvous message is not ours. */
        c->notif_dropped++;
        return UCS_OK;
    }
    if (header_length > ECX_NOTIF_MAX_NAME || length > ECX_NOTIF_MAX_PAYLOAD) {
        c->notif_dropped++;
        return UCS_OK;
    }
    notif_queue(c, header, header_length, data, length, 0);
    return UCS_OK;
}

/* A fragment is queued as it came; Go reassembles (notif.go). One that is
 * not shaped as a fragment is counted as dropped. */
static ucs_status_t am_frag_cb(void *arg, const void *header, size_t header_length,
                               void *data, size_t length,
                               const ucp_am_recv_param_t *param)
{
    ecx_ctx_t *c = arg;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || header_length != ECX_FRAG_HDR ||
        length == 0 || length > ECX_FRAG_MAX_DATA) {
        c->notif_dropped++;
        return UCS_OK;
    }
    notif_queue(c, header, header_length, data, length, 1);
    return UCS_OK;
}

struct ecx_ep_arg {
    ecx_ctx_t *ctx;
    uint64_t peer;
};

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    ecx_ep_arg_t *a = arg;
    ecx_ctx_t *c = a->ctx;
    ecx_peer_err_t *e;
    gather_ep_failed(c, ep, status);
    e = malloc(sizeof(*e));
    if (e == NULL) {
        return;
    }
    e->next = NULL;
    e->peer = a->peer;
    e->status = status;
    e->pad = 0;
    if (c->err_tail != NULL) {
        c->err_tail->next = e;
    } else {
        c->err_head = e;
    }
    c->err_tail = e;
}

/* Whether context's transports include one for shared memory between
 * processes (posix, sysv, cma, knem, xpmem), read from UCX's own
 * description of the context (its "resource" lines, which UCX_TLS
 * filters): UCX 1.13 has no call that lists them. 1 when it cannot tell
 * (no resource line found), as if shared memory were there. */
static int context_has_shm(ucp_context_h context)
{
    static const char *const shm[] = {"posix/", "sysv/", "cma/", "knem/", "xpmem/"};
    char *text = NULL, *line, *save = NULL;
    size_t len = 0, i;
    int resources = 0, found = 0;
    FILE *f = open_memstream(&text, &len);
    if (f == NULL) {
        return 1;
    }
    ucp_context_print_info(context, f);
    if (fclose(f) != 0 || text == NULL) {
        free(text);
        return 1;
    }
    for (line = strtok_r(text, "\n", &save); line != NULL; line = strtok_r(NULL, "\n", &save)) {
        const char *tl;
        /* "# resource N : md M dev D flags XY tl/device" (XY: two flag
         * characters). */
        if (strstr(line, "resource") == NULL || (tl = strstr(line, "flags ")) == NULL ||
            strlen(tl) < 9) {
            continue;
        }
        resources++;
        tl += 9;
        for (i = 0; i < sizeof(shm) / sizeof(shm[0]); i++) {
            if (strncmp(tl, shm[i], strlen(shm[i])) == 0) {
                found = 1;
            }
        }
    }
    free(text);
    return found || resources == 0;
}

int ecx_create(const char *name, uint32_t name_len, int big_segs, ecx_ctx_t **out)
{
    ucp_params_t params;
    ucp_worker_params_t wp;
    ucp_am_handler_param_t ap;
    ucp_config_t *cfg = NULL;
    ucs_status_t st;
    ecx_ctx_t *c;

    c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return UCS_ERR_NO_MEMORY;
    }
    c->efd = -1;
    c->budget = ECX_TURN_BUDGET;
    c->name = malloc(name_len + 1);
    if (c->name == NULL) {
        free(c);
        return UCS_ERR_NO_MEMORY;
    }
    memcpy(c->name, name, name_len);
    c->name[name_len] = 0;
    c->name_len = name_len;

    /* UCX reads its own UCX_* environment variables here. */
    st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        goto err;
    }
    /* Over tcp UCX emulates a get with messages, and the data owner's
     * reply goes out in TX_SEG_SIZE pieces (8 KiB by default), each its
     * own send: a 32 KiB block took five. With 64 KiB pieces, 32 KiB-block
     * READs between two network namespaces went from 0.8 to 1.5 GB/s and
     * the serving side's CPU per byte halved. The receiving side's buffer
     * (RX_SEG_SIZE) is 64 KiB by default, so peers on UCX's defaults take
     * these pieces. Only tcp has a TX_SEG_SIZE here; a
     * UCX_TCP_TX_SEG_SIZE in the environment wins, and a UCX_TLS that
     * leaves tcp out, or a UCX_NET_DEVICES that names no network
     * interface, leaves the key unset. */
    if (getenv("UCX_TCP_TX_SEG_SIZE") == NULL && ecx_tls_has_tcp(getenv("UCX_TLS")) &&
        ecx_devices_have_tcp(getenv("UCX_NET_DEVICES"))) {
        /* With big_segs, both ways and only when the environment sets
         * neither (see ECX_TCP_SEG_BIG). */
        big_segs = big_segs && getenv("UCX_TCP_RX_SEG_SIZE") == NULL;
        st = ucp_config_modify(cfg, "TX_SEG_SIZE", big_segs ? ECX_TCP_SEG_BIG : ECX_TCP_TX_SEG);
        if (st == UCS_OK && big_segs) {
            st = ucp_config_modify(cfg, "RX_SEG_SIZE", ECX_TCP_SEG_BIG);
        }
        if (st != UCS_OK) {
            ucp_config_release(cfg);
            goto err;
        }
        c->big_segs = big_segs;
    }
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_REQUEST_SIZE |
                        UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.request_size = sizeof(ecx_ureq_t);
    params.mt_workers_shared = 0;
    st = ucp_init(&params, cfg, &c->context);
    ucp_config_release(cfg);
    if (st != UCS_OK) {
        goto err;
    }

    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    st = ucp_worker_create(c->context, &wp, &c->worker);
    if (st != UCS_OK) {
        goto err_ctx;
    }
    st = ucp_worker_get_efd(c->worker, &c->efd);
    if (st != UCS_OK) {
        goto err_worker;
    }

    memset(&ap, 0, sizeof(ap));
    ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    ap.id = ECX_AM_NOTIF;
    ap.flags = UCP_AM_FLAG_WHOLE_MSG;
    ap.cb = am_cb;
    ap.arg = c;
    st = ucp_worker_set_am_recv_handler(c->worker, &ap);
    if (st != UCS_OK) {
        goto err_worker;
    }
    ap.id = ECX_AM_NOTIF_FRAG;
    ap.cb = am_frag_cb;
    st = ucp_worker_set_am_recv_handler(c->worker, &ap);
    if (st != UCS_OK) {
        goto err_worker;
    }
    ap.id = ECX_AM_GATHER_REQ;
    ap.cb = gather_req_cb;
    st = ucp_worker_set_am_recv_handler(c->worker, &ap);
    if (st != UCS_OK) {
        goto err_worker;
    }
    ap.id = ECX_AM_GATHER_DATA;
    ap.cb = gather_data_cb;
    st = ucp_worker_set_am_recv_handler(c->worker, &ap);
    if (st != UCS_OK) {
        goto err_worker;
    }
    c->notif_wait_max = ECX_NOTIF_WAIT_MAX;
    c->gather_max_out = ECX_GATHER_MAX_OUT;
    c->gather_max_refused = ECX_GATHER_MAX_REFUSED;
    c->shm = context_has_shm(c->context);
    if (getrandom(&c->token, sizeof(c->token), GRND_NONBLOCK) != (ssize_t)sizeof(c->token)) {
        /* Tells this sender's fragments from other senders' at a receiver:
         * unique enough without the entropy pool. */
        c->token = (uint64_t)getpid() << 32 ^ (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)c;
    }
    *out = c;
    return UCS_OK;

err_worker:
    ucp_worker_destroy(c->worker);
err_ctx:
    ucp_cleanup(c->context);
err:
    free(c->name);
    free(c);
    return st;
}

uint32_t ecx_waiting(ecx_ctx_t *c, ucp_ep_h ep)
{
    const ecx_post_t *p;
    uint32_t n = 0;
    if (ep != NULL) {
        return waiting(c, ep, 0, UINT32_MAX);
    }
    for (p = c->sending; p != NULL; p = p->sending_next) {
        n++;
    }
    return n;
}

uint32_t ecx_closing(ecx_ctx_t *c)
{
    uint32_t n = 0;
    ecx_close_t *k;
    for (k = c->closing; k != NULL; k = k->next) {
        n++;
    }
    return n;
}

/* Starts a flush of every endpoint of the worker: it ends once every
 * operation issued before it has completed, sends included (out of UCX's
 * own buffers). NULL when it ended at once or could not start. */
void *ecx_flush_start(ecx_ctx_t *c)
{
    ucp_request_param_t prm;
    ucs_status_ptr_t sp;
    memset(&prm, 0, sizeof(prm));
    sp = ucp_worker_flush_nbx(c->worker, &prm);
    if (sp == NULL || UCS_PTR_IS_ERR(sp)) {
        return NULL;
    }
    return sp;
}

/* 1 while the flush ecx_flush_start started runs. */
int ecx_flush_running(void *req)
{
    return ucp_request_check_status(req) == UCS_INPROGRESS;
}

/* Lets go of the flush; UCX frees a running one when it ends or when the
 * worker goes. */
void ecx_flush_end(void *req)
{
    ucp_request_free(req);
}

/* Whether a UCX_TLS value lets UCX open its tcp transport: unset or empty,
 * a list naming tcp or all, or a "^" list that does not name tcp. A key
 * set for a transport UCX does not open makes it print an "invalid
 * configuration" warning for every agent. */
int ecx_tls_has_tcp(const char *tls)
{
    const char *p, *e;
    size_t n;
    int exclude, named = 0;
    if (tls == NULL || *tls == 0) {
        return 1;
    }
    exclude = *tls == '^';
    for (p = tls + exclude; *p != 0; p = *e != 0 ? e + 1 : e) {
        e = strchr(p, ',');
        if (e == NULL) {
            e = p + strlen(p);
        }
        n = (size_t)(e - p);
        if ((n == 3 && strncmp(p, "tcp", 3) == 0) ||
            (!exclude && n == 3 && strncmp(p, "all", 3) == 0)) {
            named = 1;
        }
    }
    return exclude ? !named : named;
}

/* Whether a UCX_NET_DEVICES value leaves UCX's tcp transport a device:
 * unset or empty, all, or a list with a name that is not an RDMA port
 * ("mlx5_0:1"); tcp's devices are network interfaces, whose names UCX
 * lists without a port. */
int ecx_devices_have_tcp(const char *devs)
{
    const char *p, *e, *colon;
    if (devs == NULL || *devs == 0) {
        return 1;
    }
    for (p = devs; *p != 0; p = *e != 0 ? e + 1 : e) {
        e = strchr(p, ',');
        if (e == NULL) {
            e = p + strlen(p);
        }
        if (e == p) {
            continue;
        }
        if ((e - p == 3 && strncmp(p, "all", 3) == 0)) {
            return 1;
        }
        colon = memchr(p, ':', (size_t)(e - p));
        if (colon == NULL) {
            return 1;
        }
    }
    return 0;
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint32_t reap_closes(ecx_ctx_t *c)
{
    ecx_close_t **pp = &c->closing, *k;
    uint32_t n = 0;
    while ((k = *pp) != NULL) {
        if (k->flush != NULL) {
            if (ucp_request_check_status(k->flush) == UCS_INPROGRESS && mono_ns() < k->deadline) {
                pp = &k->next;
                continue;
            }
            /* Flushed (its wire-up is over), or waited long enough. */
            ucp_request_free(k->flush);
            *pp = k->next;
            ecx_ep_close_rkeys(c, k->ep, k->arg, 1, k->rkeys, k->nrkeys, 0);
            free(k);
            n++;
            continue;
        }
        if (k->req == NULL) {
            if (sending_to(c, k->ep) && mono_ns() < k->deadline) {
                pp = &k->next;
                continue;
            }
            /* Its notifications have gone (or waited long enough): close
             * it now, tracked anew if it does not close at once. */
            *pp = k->next;
            ecx_ep_close_rkeys(c, k->ep, k->arg, k->force, k->rkeys, k->nrkeys, 0);
            free(k);
            n++;
            continue;
        }
        if (ucp_request_check_status(k->req) != UCS_INPROGRESS) {
            ucp_request_free(k->req);
            *pp = k->next;
            rkeys_free(k->rkeys, k->nrkeys);
            free(k->arg);
            free(k);
            n++;
        } else {
            pp = &k->next;
        }
    }
    return n;
}

void ecx_destroy(ecx_ctx_t *c)
{
    ecx_close_t *k;
    ecx_post_t *p;
    ecx_notif_t *n;
    ecx_peer_err_t *e;

    /* Closes that never completed (a peer that stopped answering) are
     * abandoned: their requests are released to the worker, and rkeys go
     * before the worker that owns their memory. */
    for (k = c->closing; k != NULL; k = k->next) {
        if (k->req != NULL) {
            ucp_request_free(k->req);
        }
        if (k->flush != NULL) {
            ucp_request_free(k->flush);
        }
        rkeys_free(k->rkeys, k->nrkeys);
        k->rkeys = NULL;
    }
    ucp_worker_destroy(c->worker);
    while ((k = c->closing) != NULL) {
        c->closing = k->next;
        free(k->arg);
        free(k);
    }
    ucp_cleanup(c->context);
    /* Posts whose operations never called back (a dead peer's emulated
     * gets) die with the worker. */
    while ((p = c->live) != NULL) {
        c->live = p->live_next;
        free(p->g);
        free(p);
    }
    /* Answers whose sends never called back went with the worker. */
    while (c->gbufs != NULL) {
        ecx_gbuf_t *b = c->gbufs;
        c->gbufs = b->next;
        free(b);
    }
    while (c->gfree != NULL) {
        ecx_gbuf_t *b = c->gfree;
        c->gfree = b->next;
        free(b);
    }
    free(c->regions);
    while ((n = c->notif_head) != NULL) {
        c->notif_head = n->next;
        free(n);
    }
    while ((e = c->err_head) != NULL) {
        c->err_head = e->next;
        free(e);
    }
    free(c->name);
    free(c);
}

int64_t ecx_worker_address(ecx_ctx_t *c, void *buf, size_t cap)
{
    ucp_address_t *a;
    size_t len;
    ucs_status_t st = ucp_worker_get_address(c->worker, &a, &len);
    if (st != UCS_OK) {
        return st;
    }
    if (len > cap) {
        ucp_worker_release_address(c->worker, a);
        return UCS_ERR_BUFFER_TOO_SMALL;
    }
    memcpy(buf, a, len);
    ucp_worker_release_address(c->worker, a);
    return (int64_t)len;
}

int ecx_mem_page_touch(void *addr, size_t len)
{
    long pg = sysconf(_SC_PAGESIZE);
    volatile char *b = addr;
    size_t i;
    if (pg <= 0) {
        pg = 4096;
    }
    for (i = 0; i < len; i += (size_t)pg) {
        b[i] = b[i];
    }
    if (len > 0) {
        b[len - 1] = b[len - 1];
    }
    return 0;
}

int ecx_mem_map(ecx_ctx_t *c, void *addr, size_t len, int allocate,
                ucp_mem_h *memh_out, void **addr_out)
{
    ucp_mem_map_params_t mp;
    ucp_mem_attr_t attr;
    ucs_status_t st;
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = allocate ? NULL : addr;
    mp.length = len;
    mp.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
    st = ucp_mem_map(c->context, &mp, memh_out);
    if (st != UCS_OK) {
        return st;
    }
    memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    st = ucp_mem_query(*memh_out, &attr);
    if (st != UCS_OK) {
        ucp_mem_unmap(c->context, *memh_out);
        return st;
    }
    if (attr.length < len) {
        ucp_mem_unmap(c->context, *memh_out);
        return UCS_ERR_NO_MEMORY;
    }
    *addr_out = attr.address;
    if (allocate) {
        /* The first remote touch of a page costs a fault; take it now. */
        ecx_mem_page_touch(attr.address, len);
    }
    return UCS_OK;
}

int ecx_mem_unmap(ecx_ctx_t *c, ucp_mem_h memh)
{
    return ucp_mem_unmap(c->context, memh);
}

int64_t ecx_rkey_pack(ecx_ctx_t *c, ucp_mem_h memh, void *buf, size_t cap)
{
    void *rb;
    size_t len;
    ucs_status_t st = ucp_rkey_pack(c->context, memh, &rb, &len);
    if (st != UCS_OK) {
        return st;
    }
    if (len > cap) {
        ucp_rkey_buffer_release(rb);
        return UCS_ERR_BUFFER_TOO_SMALL;
    }
    memcpy(buf, rb, len);
    ucp_rkey_buffer_release(rb);
    return (int64_t)len;
}

int ecx_ep_create(ecx_ctx_t *c, const void *addr, int peer_mode, uint64_t peer,
                  ucp_ep_h *out, ecx_ep_arg_t **arg_out)
{
    ucp_ep_params_t ep;
    ucs_status_t st;
    ecx_ep_arg_t *a = NULL;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = addr;
    if (peer_mode) {
        a = calloc(1, sizeof(*a));
        if (a == NULL) {
            return UCS_ERR_NO_MEMORY;
        }
        a->ctx = c;
        a->peer = peer;
        ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep.err_handler.cb = ep_err_cb;
        ep.err_handler.arg = a;
    } else {
        ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    }
    st = ucp_ep_create(c->worker, &ep, out);
    if (st != UCS_OK) {
        free(a);
        return st;
    }
    *arg_out = a;
    return UCS_OK;
}

/* Puts a close of ep on the closing list for reap_closes, with what it
 * frees once the close has completed (NULL if it cannot be allocated). */
static ecx_close_t *close_track(ecx_ctx_t *c, ucp_ep_h ep, ecx_ep_arg_t *arg,
                                ucp_rkey_h *rkeys, uint32_t n)
{
    ecx_close_t *k = calloc(1, sizeof(*k));
    if (k == NULL) {
        return NULL;
    }
    k->ep = ep;
    k->arg = arg;
    k->rkeys = rkeys;
    k->nrkeys = n;
    k->next = c->closing;
    c->closing = k;
    return k;
}

void ecx_ep_close_rkeys(ecx_ctx_t *c, ucp_ep_h ep, ecx_ep_arg_t *arg, int force,
                        ucp_rkey_h *rkeys, uint32_t n, int drain)
{
    ucp_request_param_t prm;
    ucs_status_ptr_t sp;
    ecx_close_t *k;
    ecx_post_t *p, *next;
    if (drain && sending_to(c, ep) && (k = close_track(c, ep, arg, rkeys, n)) != NULL) {
        /* The peer is alive and reads its queue: its notifications go
         * before the endpoint (reap_closes). */
        k->force = force;
        k->deadline = mono_ns() + ECX_DRAIN_NS;
        return;
    }
    if (force == 2) {
        /* Error mode PEER and nothing of the endpoint completed yet: flush
         * it first, so that its wire-up ends before it is forced (see
         * closeEp), within ECX_WIRE_NS. */
        memset(&prm, 0, sizeof(prm));
        sp = ucp_ep_flush_nbx(ep, &prm);
        force = 1;
        if (sp != NULL && !UCS_PTR_IS_ERR(sp)) {
            if ((k = close_track(c, ep, arg, rkeys, n)) == NULL) {
                ucp_request_free(sp);
            } else {
                k->force = 1;
                k->flush = sp;
                k->deadline = mono_ns() + ECX_WIRE_NS;
                return;
            }
        }
    }
    /* Notifications still waiting for room in the peer's queue go with
     * the endpoint (Go has cancelled its transfers' posts already). */
    for (p = c->sending; p != NULL; p = next) {
        next = p->sending_next;
        if (p->ep == ep) {
            sending_remove(p);
            if (p->status == UCS_OK) {
                p->status = UCS_ERR_CANCELED;
            }
            c->notif_undelivered++;
            post_end(p);
        }
    }
    memset(&prm, 0, sizeof(prm));
    if (force) {
        prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
    }
    sp = ucp_ep_close_nbx(ep, &prm);
    if (force) {
        /* A forced close completed every outstanding operation (cancelled)
         * before returning: nothing can use the rkeys any more. */
        rkeys_free(rkeys, n);
        rkeys = NULL;
    }
    if (sp == NULL || UCS_PTR_IS_ERR(sp)) {
        rkeys_free(rkeys, n);
        free(arg);
        return;
    }
    k = close_track(c, ep, arg, rkeys, n);
    if (k == NULL) {
        /* Cannot track it: UCX releases the request when it completes;
         * the rkeys and arg are abandoned rather than freed too early. */
        ucp_request_free(sp);
        return;
    }
    k->req = sp;
}

void ecx_ep_abandon(ecx_ep_arg_t *arg, ucp_rkey_h *rkeys, uint32_t n)
{
    rkeys_free(rkeys, n);
    free(arg);
}

void ecx_ep_close(ecx_ctx_t *c, ucp_ep_h ep, ecx_ep_arg_t *arg, int force)
{
    ecx_ep_close_rkeys(c, ep, arg, force, NULL, 0, 0);
}

void ecx_version(uint32_t *major, uint32_t *minor)
{
    unsigned ma, mi, rel;
    ucp_get_version(&ma, &mi, &rel);
    *major = ma;
    *minor = mi;
}

/* ucp_ep_print_info's text, malloc'ed; NULL if it cannot be had. */
static char *ep_info(ucp_ep_h ep)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (f == NULL) {
        return NULL;
    }
    ucp_ep_print_info(ep, f);
    if (fclose(f) != 0) {
        free(buf);
        return NULL;
    }
    return buf;
}

int ecx_ep_shm_lanes(ucp_ep_h ep)
{
    char *buf = ep_info(ep);
    int shm;
    if (buf == NULL) {
        return -1;
    }
    shm = strstr(buf, "sysv/") != NULL || strstr(buf, "posix/") != NULL;
    free(buf);
    return shm;
}

uint32_t ecx_ep_short_max(ucp_ep_h ep)
{
    /* "am_send: 0..<egr/short>..93..<egr/bcopy>..": short below 93. */
    static const char key[] = "am_send: 0..<egr/short>..";
    char *buf = ep_info(ep), *at, *end;
    unsigned long n = 0;
    if (buf == NULL) {
        return 0;
    }
    at = strstr(buf, key);
    if (at != NULL) {
        at += sizeof(key) - 1;
        n = strtoul(at, &end, 10);
        if (end == at || strncmp(end, "..", 2) != 0 || n > 1u << 20) {
            n = 0;
        }
    }
    free(buf);
    return n > 0 ? (uint32_t)(n - 1) : 0;
}

int ecx_rkey_unpack(ucp_ep_h ep, const void *buf, ucp_rkey_h *out)
{
    return ucp_ep_rkey_unpack(ep, buf, out);
}

int ecx_rkey_ptr(ucp_rkey_h rkey, uint64_t raddr, void **out)
{
    return ucp_rkey_ptr(rkey, raddr, out);
}

void ecx_rkey_destroy(ucp_rkey_h rkey)
{
    ucp_rkey_destroy(rkey);
}

/* ------------------------------------------------------ gathered READs */

static void put_le64(unsigned char *b, uint64_t v)
{
    put_le32(b, (uint32_t)v);
    put_le32(b + 4, (uint32_t)(v >> 32));
}

static uint32_t get_le32(const unsigned char *b)
{
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

static uint64_t get_le64(const unsigned char *b)
{
    return (uint64_t)get_le32(b) | (uint64_t)get_le32(b + 4) << 32;
}

/* Whether p's data phase is over: every range (every request) posted and,
 * for a gathered READ, no answer awaited. */
static int data_done(const ecx_post_t *p)
{
    return p->next == p->nranges && (p->g == NULL || !p->g->waiting);
}

static ecx_post_t **gtab_slot(ecx_ctx_t *c, uint64_t id)
{
    return &c->gtab[(id ^ id >> 17) & (ECX_GATHER_BUCKETS - 1)];
}

static ecx_post_t *gtab_find(ecx_ctx_t *c, uint64_t id)
{
    ecx_post_t *p;
    for (p = *gtab_slot(c, id); p != NULL; p = p->g->tab_next) {
        if (p->g->id == id) {
            return p;
        }
    }
    return NULL;
}

static void gtab_remove(ecx_post_t *p)
{
    ecx_post_t **pp;
    for (pp = gtab_slot(p->ctx, p->g->id); *pp != NULL; pp = &(*pp)->g->tab_next) {
        if (*pp == p) {
            *pp = p->g->tab_next;
            break;
        }
    }
    p->g->tab_next = NULL;
}

static void gretry_remove(ecx_post_t *p)
{
    ecx_post_t **pp;
    for (pp = &p->ctx->gretry; *pp != NULL; pp = &(*pp)->g->retry_next) {
        if (*pp == p) {
            *pp = p->g->retry_next;
            break;
        }
    }
    p->g->retry_next = NULL;
    p->g->on_retry = 0;
}

/* No more answers are awaited for p (it failed, was cancelled, or every
 * answer arrived) and nothing more of it is asked for: answers that still
 * come find no READ and are dropped. Posting stops (post_rounds takes it
 * off the posting list). */
static void gather_stop(ecx_post_t *p)
{
    ecx_gather_t *g = p->g;
    if (g->waiting) {
        gtab_remove(p);
        g->waiting = 0;
    }
    if (g->on_retry) {
        gretry_remove(p);
    }
    if (p->next < p->nranges) {
        p->next = p->nranges;
    }
}

/* Ends p's wait for answers with st, and moves it on if nothing of it is
 * outstanding. */
static void gather_fail(ecx_post_t *p, ucs_status_t st)
{
    if (!p->g->waiting && p->next == p->nranges) {
        return; /* already over */
    }
    if (p->status == UCS_OK) {
        p->status = st;
    }
    gather_stop(p);
    if (p->outstanding == 0 && !p->on_posting) {
        ready_push(p);
    }
}

static void gather_free(ecx_post_t *p)
{
    gather_stop(p);
    free(p->g);
    p->g = NULL;
}

/* Builds the requests of a READ of n ranges into g (NULL: counts only).
 * Returns the number of requests; *pieces gets the ranges of all requests
 * (a range split between two requests counts twice), *total the bytes. */
static uint32_t gather_plan(const ecx_range_t *r, uint32_t n, uint32_t chunk, ecx_gather_t *g,
                            uint64_t id, uint64_t *pieces, uint64_t *total)
{
    /* Requests end on a chunk boundary, so each starts its chunks where
     * the one before ended. */
    const uint64_t cap = ECX_GATHER_REQ_BYTES / chunk * chunk;
    uint32_t i = 0, k = 0, kr = 0;
    uint64_t in = 0, kb = 0, at = 0, np = 0, chunk0 = 0;
    unsigned char *hdr = NULL, *rp = NULL;
    uint32_t mpos = 0;
    while (i < n && r[i].len == 0) {
        i++;
    }
    while (i < n) {
        uint64_t take = r[i].len - in;
        if (take > cap - kb) {
            take = cap - kb;
        }
        if (g != NULL) {
            if (kr == 0) {
                g->msg_at[k] = mpos;
                g->req_at[k] = at;
                hdr = (unsigned char *)g->msgs + mpos;
                rp = hdr + ECX_GREQ_HDR;
            }
            put_le64(rp, r[i].remote + in);
            put_le64(rp + 8, take);
            rp += 16;
        }
        kb += take;
        kr++;
        np++;
        at += take;
        in += take;
        if (in == r[i].len) {
            in = 0;
            do {
                i++;
            } while (i < n && r[i].len == 0);
        }
        if (kb == cap || kr == ECX_GATHER_REQ_RANGES || i == n) {
            if (g != NULL) {
                uint32_t nch = (uint32_t)((kb + chunk - 1) / chunk);
                put_le64(hdr, id);
                put_le64(hdr + 8, g->req_at[k]);
                put_le32(hdr + 16, kr);
                /* 0 to an owner that takes no other size. */
                put_le32(hdr + 20, chunk == ECX_GATHER_CHUNK ? 0 : chunk);
                put_le64(hdr + 24, kb);
                mpos += ECX_GREQ_HDR + kr * 16u;
                g->req_chunk0[k] = (uint32_t)chunk0;
                g->req_left[k] = nch;
                chunk0 += nch;
            }
            k++;
            kb = 0;
            kr = 0;
        }
    }
    if (g != NULL) {
        g->msg_at[k] = mpos;
        g->req_at[k] = at;
        g->req_chunk0[k] = (uint32_t)chunk0;
    }
    *pieces = np;
    *total = at;
    return k;
}

/* A new gathered READ's id, which its requests carry and the owner's
 * answers echo. Answers are matched to a READ by it alone, whichever
 * endpoint they come in on, so it is random: a peer that sees the ids of
 * READs from itself cannot name one from another peer and write into it
 * or fail it (with ids in sequence it could). Never 0, never that of a
 * READ still waiting; 0 when the kernel gives no random bytes. */
static uint64_t gather_id(ecx_ctx_t *c)
{
    for (;;) {
        uint64_t id;
        if (c->ngids == 0) {
            /* At most 256 bytes: never cut short once the pool is up. */
            ssize_t got = getrandom(c->gids, sizeof(c->gids), 0);
            if (got != (ssize_t)sizeof(c->gids)) {
                if (got < 0 && errno == EINTR) {
                    continue;
                }
                return 0;
            }
            c->ngids = ECX_GATHER_IDS;
        }
        id = c->gids[--c->ngids];
        if (id != 0 && gtab_find(c, id) == NULL) {
            c->glast = id;
            return id;
        }
    }
}

/* Allocates and fills p's gather state for its n ranges: one block. With
 * big, its answers come in chunks of ECX_GATHER_CHUNK_BIG. NULL when out
 * of memory or random ids. */
static ecx_gather_t *gather_new(ecx_ctx_t *c, const ecx_range_t *r, uint32_t n, int big)
{
    uint64_t pieces, total, nchunks = 0;
    uint32_t chunk = c->test_gather_chunk ? c->test_gather_chunk
                     : big                ? ECX_GATHER_CHUNK_BIG
                                          : ECX_GATHER_CHUNK;
    uint32_t nreq = gather_plan(r, n, chunk, NULL, 0, &pieces, &total), k;
    size_t sz, off;
    ecx_gather_t *g;
    char *m;
    /* Chunks: at most one partial per request. */
    nchunks = total / chunk + nreq;
    if (nreq == 0 || nchunks > UINT32_MAX || (uint64_t)nreq * ECX_GREQ_HDR + pieces * 16 > UINT32_MAX) {
        return NULL;
    }
    off = sizeof(*g);
    sz = off + (size_t)(n + 1) * 8             /* at */
         + (size_t)(nreq + 1) * 8              /* req_at */
         + (size_t)(nreq + 1) * 4 * 3          /* req_chunk0, req_left, msg_at */
         + (size_t)nreq                        /* resend */
         + (size_t)nchunks                     /* bits */
         + (size_t)nreq * ECX_GREQ_HDR + (size_t)pieces * 16 + 8;
    m = calloc(1, sz);
    if (m == NULL) {
        return NULL;
    }
    g = (ecx_gather_t *)m;
    g->id = gather_id(c);
    if (g->id == 0) {
        free(m);
        return NULL;
    }
    g->at = (uint64_t *)(m + off);
    off += (size_t)(n + 1) * 8;
    g->req_at = (uint64_t *)(m + off);
    off += (size_t)(nreq + 1) * 8;
    g->req_chunk0 = (uint32_t *)(m + off);
    off += (size_t)(nreq + 1) * 4;
    g->req_left = (uint32_t *)(m + off);
    off += (size_t)(nreq + 1) * 4;
    g->msg_at = (uint32_t *)(m + off);
    off += (size_t)(nreq + 1) * 4;
    g->resend = (uint8_t *)(m + off);
    off += nreq;
    g->bits = (uint8_t *)(m + off);
    off += nchunks;
    g->msgs = m + off;
    g->chunk = chunk;
    g->nreq = nreq;
    g->total = total;
    g->at[0] = 0;
    for (k = 0; k < n; k++) {
        g->at[k + 1] = g->at[k] + r[k].len;
    }
    gather_plan(r, n, chunk, g, g->id, &pieces, &total);
    g->nchunks = g->req_chunk0[nreq];
    return g;
}

/* Sends request k of p (ECX_AM_GATHER_REQ), its request slot k. */
static void gather_send(ecx_post_t *p, uint32_t k)
{
    ecx_gather_t *g = p->g;
    ucp_request_param_t prm = op_param(p);
    ucs_status_ptr_t sp;
    char *hdr = g->msgs + g->msg_at[k];
    size_t len = g->msg_at[k + 1] - g->msg_at[k] - ECX_GREQ_HDR;
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    /* Eager: the owner reads the ranges inside its handler. */
    prm.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
    sp = ucp_am_send_nbx(p->ep, ECX_AM_GATHER_REQ, hdr, ECX_GREQ_HDR, hdr + ECX_GREQ_HDR, len, &prm);
    track(p, sp, k);
    if (p->ctx->test_fail_sends) {
        gather_ep_failed(p->ctx, p->ep, UCS_ERR_CONNECTION_RESET);
    }
}

/* Sends p's requests while its window has room; once all are sent (or one
 * failed) its posting is over (p->next == p->nranges). */
static void gather_post_some(ecx_post_t *p)
{
    ecx_gather_t *g = p->g;
    while (p->status == UCS_OK && g->sent < g->nreq && g->sent - g->answered < ECX_GATHER_WINDOW) {
        gather_send(p, g->sent);
        g->sent++;
    }
    if (p->status != UCS_OK) {
        gather_stop(p);
    } else if (g->sent == g->nreq) {
        p->next = p->nranges;
    }
}

/* Asks again for the requests the owner refused as busy, once their time
 * has come. */
static uint32_t gather_retries(ecx_ctx_t *c)
{
    ecx_post_t *p, *next;
    uint64_t now = 0;
    uint32_t n = 0, k;
    int left;
    for (p = c->gretry; p != NULL; p = next) {
        ecx_gather_t *g = p->g;
        next = g->retry_next;
        if (now == 0) {
            now = mono_ns();
        }
        if (now < g->retry_at) {
            continue;
        }
        left = 0;
        for (k = 0; k < g->sent && p->status == UCS_OK; k++) {
            if (!g->resend[k]) {
                continue;
            }
            if (p->reqs[k] != NULL) {
                left = 1; /* its first send has not called back yet */
                continue;
            }
            g->resend[k] = 0;
            c->gstats.retries++;
            gather_send(p, k);
            n++;
        }
        if (p->status != UCS_OK) {
            gather_fail(p, p->status);
        } else if (!left) {
            gretry_remove(p);
        }
    }
    return n;
}

/* Where stream offset off falls among the n+1 ascending offsets at: the
 * index i with at[i] <= off < at[i+1]; n if none. */
static uint32_t offset_index(const uint64_t *at, uint32_t n, uint64_t off)
{
    uint32_t lo = 0, hi = n;
    if (n == 0 || off < at[0] || off >= at[n]) {
        return n;
    }
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (at[mid] <= off) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

/* An answer: bytes of a gathered READ, or a refusal. Copies the bytes to
 * the READ's local ranges. Answers that name no waiting READ (it was
 * released) are dropped; answers that do not fit the READ fail it. */
static ucs_status_t gather_data_cb(void *arg, const void *header, size_t header_length,
                                   void *data, size_t length,
                                   const ucp_am_recv_param_t *param)
{
    ecx_ctx_t *c = arg;
    const unsigned char *h = header;
    ecx_post_t *p;
    ecx_gather_t *g;
    uint64_t id, off, end, at;
    int32_t st;
    uint32_t n, k, idx, i;
    const char *src = data;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || header_length != ECX_GDATA_HDR) {
        c->gstats.bad++;
        return UCS_OK;
    }
    id = get_le64(h);
    off = get_le64(h + 8);
    st = (int32_t)get_le32(h + 16);
    n = get_le32(h + 20);
    p = gtab_find(c, id);
    if (p == NULL) {
        c->gstats.late++;
        return UCS_OK;
    }
    g = p->g;
    k = offset_index(g->req_at, g->sent, off);
    if (k == g->sent) {
        c->gstats.bad++;
        gather_fail(p, UCS_ERR_MESSAGE_TRUNCATED);
        return UCS_OK;
    }
    if (st != UCS_OK) {
        if (st == UCS_ERR_NO_RESOURCE && off == g->req_at[k] &&
            g->req_left[k] == g->req_chunk0[k + 1] - g->req_chunk0[k] && !g->resend[k]) {
            /* Busy: ask again shortly. */
            g->resend[k] = 1;
            g->retry_at = mono_ns() + ECX_GATHER_RETRY_NS;
            if (!g->on_retry) {
                g->on_retry = 1;
                g->retry_next = c->gretry;
                c->gretry = p;
            }
            return UCS_OK;
        }
        /* The owner refuses with what its check says (gather_req_cb);
         * any other status is the peer's word alone and must not pass for
         * one of this side's (a canceled READ, a connection reset that
         * takes the peer for dead): refused, no more. */
        gather_fail(p, st == UCS_ERR_INVALID_PARAM || st == UCS_ERR_INVALID_ADDR ? (ucs_status_t)st
                                                                                 : UCS_ERR_REJECTED);
        return UCS_OK;
    }
    end = g->req_at[k + 1];
    if ((off - g->req_at[k]) % g->chunk != 0 || n != length ||
        n != (end - off < g->chunk ? end - off : g->chunk)) {
        c->gstats.bad++;
        gather_fail(p, UCS_ERR_MESSAGE_TRUNCATED);
        return UCS_OK;
    }
    idx = g->req_chunk0[k] + (uint32_t)((off - g->req_at[k]) / g->chunk);
    if (g->bits[idx]) {
        c->gstats.bad++; /* a duplicate: the bytes are there */
        return UCS_OK;
    }
    /* The bytes go to the local ranges the stream's [off, off+n) maps to. */
    i = offset_index(g->at, p->nranges, off);
    for (at = off; at < off + n; i++) {
        uint64_t in = at - g->at[i], m = g->at[i + 1] - at;
        if (m > off + n - at) {
            m = off + n - at;
        }
        memcpy((void *)(uintptr_t)(p->ranges[i].local + in), src + (at - off), m);
        at += m;
    }
    g->bits[idx] = 1;
    g->got++;
    if (--g->req_left[k] == 0) {
        g->answered++;
    }
    if (g->got == g->nchunks) {
        gather_stop(p);
        if (p->outstanding == 0 && !p->on_posting) {
            ready_push(p);
        }
    }
    return UCS_OK;
}

/* The reader's endpoint ep failed: its gathered READs get no more answers. */
static void gather_ep_failed(ecx_ctx_t *c, ucp_ep_h ep, ucs_status_t st)
{
    uint32_t b;
    ecx_post_t *p, *next;
    for (b = 0; b < ECX_GATHER_BUCKETS; b++) {
        for (p = c->gtab[b]; p != NULL; p = next) {
            next = p->g->tab_next;
            if (p->ep == ep) {
                gather_fail(p, st);
            }
        }
    }
}

/* ------------------------------------------------- gathers, owner's side */


/* A buffer of at least size bytes for answers of bytes bytes, copied of
 * them. Those that copy ECX_GBUF_KEEP_MIN bytes or more are full-size,
 * taken from the kept ones when there are; smaller ones (a few blocks,
 * answers sent out of registered memory, a refusal's header) are
 * allocated as they come, which the C allocator serves from memory it
 * keeps anyway. */
static ecx_gbuf_t *gbuf_new(ecx_ctx_t *c, ucp_ep_h ep, size_t size, uint64_t bytes, uint64_t copied)
{
    ecx_gbuf_t *b;
    int full = copied >= ECX_GBUF_KEEP_MIN && size <= ECX_GBUF_FULL;
    if (full && c->gfree != NULL) {
        b = c->gfree;
        c->gfree = b->next;
        c->ngfree--;
    } else {
        b = malloc(sizeof(*b) + (full ? ECX_GBUF_FULL : size));
        if (b == NULL) {
            return NULL;
        }
        c->gbuf_allocs += (uint64_t)full;
    }
    b->full = full;
    b->ctx = c;
    b->refs = 1;
    b->bytes = bytes;
    b->lo = UINT64_MAX;
    b->hi = 0;
    b->ep = ep;
    b->prev = NULL;
    b->next = c->gbufs;
    if (c->gbufs != NULL) {
        c->gbufs->prev = b;
    }
    c->gbufs = b;
    c->gather_out += bytes;
    return b;
}

static void gbuf_unref(ecx_gbuf_t *b)
{
    ecx_ctx_t *c = b->ctx;
    if (--b->refs > 0) {
        return;
    }
    if (b->prev != NULL) {
        b->prev->next = b->next;
    } else {
        c->gbufs = b->next;
    }
    if (b->next != NULL) {
        b->next->prev = b->prev;
    }
    c->gather_out -= b->bytes;
    if (b->full && c->ngfree < ECX_GBUF_CACHE) {
        b->next = c->gfree;
        c->gfree = b;
        c->ngfree++;
        return;
    }
    free(b);
}

int ecx_region_busy(const ecx_ctx_t *c, uint64_t addr, uint64_t len)
{
    const ecx_gbuf_t *b;
    for (b = c->gbufs; b != NULL; b = b->next) {
        if (b->lo < b->hi && b->lo < addr + len && addr < b->hi) {
            return 1;
        }
    }
    return 0;
}

static void gsend_cb(void *request, ucs_status_t status, void *user_data)
{
    (void)status;
    ucp_request_free(request);
    gbuf_unref(user_data);
}

/* Sends one answer of b (which it holds a reference of while the send
 * runs): n bytes at bytes. They go on UCX's short path, as a 60 KiB
 * answer fits a 64 KiB tcp segment (a 252 KiB one, asked for only with
 * big segments, one of ECX_TCP_SEG_BIG): UCX hands them to the socket at once
 * and copies what the socket did not take, or, while the endpoint is
 * busy, keeps the request and reads them when it sends it. Never UCX's
 * zero-copy path: UCX 1.13's tcp transport completes a zero-copy send
 * twice, and aborts, when the socket fails in the middle of it (a
 * reader that went away). 0 once the send failed. */
static int gather_answer(ecx_gbuf_t *b, ucp_ep_h ep, const void *hdr, const void *bytes, size_t n)
{
    ucp_request_param_t prm;
    ucs_status_ptr_t sp;
    memset(&prm, 0, sizeof(prm));
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_FLAGS;
    prm.cb.send = gsend_cb;
    prm.user_data = b;
    prm.flags = UCP_AM_SEND_FLAG_EAGER;
    sp = ucp_am_send_nbx(ep, ECX_AM_GATHER_DATA, hdr, ECX_GDATA_HDR, bytes, n, &prm);
    if (UCS_PTR_IS_ERR(sp)) {
        return 0;
    }
    if (sp != NULL) {
        b->refs++;
    }
    return 1;
}

/* What reader ep has in flight here: bytes of answers, and refusals. The
 * list holds only buffers whose sends UCX still keeps, a few dozen with
 * the bounds below. */
static void gather_reader(const ecx_ctx_t *c, ucp_ep_h ep, uint64_t *bytes, uint32_t *refused)
{
    const ecx_gbuf_t *b;
    *bytes = 0;
    *refused = 0;
    for (b = c->gbufs; b != NULL; b = b->next) {
        if (b->ep == ep) {
            *bytes += b->bytes;
            *refused += b->bytes == 0;
        }
    }
}

/* A refusal of the request at off of READ id. */
static void gather_refuse(ecx_ctx_t *c, ucp_ep_h ep, uint64_t id, uint64_t off, ucs_status_t st)
{
    ecx_gbuf_t *b = gbuf_new(c, ep, ECX_GDATA_HDR, 0, 0);
    unsigned char *h;
    if (b == NULL) {
        c->gstats.dropped++;
        return;
    }
    h = (unsigned char *)b->data;
    put_le64(h, id);
    put_le64(h + 8, off);
    put_le32(h + 16, (uint32_t)(int32_t)st);
    put_le32(h + 20, 0);
    gather_answer(b, ep, h, NULL, 0);
    gbuf_unref(b);
}

/* Whether [addr, addr+len) lies in one registered region. */
static int region_covers(const ecx_ctx_t *c, uint64_t addr, uint64_t len)
{
    uint32_t lo = 0, hi = c->nregions;
    const ecx_region_t *r;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (c->regions[mid].addr <= addr) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if (lo == 0) {
        return 0;
    }
    r = &c->regions[lo - 1];
    return addr - r->addr <= r->len && len <= r->len - (addr - r->addr);
}

/* The owner's check of a request's n ranges (little-endian address and
 * length pairs) asking for bytes in all: UCS_OK, or why it is refused. */
static int gather_check(const ecx_ctx_t *c, const unsigned char *rp, uint32_t n, uint64_t bytes)
{
    uint64_t sum = 0;
    uint32_t i;
    if (n == 0 || n > ECX_GATHER_REQ_RANGES || bytes == 0 || bytes > ECX_GATHER_REQ_BYTES) {
        return UCS_ERR_INVALID_PARAM;
    }
    for (i = 0; i < n; i++) {
        uint64_t a = get_le64(rp + (size_t)i * 16), l = get_le64(rp + (size_t)i * 16 + 8);
        if (l == 0 || l > bytes - sum) {
            return UCS_ERR_INVALID_PARAM;
        }
        if (!region_covers(c, a, l)) {
            return UCS_ERR_INVALID_ADDR;
        }
        sum += l;
    }
    return sum == bytes ? UCS_OK : UCS_ERR_INVALID_PARAM;
}

int ecx_gather_check(const ecx_ctx_t *c, const void *ranges, uint32_t n, uint64_t bytes)
{
    return gather_check(c, ranges, n, bytes);
}

void ecx_gather_inject(ecx_ctx_t *c, const void *header, size_t header_length,
                       const void *data, size_t length)
{
    ucp_am_recv_param_t prm;
    memset(&prm, 0, sizeof(prm));
    gather_data_cb(c, header, header_length, (void *)data, length, &prm);
}

/* A place in a request's ranges, in the order of the bytes it asks for. */
typedef struct ecx_gcur {
    const unsigned char *rp;
    uint32_t i;   /* the range */
    uint64_t off; /* bytes of it passed */
} ecx_gcur_t;

/* Moves k over the next len bytes (which the ranges hold: gather_check
 * saw them add up) and returns in how many pieces of the owner's memory
 * they lie (ranges that follow each other there, as the reader's cuts of
 * a long one at 1 MiB do, are one piece); with to it copies the bytes
 * there. */
static uint32_t gcur_take(ecx_gcur_t *k, uint64_t len, char *to)
{
    uint32_t np = 0;
    uint64_t end = 0;
    while (len > 0) {
        uint64_t a = get_le64(k->rp + (size_t)k->i * 16), l = get_le64(k->rp + (size_t)k->i * 16 + 8);
        uint64_t take = l - k->off < len ? l - k->off : len;
        if (to != NULL) {
            memcpy(to, (const void *)(uintptr_t)(a + k->off), take);
            to += take;
        }
        np += np == 0 || a + k->off != end;
        end = a + k->off + take;
        len -= take;
        k->off += take;
        if (k->off == l) {
            k->i++;
            k->off = 0;
        }
    }
    return np;
}

/* Where the next bytes of k lie in the owner's memory. */
static uint64_t gcur_addr(const ecx_gcur_t *k)
{
    return get_le64(k->rp + (size_t)k->i * 16) + k->off;
}

/* Chunk j's length in a request of bytes bytes in chunks of size. */
static uint32_t chunk_len(uint64_t bytes, uint32_t size, uint32_t j)
{
    uint64_t at = (uint64_t)j * size;
    return (uint32_t)(bytes - at < size ? bytes - at : size);
}

/* Reads a request's header (ECX_GREQ_HDR bytes at h) and checks it and
 * its ranges (length bytes at rp): UCS_OK to serve it, else the status it
 * is refused with. */
static int gather_req_read(const ecx_ctx_t *c, const unsigned char *h, const unsigned char *rp,
                           size_t length, uint64_t *id, uint64_t *base, uint32_t *n,
                           uint32_t *size, uint64_t *bytes)
{
    *id = get_le64(h);
    *base = get_le64(h + 8);
    *n = get_le32(h + 16);
    *size = get_le32(h + 20);
    *bytes = get_le64(h + 24);
    if (*size == 0) {
        *size = ECX_GATHER_CHUNK;
    }
    /* The big size only with big segments: in UCX's 64 KiB ones such an
     * answer would go on its zero-copy path (see gather_answer). */
    if (length != (size_t)*n * 16 ||
        (*size != ECX_GATHER_CHUNK && (*size != ECX_GATHER_CHUNK_BIG || !c->big_segs))) {
        return UCS_ERR_INVALID_PARAM;
    }
    return gather_check(c, rp, *n, *bytes);
}

/* The chunks of a checked request of bytes bytes in chunks of size:
 * returns how many, with in *copied the bytes of those that lie in more
 * than one piece of the owner's memory (they are copied into the answers'
 * buffer) and, with zc, in *zc how many lie in one (sent from where they
 * are). */
static uint32_t answer_plan(const unsigned char *rp, uint64_t bytes, uint32_t size,
                            uint64_t *copied, uint32_t *zc)
{
    uint32_t nch = (uint32_t)((bytes + size - 1) / size), j;
    ecx_gcur_t k;
    k.rp = rp;
    k.i = 0;
    k.off = 0;
    *copied = 0;
    if (zc != NULL) {
        *zc = 0;
    }
    for (j = 0; j < nch; j++) {
        if (gcur_take(&k, chunk_len(bytes, size, j), NULL) > 1) {
            *copied += chunk_len(bytes, size, j);
        } else if (zc != NULL) {
            (*zc)++;
        }
    }
    return nch;
}

int ecx_gather_req_plan(const ecx_ctx_t *c, const void *header, size_t header_length,
                        const void *ranges, size_t length, uint32_t *nch, uint64_t *copied,
                        uint32_t *zc)
{
    uint64_t id, base, bytes;
    uint32_t n, size;
    int st;
    if (header_length != ECX_GREQ_HDR) {
        return ECX_GREQ_DROPPED;
    }
    st = gather_req_read(c, header, ranges, length, &id, &base, &n, &size, &bytes);
    if (st == UCS_OK) {
        *nch = answer_plan(ranges, bytes, size, copied, zc);
    }
    return st;
}

/* A request: checked against this agent's registered memory, then
 * answered from inside the handler, in chunks of the size it names. A
 * chunk whose bytes lie in one piece
 * of the registered memory (every chunk of a contiguous READ, most of one
 * of large blocks) is sent out of that memory itself; a chunk of several
 * pieces is copied once into the answers' buffer first (UCX's vectors go
 * on its zero-copy path, see gather_answer). A send UCX keeps for later
 * reads the memory until it calls back: DeregisterMem waits for those
 * (ecx_region_busy). Nothing of the request or the reply endpoint is kept
 * after the handler returns: UCX may destroy an endpoint it created for
 * a peer that failed, and the sends' callbacks hold only the buffer. */
static ucs_status_t gather_req_cb(void *arg, const void *header, size_t header_length,
                                  void *data, size_t length,
                                  const ucp_am_recv_param_t *param)
{
    ecx_ctx_t *c = arg;
    const unsigned char *h = header, *rp = data;
    uint64_t id, base, bytes, copied = 0;
    uint32_t n, nch, j, size;
    ucp_ep_h ep;
    ecx_gbuf_t *b;
    ecx_gcur_t k;
    uint64_t rbytes;
    uint32_t rrefused;
    unsigned char *hdrs;
    char *body;
    int st;
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || param->reply_ep == NULL ||
        (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || header_length != ECX_GREQ_HDR) {
        c->gstats.dropped++;
        return UCS_OK;
    }
    ep = param->reply_ep;
    gather_reader(c, ep, &rbytes, &rrefused);
    if (rrefused >= c->gather_max_refused) {
        /* A reader with that many refusals still unsent has stopped
         * taking what it is sent (an honest one asks again only once a
         * refusal has come), and each one more would pile up here: its
         * request goes unanswered, and its READ waits until its timeout
         * or release. */
        c->gstats.dropped++;
        return UCS_OK;
    }
    st = gather_req_read(c, h, rp, length, &id, &base, &n, &size, &bytes);
    if (st != UCS_OK) {
        c->gstats.refused++;
        gather_refuse(c, ep, id, base, st);
        return UCS_OK;
    }
    if ((rbytes > 0 && (c->gather_out + bytes > c->gather_max_out ||
                        rbytes + bytes > c->gather_max_out / 2)) ||
        (rbytes == 0 && c->gather_out > 0 && c->gather_out + bytes > 2 * c->gather_max_out)) {
        /* Busy: every reader's answers fill the bound, or this reader's
         * fill half of it (one that stopped taking its answers must not
         * hold the owner for everyone). A reader with nothing in flight
         * here is served past the bound, up to twice it: two readers that
         * stopped could otherwise fill it between them and starve every
         * other one; a reader that takes its answers always gets back to
         * nothing in flight, so it moves on, a request at a time. A
         * request alone is always served: a bound below one request
         * (tests) must not starve it. */
        c->gstats.busy++;
        gather_refuse(c, ep, id, base, UCS_ERR_NO_RESOURCE);
        return UCS_OK;
    }
    /* The room the buffer needs for the chunks that are copied. */
    nch = answer_plan(rp, bytes, size, &copied, NULL);
    b = gbuf_new(c, ep, (size_t)nch * ECX_GDATA_HDR + copied, bytes, copied);
    if (b == NULL) {
        c->gstats.dropped++;
        return UCS_OK;
    }
    hdrs = (unsigned char *)b->data;
    body = b->data + (size_t)nch * ECX_GDATA_HDR;
    k.rp = rp;
    k.i = 0;
    k.off = 0;
    for (j = 0; j < nch; j++) {
        unsigned char *hj = hdrs + (size_t)j * ECX_GDATA_HDR;
        uint32_t len = chunk_len(bytes, size, j);
        ecx_gcur_t at = k;
        int ok;
        put_le64(hj, id);
        put_le64(hj + 8, base + (uint64_t)j * size);
        put_le32(hj + 16, 0);
        put_le32(hj + 20, len);
        if (gcur_take(&at, len, NULL) == 1) {
            uint64_t from = gcur_addr(&k);
            gcur_take(&k, len, NULL);
            b->lo = from < b->lo ? from : b->lo;
            b->hi = from + len > b->hi ? from + len : b->hi;
            ok = gather_answer(b, ep, hj, (const void *)(uintptr_t)from, len);
            c->gstats.zc_chunks++;
        } else {
            gcur_take(&k, len, body);
            ok = gather_answer(b, ep, hj, body, len);
            body += len;
            c->gstats.copy_chunks++;
        }
        if (!ok) {
            /* The reader's endpoint failed: the rest would fail too. */
            c->gstats.dropped++;
            break;
        }
    }
    c->gstats.served++;
    gbuf_unref(b);
    return UCS_OK;
}

static int region_cmp(const void *x, const void *y)
{
    const ecx_region_t *a = x, *b = y;
    return a->addr < b->addr ? -1 : a->addr > b->addr;
}

int ecx_region_add(ecx_ctx_t *c, uint64_t addr, uint64_t len)
{
    if (c->nregions == c->capregions) {
        uint32_t cap = c->capregions ? 2 * c->capregions : 16;
        ecx_region_t *r = realloc(c->regions, (size_t)cap * sizeof(*r));
        if (r == NULL) {
            return UCS_ERR_NO_MEMORY;
        }
        c->regions = r;
        c->capregions = cap;
    }
    c->regions[c->nregions].addr = addr;
    c->regions[c->nregions].len = len;
    c->nregions++;
    qsort(c->regions, c->nregions, sizeof(*c->regions), region_cmp);
    return UCS_OK;
}

void ecx_region_del(ecx_ctx_t *c, uint64_t addr)
{
    uint32_t i;
    for (i = 0; i < c->nregions; i++) {
        if (c->regions[i].addr == addr) {
            memmove(&c->regions[i], &c->regions[i + 1], (size_t)(c->nregions - i - 1) * sizeof(*c->regions));
            c->nregions--;
            return;
        }
    }
}

/* Posts p's ranges from p->next on while this round's byte budget lasts,
 * at least one; after the last one of a write, the flush. An error stops
 * the posting: the post then completes once its outstanding operations
 * have called back. */
static void post_some(ecx_post_t *p)
{
    ecx_ctx_t *c = p->ctx;
    ucp_request_param_t prm = op_param(p);
    const ecx_range_t *r = p->ranges;
    ucs_status_ptr_t sp;
    uint32_t i = p->next, first = p->next;

    for (; i < p->nranges && p->status == UCS_OK; i++) {
        if (i > first && r[i].len > c->budget) {
            break;
        }
        c->budget -= r[i].len < c->budget ? r[i].len : c->budget;
        if (p->op == ECX_OP_READ) {
            sp = ucp_get_nbx(p->ep, (void *)(uintptr_t)r[i].local, r[i].len,
                             r[i].remote, p->rkeys[r[i].rkey], &prm);
        } else {
            sp = ucp_put_nbx(p->ep, (const void *)(uintptr_t)r[i].local, r[i].len,
                             r[i].remote, p->rkeys[r[i].rkey], &prm);
        }
        track(p, sp, i);
    }
    p->next = p->status == UCS_OK ? i : p->nranges;
    /* A get has landed when it calls back. A put has only left the local
     * buffer: the flush makes it remote-complete. */
    if (p->next == p->nranges && p->op == ECX_OP_WRITE && p->status == UCS_OK) {
        sp = ucp_ep_flush_nbx(p->ep, &prm);
        track(p, sp, p->nranges);
    }
}

static void posting_remove(ecx_post_t *p)
{
    ecx_post_t **pp;
    for (pp = &p->ctx->posting; *pp != NULL; pp = &(*pp)->posting_next) {
        if (*pp == p) {
            *pp = p->posting_next;
            break;
        }
    }
    p->posting_next = NULL;
    p->on_posting = 0;
}

/* Continues the posts that still have ranges to post, oldest first, while
 * the round's budget lasts. */
static uint32_t post_rounds(ecx_ctx_t *c)
{
    uint32_t events = 0;
    ecx_post_t **pp = &c->posting, *p;
    while ((p = *pp) != NULL && c->budget > 0) {
        if (p->g != NULL) {
            /* A gathered READ asks as its window allows, and one whose
             * window is full does not hold up the posts behind it. */
            if (p->next < p->nranges) {
                gather_post_some(p);
                events++;
            }
            if (p->next < p->nranges) {
                pp = &p->posting_next;
                continue;
            }
        } else {
            post_some(p);
            events++;
            if (p->next < p->nranges) {
                break; /* budget spent */
            }
        }
        *pp = p->posting_next;
        p->posting_next = NULL;
        p->on_posting = 0;
        if (p->outstanding == 0 && data_done(p)) {
            ready_push(p);
        }
    }
    return events;
}

int ecx_post(ecx_ctx_t *c, uint64_t id, ucp_ep_h ep, int op,
             const ecx_range_t *r, uint32_t n, ucp_rkey_h *rkeys,
             const void *notif, uint32_t notif_len, const ecx_notif_to_t *to,
             ecx_post_t **out)
{
    ecx_post_t *p, **tail;
    ecx_gather_t *g = NULL;
    uint32_t nops = n;

    if (op == ECX_OP_GATHER || op == ECX_OP_GATHER_BIG) {
        uint32_t i;
        int big = op == ECX_OP_GATHER_BIG;
        op = ECX_OP_GATHER;
        for (i = 0; i < n && r[i].len == 0; i++) {
        }
        if (i == n) {
            op = ECX_OP_READ; /* no byte to ask for: nothing to gather */
        } else {
            /* One request slot per gather request. */
            g = gather_new(c, r, n, big);
            if (g == NULL) {
                return UCS_ERR_NO_MEMORY;
            }
            nops = g->nreq;
        }
    }
    /* One request slot per range, and one for a write's flush or the
     * notification. */
    p = post_new(c, ep, nops, notif, notif_len, to);
    if (p == NULL) {
        free(g);
        return UCS_ERR_NO_MEMORY;
    }
    p->id = id;
    p->phase = PH_DATA;
    p->ranges = r;
    p->rkeys = rkeys;
    p->nranges = n;
    p->op = op;

    if (g != NULL) {
        ecx_post_t **slot = gtab_slot(c, g->id);
        p->g = g;
        g->tab_next = *slot;
        *slot = p;
        g->waiting = 1;
    }
    /* While its first operations go out, p is this function's: UCX may
     * fail the endpoint inside a send and call back for it (the error
     * callback ends a gathered READ's wait: gather_ep_failed), and a
     * callback that put p on the ready list had it moved on twice, from
     * there and below (a producer that died as the READ was posted). */
    p->on_posting = 1;
    if (g != NULL) {
        gather_post_some(p);
    } else {
        post_some(p);
    }
    p->on_posting = 0;
    *out = p;
    c->last_in_rounds = p->next < p->nranges;
    if (p->next < p->nranges) {
        /* The rest goes out in later rounds, after older posts' rests. */
        for (tail = &c->posting; *tail != NULL; tail = &(*tail)->posting_next) {
        }
        *tail = p;
        p->on_posting = 1;
    } else if (p->outstanding == 0 && data_done(p)) {
        advance(p);
    }
    return UCS_OK;
}

int ecx_post_cancel(ecx_ctx_t *c, ecx_post_t *p)
{
    uint32_t i;
    p->orphaned = 1;
    if (p->g != NULL && p->phase == PH_DATA && (p->g->waiting || p->next < p->nranges)) {
        /* A gathered READ still waiting for answers: they find no READ
         * from now on, and nothing writes its memory any more. */
        gather_stop(p);
        if (!p->on_posting && p->outstanding == 0) {
            /* On no list: its requests have called back. */
            post_free(p);
            return 1;
        }
    }
    if (p->on_sending) {
        /* Its operations are done; its notification is not sent (a part
         * of its fragments may be: the receiver drops those). */
        sending_remove(p);
        post_free(p);
        return 1;
    }
    if (p->on_posting) {
        /* Not all posted: post no more (its ranges and rkeys may go once
         * this returns). Quiet, it is on no list: free it now. */
        posting_remove(p);
        p->next = p->nranges;
        if (p->outstanding == 0) {
            post_free(p);
            return 1;
        }
    }
    if (p->queued || p->outstanding == 0) {
        /* Queued: freed by ecx_drain. Quiet: on the ready list, freed by
         * ecx_drain after advance. Either way nothing is outstanding. */
        return 1;
    }
    for (i = 0; i < p->nreqs; i++) {
        if (p->reqs[i] != NULL) {
            ucp_request_cancel(c->worker, p->reqs[i]);
        }
    }
    /* A request UCX completed inside the cancel is on the ready list now,
     * and reported as an orphan's end like any other. */
    return 0;
}

int ecx_send_notif(ecx_ctx_t *c, ucp_ep_h ep, const void *msg, uint32_t len,
                   const ecx_notif_to_t *to)
{
    ecx_post_t *p;
    int st;
    p = post_new(c, ep, 0, msg, len, to);
    if (p == NULL) {
        return UCS_ERR_NO_MEMORY;
    }
    if (c->sending != NULL &&
        waiting(c, NULL, p->dest, c->notif_wait_max) >= c->notif_wait_max) {
        /* Its receiver has that many waiting already (see
         * ECX_NOTIF_WAIT_MAX). */
        post_free(p);
        return UCS_ERR_NO_RESOURCE;
    }
    p->silent = 1;
    send_am(p);
    if (p->outstanding == 0 && !p->on_sending) {
        st = p->status;
        post_free(p);
        return st;
    }
    return UCS_OK;
}

/* 1 if a notification to p's peer waits before p (past send_waiting's
 * record of blocked peers). */
static int waiting_before(const ecx_ctx_t *c, const ecx_post_t *p)
{
    const ecx_post_t *q;
    for (q = c->sending; q != p; q = q->sending_next) {
        if (q->dest == p->dest) {
            return 1;
        }
    }
    return 0;
}

/* Sends the notifications waiting for room in their peers' queues, each
 * peer's in order: the first to a peer that still finds none holds back
 * that peer's later ones, not other peers'. Returns how many went. */
static uint32_t send_waiting(ecx_ctx_t *c)
{
    enum { MAX_BLOCKED = 16 };
    uint64_t blocked[MAX_BLOCKED];
    uint32_t nblocked = 0, i, sent = 0;
    ecx_post_t **pp = &c->sending, *p, *prev = NULL;
    while ((p = *pp) != NULL) {
        for (i = 0; i < nblocked && blocked[i] != p->dest; i++) {
        }
        if (i == nblocked && (nblocked < MAX_BLOCKED || !waiting_before(c, p))) {
            if (send_pieces(p)) {
                *pp = p->sending_next;
                if (c->sending_tail == p) {
                    c->sending_tail = prev;
                }
                p->on_sending = 0;
                post_end(p);
                sent++;
                continue;
            }
            if (nblocked < MAX_BLOCKED) {
                blocked[nblocked++] = p->dest;
            }
        }
        prev = p;
        pp = &p->sending_next;
    }
    return sent;
}

uint32_t ecx_progress(ecx_ctx_t *c)
{
    uint32_t events = 0, k, i;
    ecx_post_t *p;
    c->budget = ECX_TURN_BUDGET;
    if (c->gretry != NULL) {
        events += gather_retries(c);
    }
    if (c->posting != NULL) {
        events += post_rounds(c);
    }
    for (i = 0; i < 64; i++) {
        k = ucp_worker_progress(c->worker);
        if (k == 0) {
            break;
        }
        events += k;
        if (c->notif_head != NULL) {
            /* Hand the notification to the reactor now. Over tcp one
             * progress call of a producer that serves gets can move
             * megabytes (every get is a reply it sends); 63 more of them
             * kept notifications from their readers for tens of ms. */
            break;
        }
    }
    events += send_waiting(c);
    /* advance may put a post back in flight (its notification), whose
     * callback lands on the ready list during a later progress call. */
    while ((p = c->ready_head) != NULL) {
        p->on_ready = 0;
        c->ready_head = p->q_next;
        if (c->ready_head == NULL) {
            c->ready_tail = NULL;
        }
        advance(p);
        events++;
    }
    if (c->closing != NULL) {
        events += reap_closes(c);
    }
    return events;
}

uint32_t ecx_drain(ecx_ctx_t *c, ecx_completion_t *out, uint32_t max)
{
    uint32_t n = 0;
    ecx_post_t *p;
    while (n < max && (p = c->comp_head) != NULL) {
        c->comp_head = p->q_next;
        if (c->comp_head == NULL) {
            c->comp_tail = NULL;
        }
        out[n].id = p->id;
        out[n].status = p->status;
        out[n].pad = p->orphaned ? ECX_ORPHAN_END : 0;
        n++;
        post_free(p);
    }
    return n;
}

ecx_notif_t *ecx_notif_take(ecx_ctx_t *c)
{
    ecx_notif_t *n = c->notif_head;
    c->notif_head = NULL;
    c->notif_tail = NULL;
    return n;
}

void ecx_notif_free(ecx_notif_t *n)
{
    ecx_notif_t *next;
    for (; n != NULL; n = next) {
        next = n->next;
        free(n);
    }
}

ecx_peer_err_t *ecx_err_take(ecx_ctx_t *c)
{
    ecx_peer_err_t *e = c->err_head;
    c->err_head = NULL;
    c->err_tail = NULL;
    return e;
}

void ecx_err_free(ecx_peer_err_t *e)
{
    ecx_peer_err_t *next;
    for (; e != NULL; e = next) {
        next = e->next;
        free(e);
    }
}

static int ecx_has_work(const ecx_ctx_t *c)
{
    return c->ready_head != NULL || c->comp_head != NULL || c->notif_head != NULL ||
           c->err_head != NULL || c->posting != NULL || c->sending != NULL ||
           c->gretry != NULL;
}

int ecx_arm(ecx_ctx_t *c)
{
    ucs_status_t st;
    uint64_t since = 0;
    int i;
    if (ecx_has_work(c)) {
        return 0;
    }
    /* UCP leaves an interface that none of this worker's endpoints uses
     * (a producer's shared-memory or tcp interface, when it has no
     * endpoint to its consumers) "deactivated": not polled, not in the
     * worker's event descriptor. A message on it wakes UCX's async thread,
     * which turns its own watch of the interface off, signals the worker
     * and leaves the re-arming to a callback that ucp_worker_progress
     * runs. The call after the one that handles the message consumes the
     * interface's wake-up datagram and stays registered (progress returns
     * 0); only the next one arms the interface. ucp_worker_arm does not
     * look at the callback: it returns OK once the async thread's signal
     * has been read (by an earlier arm). Then nothing watches the
     * interface, and a caller asleep on the descriptor sleeps until its
     * timeout at every later message. So progress until ECX_ARM_QUIET
     * calls in a row find nothing before arming.
     *
     * The callback also stays registered, its calls returning 0, while a
     * sender has claimed the next slot of the shared-memory queue but not
     * yet marked it written: it cannot arm the interface (the queue's head
     * moved) and finds no message to handle. The sender's wake-up
     * datagram then goes to a socket nobody watches. Three idle calls can
     * take less time than a sender on another core needs between those two
     * stores, so the calls must also find nothing for ECX_ARM_QUIET_NS. A
     * sender descheduled between them for longer can still go unseen
     * until the sleeper's timeout. */
    for (i = 0;; i++) {
        if (ucp_worker_progress(c->worker) != 0 || ecx_has_work(c)) {
            return 0;
        }
        if (i + 1 < ECX_ARM_QUIET) {
            continue;
        }
        if (since == 0) {
            since = mono_ns();
        } else if (mono_ns() - since >= ECX_ARM_QUIET_NS) {
            break;
        }
    }
    st = ucp_worker_arm(c->worker);
    if (st == UCS_OK) {
        return 1;
    }
    if (st == UCS_ERR_BUSY) {
        return 0;
    }
    return st;
}

const char *ecx_status_string(int status)
{
    return ucs_status_string((ucs_status_t)status);
}
