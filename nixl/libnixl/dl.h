/*
 * dl: loads libecxnixl.so at run time and calls it through pointers, so
 * package libnixl links against nothing but libdl.
 */
#ifndef ECXFER_LIBNIXL_DL_H
#define ECXFER_LIBNIXL_DL_H

#include <stddef.h>
#include <stdint.h>
#include "ecxnixl.h"

/* Why ecx_dl_open failed. */
enum {
    ECX_DL_OK = 0,
    ECX_DL_OPEN = 1,   /* dlopen failed (missing file, not a library, ...) */
    ECX_DL_SYMBOL = 2, /* a symbol of the ABI is missing */
    ECX_DL_ABI = 3,    /* the library speaks another ABI version */
    ECX_DL_NIXL = 4    /* the NIXL underneath is not the release the shim is for */
};

typedef struct ecx_dl {
    void *handle;
    uint32_t (*abi_version)(void);
    int32_t (*check_nixl)(char *, size_t, char *, size_t);
    int32_t (*agent_create)(const char *, size_t, const char *, size_t, ecxnixl_agent **, char *,
                            size_t);
    void (*agent_destroy)(ecxnixl_agent *);
    int32_t (*mem_register)(ecxnixl_agent *, uint64_t, uint64_t, uint64_t);
    int32_t (*mem_deregister)(ecxnixl_agent *, uint64_t, uint64_t, uint64_t);
    int32_t (*local_md)(ecxnixl_agent *, void *, size_t, size_t *);
    int32_t (*load_md)(ecxnixl_agent *, const void *, size_t, char *, size_t, size_t *);
    int32_t (*invalidate)(ecxnixl_agent *, const char *, size_t);
    int32_t (*prep_dlist)(ecxnixl_agent *, const char *, size_t, const uint64_t *,
                          const uint64_t *, const uint64_t *, size_t, ecxnixl_dlist **);
    int32_t (*release_dlist)(ecxnixl_agent *, ecxnixl_dlist *);
    int32_t (*post)(ecxnixl_agent *, int32_t, ecxnixl_dlist *, const int32_t *, ecxnixl_dlist *,
                    const int32_t *, size_t, const void *, size_t, ecxnixl_req **);
    int32_t (*status)(ecxnixl_agent *, ecxnixl_req *const *, int32_t *, size_t);
    int32_t (*release_req)(ecxnixl_agent *, ecxnixl_req *);
    int32_t (*notifs)(ecxnixl_agent *, void *, size_t, size_t, size_t, size_t *, size_t *,
                      uint64_t *);
    int32_t (*send_notif)(ecxnixl_agent *, const char *, size_t, const void *, size_t);
} ecx_dl_t;

/*
 * Opens path and resolves every symbol of the ABI, then has the library
 * check the NIXL release under it. On failure returns NULL, sets *why and
 * writes a message into err (NUL-terminated, at most cap bytes). A library
 * that dlopen loaded is never closed, whichever check it fails after: by
 * then it has brought in what it links (NIXL's C++ libraries, the wheel's
 * UCX) and run their constructors, and those do not unload cleanly.
 *
 * The library is opened with RTLD_DEEPBIND: NIXL's wheel carries its own
 * UCX, whose symbols have the same names as those of the system's UCX that
 * package nixl/ucx links into the same process; deep binding makes the
 * wheel's libraries resolve to their own copies first.
 */
ecx_dl_t *ecx_dl_open(const char *path, int *why, char *err, size_t cap);

/* Trampolines: Go cannot call C function pointers directly. */
static inline uint32_t ecx_dl_abi_version(ecx_dl_t *l) { return l->abi_version(); }
static inline int32_t ecx_dl_check_nixl(ecx_dl_t *l, char *found, size_t fc, char *e, size_t ec) {
    return l->check_nixl(found, fc, e, ec);
}
static inline int32_t ecx_dl_agent_create(ecx_dl_t *l, const char *n, size_t nl, const char *p,
                                          size_t pl, ecxnixl_agent **out, char *e, size_t ec) {
    return l->agent_create(n, nl, p, pl, out, e, ec);
}
static inline void ecx_dl_agent_destroy(ecx_dl_t *l, ecxnixl_agent *a) { l->agent_destroy(a); }
static inline int32_t ecx_dl_mem_register(ecx_dl_t *l, ecxnixl_agent *a, uint64_t addr,
                                          uint64_t len, uint64_t dev) {
    return l->mem_register(a, addr, len, dev);
}
static inline int32_t ecx_dl_mem_deregister(ecx_dl_t *l, ecxnixl_agent *a, uint64_t addr,
                                            uint64_t len, uint64_t dev) {
    return l->mem_deregister(a, addr, len, dev);
}
static inline int32_t ecx_dl_local_md(ecx_dl_t *l, ecxnixl_agent *a, void *buf, size_t cap,
                                      size_t *len) {
    return l->local_md(a, buf, cap, len);
}
static inline int32_t ecx_dl_load_md(ecx_dl_t *l, ecxnixl_agent *a, const void *md, size_t n,
                                     char *name, size_t cap, size_t *nl) {
    return l->load_md(a, md, n, name, cap, nl);
}
static inline int32_t ecx_dl_invalidate(ecx_dl_t *l, ecxnixl_agent *a, const char *n, size_t nl) {
    return l->invalidate(a, n, nl);
}
static inline int32_t ecx_dl_prep_dlist(ecx_dl_t *l, ecxnixl_agent *a, const char *p, size_t pl,
                                        const uint64_t *addr, const uint64_t *len,
                                        const uint64_t *dev, size_t n, ecxnixl_dlist **out) {
    return l->prep_dlist(a, p, pl, addr, len, dev, n, out);
}
static inline int32_t ecx_dl_release_dlist(ecx_dl_t *l, ecxnixl_agent *a, ecxnixl_dlist *d) {
    return l->release_dlist(a, d);
}
static inline int32_t ecx_dl_post(ecx_dl_t *l, ecxnixl_agent *a, int32_t op, ecxnixl_dlist *loc,
                                  const int32_t *li, ecxnixl_dlist *rem, const int32_t *ri,
                                  size_t n, const void *notif, size_t nl, ecxnixl_req **out) {
    return l->post(a, op, loc, li, rem, ri, n, notif, nl, out);
}
static inline int32_t ecx_dl_status(ecx_dl_t *l, ecxnixl_agent *a, ecxnixl_req *const *r,
                                    int32_t *st, size_t n) {
    return l->status(a, r, st, n);
}
static inline int32_t ecx_dl_release_req(ecx_dl_t *l, ecxnixl_agent *a, ecxnixl_req *r) {
    return l->release_req(a, r);
}
static inline int32_t ecx_dl_notifs(ecx_dl_t *l, ecxnixl_agent *a, void *buf, size_t cap,
                                    size_t max_msg, size_t max_sender, size_t *used,
                                    size_t *count, uint64_t *dropped) {
    return l->notifs(a, buf, cap, max_msg, max_sender, used, count, dropped);
}
static inline int32_t ecx_dl_send_notif(ecx_dl_t *l, ecxnixl_agent *a, const char *p, size_t pl,
                                        const void *m, size_t ml) {
    return l->send_notif(a, p, pl, m, ml);
}

#endif
