/*
 * See ecx.h. Serialized: the worker is created in UCS_THREAD_MODE_SERIALIZED
 * and every function here runs on the goroutine that drives the Agent at
 * the time (the reactor thread, or a caller the reactor handed the engine
 * to), one at a time, so no locking. UCX callbacks run inside ucp_worker_progress (or inside a
 * forced endpoint close) and only update C state.
 */
#include "ecx.h"

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
    void *reqs[]; /* outstanding UCX requests (NULL once called back) */
};

struct ecx_close {
    ecx_close_t *next;
    void *req;         /* NULL: not started, ep's notifications go first */
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
    free(p);
}

static void ready_push(ecx_post_t *p)
{
    ecx_ctx_t *c = p->ctx;
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
    if (--p->outstanding == 0 && p->next == p->nranges) {
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
    (void)ep;
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

int ecx_create(const char *name, uint32_t name_len, ecx_ctx_t **out)
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
     * UCX_TCP_TX_SEG_SIZE in the environment wins. */
    if (getenv("UCX_TCP_TX_SEG_SIZE") == NULL) {
        st = ucp_config_modify(cfg, "TX_SEG_SIZE", ECX_TCP_TX_SEG);
        if (st != UCS_OK) {
            ucp_config_release(cfg);
            goto err;
        }
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
        free(p);
    }
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

void ecx_ep_close_rkeys(ecx_ctx_t *c, ucp_ep_h ep, ecx_ep_arg_t *arg, int force,
                        ucp_rkey_h *rkeys, uint32_t n, int drain)
{
    ucp_request_param_t prm;
    ucs_status_ptr_t sp;
    ecx_close_t *k;
    ecx_post_t *p, *next;
    if (drain && sending_to(c, ep) && (k = calloc(1, sizeof(*k))) != NULL) {
        /* The peer is alive and reads its queue: its notifications go
         * before the endpoint (reap_closes). */
        k->ep = ep;
        k->force = force;
        k->deadline = mono_ns() + ECX_DRAIN_NS;
        k->arg = arg;
        k->rkeys = rkeys;
        k->nrkeys = n;
        k->next = c->closing;
        c->closing = k;
        return;
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
    k = malloc(sizeof(*k));
    if (k == NULL) {
        /* Cannot track it: UCX releases the request when it completes;
         * the rkeys and arg are abandoned rather than freed too early. */
        ucp_request_free(sp);
        return;
    }
    k->req = sp;
    k->arg = arg;
    k->rkeys = rkeys;
    k->nrkeys = n;
    k->next = c->closing;
    c->closing = k;
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
    ecx_post_t *p;
    while ((p = c->posting) != NULL && c->budget > 0) {
        post_some(p);
        events++;
        if (p->next < p->nranges) {
            break; /* budget spent */
        }
        posting_remove(p);
        if (p->outstanding == 0) {
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

    /* One request slot per range, and one for a write's flush or the
     * notification. */
    p = post_new(c, ep, n, notif, notif_len, to);
    if (p == NULL) {
        return UCS_ERR_NO_MEMORY;
    }
    p->id = id;
    p->phase = PH_DATA;
    p->ranges = r;
    p->rkeys = rkeys;
    p->nranges = n;
    p->op = op;

    post_some(p);
    *out = p;
    c->last_in_rounds = p->next < p->nranges;
    if (p->next < p->nranges) {
        /* The rest goes out in later rounds, after older posts' rests. */
        for (tail = &c->posting; *tail != NULL; tail = &(*tail)->posting_next) {
        }
        *tail = p;
        p->on_posting = 1;
    } else if (p->outstanding == 0) {
        advance(p);
    }
    return UCS_OK;
}

int ecx_post_cancel(ecx_ctx_t *c, ecx_post_t *p)
{
    uint32_t i;
    p->orphaned = 1;
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
           c->err_head != NULL || c->posting != NULL || c->sending != NULL;
}

int ecx_arm(ecx_ctx_t *c)
{
    ucs_status_t st;
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
     * has been read (by an earlier arm). Then nothing watches the interface, and a
     * caller asleep on the descriptor sleeps until its timeout at every
     * later message. So progress until ECX_ARM_QUIET calls in a row find
     * nothing before arming. */
    for (i = 0; i < ECX_ARM_QUIET; i++) {
        if (ucp_worker_progress(c->worker) != 0 || ecx_has_work(c)) {
            return 0;
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
