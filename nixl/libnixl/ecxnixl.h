/*
 * ecxnixl: the small C ABI between ecxfer and the NIXL library.
 *
 * The shim (shim/ecxnixl.c, built into libecxnixl.so by `make nixl`)
 * implements it in C on top of NIXL's C API (libnixl_capi.so, shipped in
 * NIXL's wheel; shim/nixlcapi.h); package libnixl loads that library at
 * run time with dlopen and calls these functions through pointers, so
 * ecxfer builds and runs where NIXL is not installed.
 *
 * Conventions:
 *   - Every function returning int32_t returns a nixl_status_t value:
 *     0 success, 1 in progress, negative an error. NIXL's C API reports
 *     only INVALID_PARAM and NOT_FOUND by name and folds every other
 *     error (REMOTE_DISCONNECT and CANCELED included) into BACKEND, so
 *     those are all the shim can return.
 *   - Handles are opaque pointers owned by the shim. A handle is used by one
 *     thread at a time; the agent has no progress thread of its own, so the
 *     caller's calls to ecxnixl_status and ecxnixl_notifs drive it.
 *   - Strings are (pointer, length) pairs, never NUL-terminated.
 *   - Names cannot contain NUL bytes (NIXL's C API takes C strings).
 */
#ifndef ECXFER_ECXNIXL_H
#define ECXFER_ECXNIXL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a signature or a record layout below changes. */
#define ECXNIXL_ABI_VERSION 3

/* The status values the shim itself produces (same numbers as NIXL's). */
#define ECXNIXL_SUCCESS 0
#define ECXNIXL_IN_PROG 1
#define ECXNIXL_ERR_INVALID_PARAM (-2)
#define ECXNIXL_ERR_BACKEND (-3)
#define ECXNIXL_ERR_NOT_FOUND (-4)
#define ECXNIXL_ERR_MISMATCH (-5)
#define ECXNIXL_ERR_UNKNOWN (-8)

#define ECXNIXL_OP_READ 0
#define ECXNIXL_OP_WRITE 1

typedef struct ecxnixl_agent ecxnixl_agent;
typedef struct ecxnixl_dlist ecxnixl_dlist;
typedef struct ecxnixl_req ecxnixl_req;

/* ECXNIXL_ABI_VERSION of the library. */
uint32_t ecxnixl_abi_version(void);

/*
 * Checks that the NIXL the shim is linked with is the release it was
 * written for: it finds the wheel's metadata (nixl_cu12-*.dist-info)
 * beside the directory of libnixl_capi.so and compares its version with
 * the one nixlcapi.h describes. ECXNIXL_SUCCESS when they are equal;
 * otherwise ECXNIXL_ERR_MISMATCH and a message in errbuf naming both (or
 * saying that no wheel metadata was found). Writes the version found (or
 * "") into found.
 */
int32_t ecxnixl_check_nixl(char *found, size_t found_cap, char *errbuf, size_t errcap);

/*
 * Creates an agent named name with no progress thread, thread-sync mode
 * NONE and one UCX backend. params holds extra UCX backend parameters as
 * "key=value" lines separated by '\n' (may be empty); they override NIXL's
 * defaults. On failure *out is NULL and, when errbuf is given, a message is
 * written there (NUL-terminated, truncated to errcap).
 */
int32_t ecxnixl_agent_create(const char *name, size_t name_len,
                             const char *params, size_t params_len,
                             ecxnixl_agent **out, char *errbuf, size_t errcap);

/* Releases every request and list still held, then the agent. */
void ecxnixl_agent_destroy(ecxnixl_agent *a);

/* Registers / deregisters one DRAM region with the UCX backend. */
int32_t ecxnixl_mem_register(ecxnixl_agent *a, uint64_t addr, uint64_t len, uint64_t dev);
int32_t ecxnixl_mem_deregister(ecxnixl_agent *a, uint64_t addr, uint64_t len, uint64_t dev);

/*
 * Copies the agent's serialized metadata into buf. *len receives its size;
 * when cap is too small nothing is copied and ECXNIXL_ERR_INVALID_PARAM is
 * returned with *len set to the size needed.
 */
int32_t ecxnixl_local_md(ecxnixl_agent *a, void *buf, size_t cap, size_t *len);

/*
 * Loads a peer's metadata and copies its name into name (*name_len gets the
 * length; a name longer than cap is truncated).
 */
int32_t ecxnixl_load_md(ecxnixl_agent *a, const void *md, size_t md_len,
                        char *name, size_t cap, size_t *name_len);

/* Forgets a loaded peer. */
int32_t ecxnixl_invalidate(ecxnixl_agent *a, const char *name, size_t name_len);

/*
 * Prepares a DRAM descriptor list of n entries (addr[i], len[i], dev[i]):
 * this agent's memory when peer_len is 0, else the named peer's.
 */
int32_t ecxnixl_prep_dlist(ecxnixl_agent *a, const char *peer, size_t peer_len,
                           const uint64_t *addr, const uint64_t *len, const uint64_t *dev,
                           size_t n, ecxnixl_dlist **out);
int32_t ecxnixl_release_dlist(ecxnixl_agent *a, ecxnixl_dlist *d);

/*
 * Makes and posts one request moving local[lidx[i]] <-> remote[ridx[i]] for
 * i < n. A notification goes with it when notif_len > 0. Returns
 * ECXNIXL_IN_PROG or ECXNIXL_SUCCESS with *out set (release it with
 * ecxnixl_release_req either way), or an error with *out NULL and nothing
 * left behind.
 */
int32_t ecxnixl_post(ecxnixl_agent *a, int32_t op,
                     ecxnixl_dlist *local, const int32_t *lidx,
                     ecxnixl_dlist *remote, const int32_t *ridx, size_t n,
                     const void *notif, size_t notif_len, ecxnixl_req **out);

/*
 * Checks n requests: st[i] receives the status of reqs[i]. Returns how many
 * are no longer in progress.
 */
int32_t ecxnixl_status(ecxnixl_agent *a, ecxnixl_req *const *reqs, int32_t *st, size_t n);

/* Releases a request, cancelling it when still in flight. */
int32_t ecxnixl_release_req(ecxnixl_agent *a, ecxnixl_req *r);

/*
 * Progresses the agent, collects the notifications that arrived and copies
 * as many as fit into buf as packed records:
 *
 *   uint32 sender_len, uint32 msg_len, sender bytes, message bytes,
 *   padding to a multiple of 8
 *
 * *used receives the bytes written and *count the records. Notifications
 * that do not fit stay queued in the shim for the next call; a record
 * larger than cap is never written: its size (rounded as above) is put in
 * *used with *count 0 and ECXNIXL_ERR_INVALID_PARAM returned, so the caller
 * can grow its buffer.
 *
 * A message longer than max_msg, or whose sender's name is longer than
 * max_sender, is never queued (nor copied): it is dropped as NIXL hands it
 * over, and so is one the shim has no memory to queue. *dropped receives
 * how many the agent has dropped so, since it was created.
 */
int32_t ecxnixl_notifs(ecxnixl_agent *a, void *buf, size_t cap, size_t max_msg, size_t max_sender,
                       size_t *used, size_t *count, uint64_t *dropped);

/* Sends msg to a loaded peer outside any transfer. */
int32_t ecxnixl_send_notif(ecxnixl_agent *a, const char *peer, size_t peer_len,
                           const void *msg, size_t msg_len);

#ifdef __cplusplus
}
#endif

#endif
