/*
 * ecxnixl.c: ecxfer's C ABI (../ecxnixl.h) over NIXL's C API (nixlcapi.h,
 * libnixl_capi.so from NIXL's wheel).
 *
 * Built into libecxnixl.so by `make nixl`; never compiled by `go build`
 * (this directory has no Go files). Package libnixl loads the result with
 * dlopen. Being C over a C API, nothing here depends on the C++ ABI the
 * wheel was built with.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../ecxnixl.h"
#include "nixlcapi.h"

struct ecxnixl_dlist {
    nixlcapi_dlist_handle_t h;
    struct ecxnixl_dlist *prev, *next;
};

struct ecxnixl_req {
    nixlcapi_xfer_req_t h;
    struct ecxnixl_req *prev, *next;
};

/* One notification taken from NIXL and not yet handed to the caller. */
struct queued {
    uint32_t sender_len, msg_len;
    char *bytes; /* sender then message */
};

struct ecxnixl_agent {
    nixlcapi_agent_t agent;
    nixlcapi_backend_t ucx;
    nixlcapi_opt_args_t opt;    /* the UCX backend, nothing else */
    nixlcapi_opt_args_t notopt; /* the UCX backend and a notification */
    nixlcapi_notif_map_t map;
    struct ecxnixl_dlist *dlists; /* every prepared list, for destroy */
    struct ecxnixl_req *reqs;     /* every live request, for destroy */
    struct queued *q;             /* FIFO: q[qhead..qlen) */
    size_t qhead, qlen, qcap;
    uint64_t dropped; /* notifications never queued: too long, or no memory */
};

/* Maps a C API result back to the NIXL status the ABI speaks. */
static int32_t
status(nixlcapi_status s) {
    switch (s) {
    case NIXLCAPI_OK: return ECXNIXL_SUCCESS;
    case NIXLCAPI_IN_PROG: return ECXNIXL_IN_PROG;
    case NIXLCAPI_ERR_INVALID_PARAM: return ECXNIXL_ERR_INVALID_PARAM;
    case NIXLCAPI_ERR_NOT_FOUND: return ECXNIXL_ERR_NOT_FOUND;
    case NIXLCAPI_ERR_BACKEND: return ECXNIXL_ERR_BACKEND;
    }
    return ECXNIXL_ERR_UNKNOWN;
}

static void
set_err(char *buf, size_t cap, const char *msg) {
    if (buf == NULL || cap == 0) return;
    snprintf(buf, cap, "%s", msg);
}

/* A NUL-terminated copy of (p, n), or NULL when p holds a NUL or no memory. */
static char *
cstr(const char *p, size_t n) {
    if (n > 0 && memchr(p, 0, n) != NULL) return NULL;
    char *s = malloc(n + 1);
    if (s == NULL) return NULL;
    if (n > 0) memcpy(s, p, n);
    s[n] = '\0';
    return s;
}

uint32_t
ecxnixl_abi_version(void) {
    return ECXNIXL_ABI_VERSION;
}

/* Where libnixl_capi.so was loaded from, into buf; 0 when unknown. */
static int
capi_path(char *buf, size_t cap) {
    Dl_info info;
    if (dladdr((void *)nixl_capi_create_configured_agent, &info) == 0 || info.dli_fname == NULL)
        return 0;
    snprintf(buf, cap, "%s", info.dli_fname);
    return 1;
}

/* Reads "Version: x" from a dist-info METADATA file into out. */
static int
read_version(const char *path, char *out, size_t cap) {
    FILE *f = fopen(path, "r");
    if (f == NULL) return 0;
    char line[256];
    int ok = 0;
    while (fgets(line, sizeof line, f) != NULL) {
        if (strncmp(line, "Version:", 8) != 0) continue;
        char *v = line + 8;
        while (*v == ' ' || *v == '\t') v++;
        v[strcspn(v, "\r\n")] = '\0';
        snprintf(out, cap, "%s", v);
        ok = 1;
        break;
    }
    fclose(f);
    return ok;
}

int32_t
ecxnixl_check_nixl(char *found, size_t found_cap, char *errbuf, size_t errcap) {
    char msg[1024];
    if (found != NULL && found_cap > 0) found[0] = '\0';
    char capi[4096];
    if (!capi_path(capi, sizeof capi)) {
        set_err(errbuf, errcap, "cannot tell where libnixl_capi.so was loaded from");
        return ECXNIXL_ERR_MISMATCH;
    }
    /* <site-packages>/.nixl_cu12.mesonpy.libs/libnixl_capi.so: the wheel's
     * metadata sits in <site-packages>. */
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", capi);
    for (int up = 0; up < 2; up++) {
        char *slash = strrchr(dir, '/');
        if (slash == NULL) {
            snprintf(dir, sizeof dir, ".");
            break;
        }
        *slash = '\0';
    }
    DIR *d = opendir(dir);
    char version[128] = "";
    if (d != NULL) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            const char *n = e->d_name;
            size_t l = strlen(n);
            if (strncmp(n, "nixl_cu", 7) != 0 || l < 10 || strcmp(n + l - 10, ".dist-info") != 0)
                continue;
            char meta[4096 + 512];
            snprintf(meta, sizeof meta, "%s/%s/METADATA", dir, n);
            if (read_version(meta, version, sizeof version)) break;
        }
        closedir(d);
    }
    if (found != NULL && found_cap > 0) snprintf(found, found_cap, "%s", version);
    if (version[0] == '\0') {
        snprintf(msg, sizeof msg,
                 "no NIXL wheel metadata (nixl_cu*.dist-info) in %s beside %s: cannot check that "
                 "it is NIXL %s, the release the shim is written for",
                 dir, capi, NIXLCAPI_VERSION);
        set_err(errbuf, errcap, msg);
        return ECXNIXL_ERR_MISMATCH;
    }
    if (strcmp(version, NIXLCAPI_VERSION) != 0) {
        snprintf(msg, sizeof msg,
                 "%s is NIXL %s, but the shim is written for NIXL %s exactly "
                 "(install the version in requirements-nixl.txt)",
                 capi, version, NIXLCAPI_VERSION);
        set_err(errbuf, errcap, msg);
        return ECXNIXL_ERR_MISMATCH;
    }
    return ECXNIXL_SUCCESS;
}

/*
 * NIXL loads its UCX plugin itself, with plain dlopen. In a process that
 * also holds the system's UCX (package nixl/ucx links it), the plugin's
 * UCX libraries from the wheel would then bind their own global symbols to
 * the system UCX's copies of the same names, and the wheel's libucs aborts
 * in its constructor (`!ucs_debug_initialized`). So the shim loads the
 * plugin first, with RTLD_DEEPBIND: the plugin and the wheel's UCX it
 * brings in resolve to themselves; NIXL's own dlopen then finds it loaded.
 *
 * The wheel's UCX in turn loads its transport modules (cma, ib, ...) with
 * plain dlopen, and those would bind to the system UCX the same way (a
 * crash in uct_tl_register). When the system UCX is in the process, the
 * wheel's UCX is therefore allowed only the cma module (UCX_MODULES, which
 * its libucs reads in its constructor, is set to "cma" while the plugin
 * loads and put back afterwards), and the shim loads that module itself
 * first, with RTLD_DEEPBIND, so that UCX's own dlopen finds it loaded and
 * bound to the right UCX. cma matters: it gives one-sided gets between
 * processes on one host; without it a READ waits for the producer to
 * progress its worker (about 1 ms per READ with ecxfer's reactor, which
 * NIXL gives no descriptor to sleep on). Other modules (InfiniBand) are
 * not available in such a process. Without the system UCX nothing is
 * changed.
 */
static pthread_mutex_t preload_mu = PTHREAD_MUTEX_INITIALIZER;
static int preloaded;

/* Loads the wheel's cma module (beside its libucp, in ucx/) deep-bound;
 * NIXL's UCX then finds it loaded. Without it NIXL works, only slower. */
static void
preload_cma(void *plugin) {
    void *sym = dlsym(plugin, "ucp_init_version"); /* the wheel's libucp */
    Dl_info di;
    if (sym == NULL || dladdr(sym, &di) == 0 || di.dli_fname == NULL) return;
    char path[4096];
    snprintf(path, sizeof path, "%s", di.dli_fname);
    char *slash = strrchr(path, '/');
    if (slash == NULL) return;
    size_t at = (size_t)(slash - path) + 1;
    snprintf(path + at, sizeof path - at, "ucx/libuct_cma.so.0.0.0");
    (void)dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
}

static int
preload_plugin(char *errbuf, size_t errcap) {
    char msg[8192];
    pthread_mutex_lock(&preload_mu);
    if (preloaded) {
        pthread_mutex_unlock(&preload_mu);
        return 1;
    }
    char path[4096];
    const char *dir = getenv("NIXL_PLUGIN_DIR");
    if (dir != NULL && dir[0] != '\0') {
        snprintf(path, sizeof path, "%s/libplugin_UCX.so", dir);
    } else {
        if (!capi_path(path, sizeof path)) {
            pthread_mutex_unlock(&preload_mu);
            set_err(errbuf, errcap, "cannot tell where libnixl_capi.so was loaded from");
            return 0;
        }
        char *slash = strrchr(path, '/');
        size_t at = slash == NULL ? 0 : (size_t)(slash - path) + 1;
        snprintf(path + at, sizeof path - at, "plugins/libplugin_UCX.so");
    }
    int system_ucx = dlopen("libucs.so.0", RTLD_NOW | RTLD_NOLOAD) != NULL;
    char *saved = NULL;
    int had = 0;
    if (system_ucx) {
        const char *old = getenv("UCX_MODULES");
        had = old != NULL;
        if (had) saved = strdup(old);
        setenv("UCX_MODULES", "cma", 1);
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    const char *e = h == NULL ? dlerror() : NULL;
    if (h != NULL && system_ucx) preload_cma(h);
    if (system_ucx) {
        if (had)
            setenv("UCX_MODULES", saved, 1);
        else
            unsetenv("UCX_MODULES");
        free(saved);
    }
    if (h == NULL) {
        pthread_mutex_unlock(&preload_mu);
        snprintf(msg, sizeof msg, "loading NIXL's UCX plugin %s: %s", path, e ? e : "failed");
        set_err(errbuf, errcap, msg);
        return 0;
    }
    preloaded = 1;
    pthread_mutex_unlock(&preload_mu);
    return 1;
}

static void
agent_free(ecxnixl_agent *a) {
    if (a->map != NULL) nixl_capi_destroy_notif_map(a->map);
    if (a->notopt != NULL) nixl_capi_destroy_opt_args(a->notopt);
    if (a->opt != NULL) nixl_capi_destroy_opt_args(a->opt);
    if (a->ucx != NULL) nixl_capi_destroy_backend(a->ucx);
    if (a->agent != NULL) nixl_capi_destroy_agent(a->agent);
    for (size_t i = a->qhead; i < a->qlen; i++) free(a->q[i].bytes);
    free(a->q);
    free(a);
}

/*
 * Sets each "key=value" line of (p, n) on params, replacing NIXL's default
 * for that key. Returns 0 on a line that is not key=value.
 */
static int
add_params(nixlcapi_params_t params, const char *p, size_t n) {
    size_t pos = 0;
    while (pos < n) {
        const char *nl = memchr(p + pos, '\n', n - pos);
        size_t end = nl == NULL ? n : (size_t)(nl - p);
        char *line = cstr(p + pos, end - pos);
        if (line == NULL) return 0;
        char *eq = strchr(line, '=');
        if (line[0] != '\0') {
            if (eq == NULL || eq == line) {
                free(line);
                return 0;
            }
            *eq = '\0';
            if (nixl_capi_params_add(params, line, eq + 1) != NIXLCAPI_OK) {
                free(line);
                return 0;
            }
        }
        free(line);
        pos = end + 1;
    }
    return 1;
}

int32_t
ecxnixl_agent_create(const char *name, size_t name_len, const char *params, size_t params_len,
                     ecxnixl_agent **out, char *errbuf, size_t errcap) {
    char msg[512];
    if (out == NULL) return ECXNIXL_ERR_INVALID_PARAM;
    *out = NULL;
    char *cname = name == NULL || name_len == 0 ? NULL : cstr(name, name_len);
    if (cname == NULL) {
        set_err(errbuf, errcap, "empty agent name, or one with a NUL byte");
        return ECXNIXL_ERR_INVALID_PARAM;
    }
    if (!preload_plugin(errbuf, errcap)) {
        free(cname);
        return ECXNIXL_ERR_NOT_FOUND;
    }
    ecxnixl_agent *a = calloc(1, sizeof *a);
    if (a == NULL) {
        free(cname);
        set_err(errbuf, errcap, "out of memory");
        return ECXNIXL_ERR_UNKNOWN;
    }
    nixlcapi_agent_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.thread_sync = NIXLCAPI_SYNC_NONE; /* no progress or listen thread */
    nixlcapi_status s = nixl_capi_create_configured_agent(cname, &cfg, &a->agent);
    free(cname);
    if (s != NIXLCAPI_OK) {
        snprintf(msg, sizeof msg, "creating the NIXL agent failed (C API status %d)", s);
        set_err(errbuf, errcap, msg);
        agent_free(a);
        return status(s);
    }
    nixlcapi_mem_list_t mems = NULL;
    nixlcapi_params_t bparams = NULL;
    s = nixl_capi_get_plugin_params(a->agent, "UCX", &mems, &bparams);
    if (s != NIXLCAPI_OK) {
        snprintf(msg, sizeof msg,
                 "NIXL has no UCX plugin (C API status %d): is the plugins directory beside "
                 "libnixl.so, or NIXL_PLUGIN_DIR, right?",
                 s);
        set_err(errbuf, errcap, msg);
        agent_free(a);
        return status(s);
    }
    nixl_capi_destroy_mem_list(mems);
    if (!add_params(bparams, params, params_len)) {
        set_err(errbuf, errcap, "backend parameters are not key=value lines");
        nixl_capi_destroy_params(bparams);
        agent_free(a);
        return ECXNIXL_ERR_INVALID_PARAM;
    }
    s = nixl_capi_create_backend(a->agent, "UCX", bparams, &a->ucx);
    nixl_capi_destroy_params(bparams);
    if (s != NIXLCAPI_OK) {
        snprintf(msg, sizeof msg, "creating NIXL's UCX backend failed (C API status %d)", s);
        set_err(errbuf, errcap, msg);
        a->ucx = NULL;
        agent_free(a);
        return status(s);
    }
    if (nixl_capi_create_opt_args(&a->opt) != NIXLCAPI_OK ||
        nixl_capi_opt_args_add_backend(a->opt, a->ucx) != NIXLCAPI_OK ||
        nixl_capi_create_opt_args(&a->notopt) != NIXLCAPI_OK ||
        nixl_capi_opt_args_add_backend(a->notopt, a->ucx) != NIXLCAPI_OK ||
        nixl_capi_create_notif_map(&a->map) != NIXLCAPI_OK) {
        set_err(errbuf, errcap, "allocating NIXL's argument objects failed");
        agent_free(a);
        return ECXNIXL_ERR_UNKNOWN;
    }
    *out = a;
    return ECXNIXL_SUCCESS;
}

void
ecxnixl_agent_destroy(ecxnixl_agent *a) {
    if (a == NULL) return;
    while (a->reqs != NULL) ecxnixl_release_req(a, a->reqs);
    while (a->dlists != NULL) ecxnixl_release_dlist(a, a->dlists);
    agent_free(a);
}

static int32_t
mem_op(ecxnixl_agent *a, uint64_t addr, uint64_t len, uint64_t dev, int reg) {
    nixlcapi_reg_dlist_t l = NULL;
    nixlcapi_status s = nixl_capi_create_reg_dlist(NIXLCAPI_MEM_DRAM, &l);
    if (s != NIXLCAPI_OK) return status(s);
    s = nixl_capi_reg_dlist_add_desc(l, (uintptr_t)addr, (size_t)len, dev, NULL, 0);
    if (s == NIXLCAPI_OK)
        s = reg ? nixl_capi_register_mem(a->agent, l, a->opt)
                : nixl_capi_deregister_mem(a->agent, l, a->opt);
    nixl_capi_destroy_reg_dlist(l);
    return status(s);
}

int32_t
ecxnixl_mem_register(ecxnixl_agent *a, uint64_t addr, uint64_t len, uint64_t dev) {
    return mem_op(a, addr, len, dev, 1);
}

int32_t
ecxnixl_mem_deregister(ecxnixl_agent *a, uint64_t addr, uint64_t len, uint64_t dev) {
    return mem_op(a, addr, len, dev, 0);
}

int32_t
ecxnixl_local_md(ecxnixl_agent *a, void *buf, size_t cap, size_t *len) {
    void *md = NULL;
    size_t n = 0;
    nixlcapi_status s = nixl_capi_get_local_md(a->agent, &md, &n);
    if (s != NIXLCAPI_OK) return status(s);
    *len = n;
    int32_t r = ECXNIXL_SUCCESS;
    if (n > cap)
        r = ECXNIXL_ERR_INVALID_PARAM;
    else if (n > 0)
        memcpy(buf, md, n);
    free(md);
    return r;
}

int32_t
ecxnixl_load_md(ecxnixl_agent *a, const void *md, size_t md_len, char *name, size_t cap,
                size_t *name_len) {
    *name_len = 0;
    char *got = NULL;
    nixlcapi_status s = nixl_capi_load_remote_md(a->agent, md, md_len, &got);
    if (s != NIXLCAPI_OK) return status(s);
    size_t n = strlen(got);
    *name_len = n;
    memcpy(name, got, n < cap ? n : cap);
    free(got);
    return ECXNIXL_SUCCESS;
}

int32_t
ecxnixl_invalidate(ecxnixl_agent *a, const char *name, size_t name_len) {
    char *c = cstr(name, name_len);
    if (c == NULL) return ECXNIXL_ERR_NOT_FOUND; /* no such name can be loaded */
    nixlcapi_status s = nixl_capi_invalidate_remote_md(a->agent, c);
    free(c);
    return status(s);
}

int32_t
ecxnixl_prep_dlist(ecxnixl_agent *a, const char *peer, size_t peer_len, const uint64_t *addr,
                   const uint64_t *len, const uint64_t *dev, size_t n, ecxnixl_dlist **out) {
    *out = NULL;
    /* NIXL names its own side NIXL_INIT_AGENT, the empty string. */
    char *owner = peer_len == 0 ? cstr("", 0) : cstr(peer, peer_len);
    if (owner == NULL) return ECXNIXL_ERR_INVALID_PARAM;
    nixlcapi_xfer_dlist_t l = NULL;
    nixlcapi_status s = nixl_capi_create_xfer_dlist(NIXLCAPI_MEM_DRAM, &l);
    for (size_t i = 0; s == NIXLCAPI_OK && i < n; i++)
        s = nixl_capi_xfer_dlist_add_desc(l, (uintptr_t)addr[i], (size_t)len[i], dev[i]);
    nixlcapi_dlist_handle_t h = NULL;
    if (s == NIXLCAPI_OK) s = nixl_capi_prep_xfer_dlist(a->agent, owner, l, &h, a->opt);
    if (l != NULL) nixl_capi_destroy_xfer_dlist(l);
    free(owner);
    if (s != NIXLCAPI_OK) return status(s);
    struct ecxnixl_dlist *d = calloc(1, sizeof *d);
    if (d == NULL) {
        nixl_capi_release_xfer_dlist_handle(a->agent, h);
        return ECXNIXL_ERR_UNKNOWN;
    }
    d->h = h;
    d->next = a->dlists;
    if (a->dlists != NULL) a->dlists->prev = d;
    a->dlists = d;
    *out = d;
    return ECXNIXL_SUCCESS;
}

int32_t
ecxnixl_release_dlist(ecxnixl_agent *a, ecxnixl_dlist *d) {
    if (d == NULL) return ECXNIXL_ERR_NOT_FOUND;
    if (d->prev != NULL)
        d->prev->next = d->next;
    else
        a->dlists = d->next;
    if (d->next != NULL) d->next->prev = d->prev;
    nixlcapi_status s = nixl_capi_release_xfer_dlist_handle(a->agent, d->h);
    free(d);
    return status(s);
}

int32_t
ecxnixl_post(ecxnixl_agent *a, int32_t op, ecxnixl_dlist *local, const int32_t *lidx,
             ecxnixl_dlist *remote, const int32_t *ridx, size_t n, const void *notif,
             size_t notif_len, ecxnixl_req **out) {
    *out = NULL;
    if (op != ECXNIXL_OP_READ && op != ECXNIXL_OP_WRITE) return ECXNIXL_ERR_INVALID_PARAM;
    if (local == NULL || remote == NULL) return ECXNIXL_ERR_INVALID_PARAM;
    _Static_assert(sizeof(int) == sizeof(int32_t), "index arrays are passed as int");
    nixlcapi_opt_args_t args = a->opt;
    if (notif_len > 0) {
        /* The request keeps its own copy of the message. */
        args = a->notopt;
        if (nixl_capi_opt_args_set_notif_msg(args, notif, notif_len) != NIXLCAPI_OK ||
            nixl_capi_opt_args_set_has_notif(args, true) != NIXLCAPI_OK)
            return ECXNIXL_ERR_UNKNOWN;
    }
    nixlcapi_xfer_req_t h = NULL;
    nixlcapi_status s = nixl_capi_make_xfer_req(
        a->agent, op == ECXNIXL_OP_READ ? NIXLCAPI_OP_READ : NIXLCAPI_OP_WRITE, local->h,
        (const int *)lidx, n, remote->h, (const int *)ridx, n, &h, args);
    if (s != NIXLCAPI_OK) return status(s);
    s = nixl_capi_post_xfer_req(a->agent, h, NULL);
    if (s != NIXLCAPI_OK && s != NIXLCAPI_IN_PROG) {
        if (nixl_capi_release_xfer_req(a->agent, h) == NIXLCAPI_OK) nixl_capi_destroy_xfer_req(h);
        return status(s);
    }
    struct ecxnixl_req *r = calloc(1, sizeof *r);
    if (r == NULL) {
        /* Cannot track it: wait for it rather than cancel under UCX. */
        while (nixl_capi_get_xfer_status(a->agent, h) == NIXLCAPI_IN_PROG) {
        }
        if (nixl_capi_release_xfer_req(a->agent, h) == NIXLCAPI_OK) nixl_capi_destroy_xfer_req(h);
        return ECXNIXL_ERR_UNKNOWN;
    }
    r->h = h;
    r->next = a->reqs;
    if (a->reqs != NULL) a->reqs->prev = r;
    a->reqs = r;
    *out = r;
    return status(s);
}

int32_t
ecxnixl_status(ecxnixl_agent *a, ecxnixl_req *const *reqs, int32_t *st, size_t n) {
    int32_t done = 0;
    for (size_t i = 0; i < n; i++) {
        st[i] = status(nixl_capi_get_xfer_status(a->agent, reqs[i]->h));
        if (st[i] != ECXNIXL_IN_PROG) done++;
    }
    return done;
}

int32_t
ecxnixl_release_req(ecxnixl_agent *a, ecxnixl_req *r) {
    if (r == NULL) return ECXNIXL_ERR_NOT_FOUND;
    if (r->prev != NULL)
        r->prev->next = r->next;
    else
        a->reqs = r->next;
    if (r->next != NULL) r->next->prev = r->prev;
    nixlcapi_status s = nixl_capi_release_xfer_req(a->agent, r->h);
    /* A request NIXL refused to release stays NIXL's; only its small
     * wrapper is then lost. */
    if (s == NIXLCAPI_OK) nixl_capi_destroy_xfer_req(r->h);
    free(r);
    return status(s);
}

/*
 * Appends one notification to the FIFO, unless its message is longer than
 * max_msg or its sender's name longer than max_sender: those are counted
 * dropped and never copied (a peer's multi-GiB message would otherwise be
 * copied twice, and its length would not fit the record's uint32). One
 * the FIFO has no memory for is counted dropped too.
 */
static void
enqueue(ecxnixl_agent *a, const char *sender, const void *msg, size_t ml, size_t max_msg,
        size_t max_sender) {
    size_t sl = strnlen(sender, max_sender + 1);
    if (ml > max_msg || sl > max_sender || ml > UINT32_MAX || sl > UINT32_MAX) {
        a->dropped++;
        return;
    }
    if (a->qlen == a->qcap) {
        if (a->qhead > 0) {
            memmove(a->q, a->q + a->qhead, (a->qlen - a->qhead) * sizeof *a->q);
            a->qlen -= a->qhead;
            a->qhead = 0;
        }
        if (a->qlen == a->qcap) {
            size_t nc = a->qcap == 0 ? 64 : 2 * a->qcap;
            struct queued *q = realloc(a->q, nc * sizeof *q);
            if (q == NULL) {
                a->dropped++;
                return;
            }
            a->q = q;
            a->qcap = nc;
        }
    }
    char *b = malloc(sl + ml + 1);
    if (b == NULL) {
        a->dropped++;
        return;
    }
    memcpy(b, sender, sl);
    if (ml > 0) memcpy(b + sl, msg, ml);
    a->q[a->qlen].sender_len = (uint32_t)sl;
    a->q[a->qlen].msg_len = (uint32_t)ml;
    a->q[a->qlen].bytes = b;
    a->qlen++;
}

static int
cmp_names(const void *x, const void *y) {
    return strcmp(*(const char *const *)x, *(const char *const *)y);
}

/*
 * Moves everything in NIXL's notification map into the FIFO (see enqueue).
 *
 * NIXL takes a notification's sender name from the notification itself,
 * and its C API hands names back as C strings and looks entries up by
 * them: the entry of a sender whose name holds a NUL ("prod\0x") comes
 * back under the name cut at the NUL, and its lookup finds the entry of
 * "prod", if there is one, or nothing. Such an entry's messages cannot be
 * reached. So the names are sorted and each is taken once per batch (its
 * lookup finds the entry of the name without a NUL, wherever its twins
 * stand), and an entry whose name was taken already, or whose lookup
 * fails, is counted as one notification dropped (at least one: its count
 * cannot be read).
 */
static int32_t
collect(ecxnixl_agent *a, size_t max_msg, size_t max_sender) {
    nixlcapi_status s = nixl_capi_get_notifs(a->agent, a->map, a->opt);
    size_t agents = 0;
    nixl_capi_notif_map_size(a->map, &agents);
    const char **names = agents > 0 ? malloc(agents * sizeof *names) : NULL;
    if (agents > 0 && names == NULL) {
        a->dropped += agents; /* no memory: at least one each */
        nixl_capi_notif_map_clear(a->map);
        return status(s);
    }
    size_t n = 0;
    for (size_t i = 0; i < agents; i++) {
        const char *sender = NULL;
        if (nixl_capi_notif_map_get_agent_at(a->map, i, &sender) == NIXLCAPI_OK && sender != NULL)
            names[n++] = sender;
    }
    if (n > 1) qsort(names, n, sizeof *names, cmp_names);
    for (size_t i = 0; i < n; i++) {
        const char *sender = names[i];
        size_t count = 0;
        if ((i > 0 && strcmp(sender, names[i - 1]) == 0) ||
            nixl_capi_notif_map_get_notifs_size(a->map, sender, &count) != NIXLCAPI_OK) {
            a->dropped++;
            continue;
        }
        for (size_t j = 0; j < count; j++) {
            const void *msg = NULL;
            size_t ml = 0;
            if (nixl_capi_notif_map_get_notif(a->map, sender, j, &msg, &ml) != NIXLCAPI_OK)
                continue;
            enqueue(a, sender, msg, ml, max_msg, max_sender);
        }
    }
    free(names);
    nixl_capi_notif_map_clear(a->map);
    return status(s);
}

static size_t
record_size(const struct queued *q) {
    return ((size_t)8 + q->sender_len + q->msg_len + 7) & ~(size_t)7;
}

int32_t
ecxnixl_notifs(ecxnixl_agent *a, void *buf, size_t cap, size_t max_msg, size_t max_sender,
               size_t *used, size_t *count, uint64_t *dropped) {
    *used = 0;
    *count = 0;
    int32_t st = collect(a, max_msg, max_sender);
    *dropped = a->dropped;
    unsigned char *p = buf;
    size_t off = 0;
    while (a->qhead < a->qlen) {
        struct queued *q = &a->q[a->qhead];
        size_t sz = record_size(q);
        if (off + sz > cap) {
            if (off == 0) {
                *used = sz;
                return ECXNIXL_ERR_INVALID_PARAM;
            }
            break;
        }
        memcpy(p + off, &q->sender_len, 4);
        memcpy(p + off + 4, &q->msg_len, 4);
        memcpy(p + off + 8, q->bytes, (size_t)q->sender_len + q->msg_len);
        memset(p + off + 8 + q->sender_len + q->msg_len, 0,
               sz - 8 - q->sender_len - q->msg_len);
        off += sz;
        (*count)++;
        free(q->bytes);
        a->qhead++;
    }
    if (a->qhead == a->qlen) a->qhead = a->qlen = 0;
    *used = off;
    return st < 0 ? st : ECXNIXL_SUCCESS;
}

int32_t
ecxnixl_send_notif(ecxnixl_agent *a, const char *peer, size_t peer_len, const void *msg,
                   size_t msg_len) {
    char *c = cstr(peer, peer_len);
    if (c == NULL) return ECXNIXL_ERR_NOT_FOUND;
    nixlcapi_status s = nixl_capi_gen_notif(a->agent, c, msg, msg_len, a->opt);
    free(c);
    return status(s);
}
