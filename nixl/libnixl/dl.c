#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dl.h"

/* Resolves one symbol into *slot; on failure records its name. */
static int resolve(void *h, const char *sym, void **slot, char *err, size_t cap) {
    dlerror();
    *slot = dlsym(h, sym);
    if (*slot == NULL) {
        const char *e = dlerror();
        snprintf(err, cap, "symbol %s is missing%s%s", sym, e ? ": " : "", e ? e : "");
        return 0;
    }
    return 1;
}

ecx_dl_t *ecx_dl_open(const char *path, int *why, char *err, size_t cap) {
    *why = ECX_DL_OK;
    err[0] = '\0';
    dlerror();
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (h == NULL) {
        const char *e = dlerror();
        snprintf(err, cap, "%s", e ? e : "dlopen failed");
        *why = ECX_DL_OPEN;
        return NULL;
    }
    ecx_dl_t *l = calloc(1, sizeof(*l));
    if (l == NULL) {
        snprintf(err, cap, "out of memory");
        *why = ECX_DL_OPEN;
        return NULL;
    }
    l->handle = h;
#define ECX_RESOLVE(field, sym)                                                                  \
    if (!resolve(h, sym, (void **)&l->field, err, cap)) goto missing
    ECX_RESOLVE(abi_version, "ecxnixl_abi_version");
    ECX_RESOLVE(check_nixl, "ecxnixl_check_nixl");
    ECX_RESOLVE(agent_create, "ecxnixl_agent_create");
    ECX_RESOLVE(agent_destroy, "ecxnixl_agent_destroy");
    ECX_RESOLVE(mem_register, "ecxnixl_mem_register");
    ECX_RESOLVE(mem_deregister, "ecxnixl_mem_deregister");
    ECX_RESOLVE(local_md, "ecxnixl_local_md");
    ECX_RESOLVE(load_md, "ecxnixl_load_md");
    ECX_RESOLVE(invalidate, "ecxnixl_invalidate");
    ECX_RESOLVE(prep_dlist, "ecxnixl_prep_dlist");
    ECX_RESOLVE(release_dlist, "ecxnixl_release_dlist");
    ECX_RESOLVE(post, "ecxnixl_post");
    ECX_RESOLVE(status, "ecxnixl_status");
    ECX_RESOLVE(release_req, "ecxnixl_release_req");
    ECX_RESOLVE(notifs, "ecxnixl_notifs");
    ECX_RESOLVE(send_notif, "ecxnixl_send_notif");
#undef ECX_RESOLVE
    if (l->abi_version() != ECXNIXL_ABI_VERSION) {
        snprintf(err, cap, "library speaks ABI version %u, this build needs %u",
                 (unsigned)l->abi_version(), (unsigned)ECXNIXL_ABI_VERSION);
        *why = ECX_DL_ABI;
        free(l); /* loaded, with whatever it pulled in: never unloaded (see dl.h) */
        return NULL;
    }
    char found[128];
    if (l->check_nixl(found, sizeof found, err, cap) != 0) {
        *why = ECX_DL_NIXL;
        free(l); /* NIXL's libraries are in; do not unload them */
        return NULL;
    }
    return l;
missing:
    *why = ECX_DL_SYMBOL;
    free(l); /* as above: not unloaded */
    return NULL;
}
