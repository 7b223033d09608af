/*
 * nixlcapi.h: ecxfer's declarations of the part of NIXL's C API
 * (libnixl_capi.so, shipped in the nixl-cu12 wheel) that the shim uses.
 *
 * The wheel ships the library but no headers, so these are written here
 * from NIXL's documented C API for exactly one NIXL version,
 * NIXLCAPI_VERSION; the shim refuses to run against any other (it reads
 * the version of the wheel it was loaded from, see ecxnixl.c), and
 * TestABIRoundTrip drives every function below against the real library.
 * Only what the shim calls is declared.
 */
#ifndef ECXFER_NIXLCAPI_H
#define ECXFER_NIXLCAPI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The NIXL release these declarations describe (requirements-nixl.txt). */
#define NIXLCAPI_VERSION "1.5.1"

/*
 * Results. The C API folds NIXL's own statuses into these: NIXL's
 * INVALID_PARAM and NOT_FOUND keep their meaning, and every other NIXL
 * error (REMOTE_DISCONNECT and CANCELED included) becomes ERR_BACKEND.
 */
enum {
    NIXLCAPI_OK = 0,
    NIXLCAPI_IN_PROG = 1,
    NIXLCAPI_ERR_INVALID_PARAM = -1,
    NIXLCAPI_ERR_BACKEND = -2,
    NIXLCAPI_ERR_INVALID_STATE = -3,
    NIXLCAPI_ERR_EXCEPTION = -4,
    NIXLCAPI_ERR_NO_TELEMETRY = -5,
    NIXLCAPI_ERR_NOT_FOUND = -6
};
typedef int nixlcapi_status; /* an enum in C: int-sized on this ABI */

enum { NIXLCAPI_MEM_DRAM = 0 };
enum { NIXLCAPI_OP_READ = 0, NIXLCAPI_OP_WRITE = 1 };
enum { NIXLCAPI_SYNC_NONE = 0 };

/* Opaque handles owned by the library. */
typedef struct nixlcapi_agent *nixlcapi_agent_t;
typedef struct nixlcapi_params *nixlcapi_params_t;
typedef struct nixlcapi_mem_list *nixlcapi_mem_list_t;
typedef struct nixlcapi_backend *nixlcapi_backend_t;
typedef struct nixlcapi_opt_args *nixlcapi_opt_args_t;
typedef struct nixlcapi_xfer_dlist *nixlcapi_xfer_dlist_t;
typedef struct nixlcapi_dlist_handle *nixlcapi_dlist_handle_t;
typedef struct nixlcapi_reg_dlist *nixlcapi_reg_dlist_t;
typedef struct nixlcapi_xfer_req *nixlcapi_xfer_req_t;
typedef struct nixlcapi_notif_map *nixlcapi_notif_map_t;

/*
 * The agent's configuration, passed by pointer. Field order, types and
 * padding are the library's: bool, bool, int, enum (int), unsigned,
 * uint64, uint64, bool — 40 bytes, checked below.
 */
typedef struct {
    bool progress_thread;
    bool listen_thread;
    int listen_port;
    int thread_sync;
    unsigned int num_workers;
    uint64_t progress_delay_us;
    uint64_t listen_delay_us;
    bool telemetry;
} nixlcapi_agent_config;

_Static_assert(sizeof(nixlcapi_agent_config) == 40, "nixlcapi_agent_config layout");
_Static_assert(offsetof(nixlcapi_agent_config, listen_port) == 4, "listen_port offset");
_Static_assert(offsetof(nixlcapi_agent_config, thread_sync) == 8, "thread_sync offset");
_Static_assert(offsetof(nixlcapi_agent_config, progress_delay_us) == 16, "delay offset");
_Static_assert(offsetof(nixlcapi_agent_config, telemetry) == 32, "telemetry offset");

/* Agents. */
nixlcapi_status nixl_capi_create_configured_agent(const char *name,
                                                  const nixlcapi_agent_config *cfg,
                                                  nixlcapi_agent_t *out);
nixlcapi_status nixl_capi_destroy_agent(nixlcapi_agent_t agent);

/* Backends: the plugin's default parameters, then the backend itself. */
nixlcapi_status nixl_capi_get_plugin_params(nixlcapi_agent_t agent, const char *plugin,
                                            nixlcapi_mem_list_t *mems,
                                            nixlcapi_params_t *params);
nixlcapi_status nixl_capi_destroy_mem_list(nixlcapi_mem_list_t mems);
nixlcapi_status nixl_capi_create_params(nixlcapi_params_t *out);
nixlcapi_status nixl_capi_params_add(nixlcapi_params_t params, const char *key,
                                     const char *value); /* sets or replaces */
nixlcapi_status nixl_capi_destroy_params(nixlcapi_params_t params);
nixlcapi_status nixl_capi_create_backend(nixlcapi_agent_t agent, const char *plugin,
                                         nixlcapi_params_t params, nixlcapi_backend_t *out);
nixlcapi_status nixl_capi_destroy_backend(nixlcapi_backend_t backend); /* the wrapper only */

/* Optional arguments (backend choice, notification of a request). */
nixlcapi_status nixl_capi_create_opt_args(nixlcapi_opt_args_t *out);
nixlcapi_status nixl_capi_destroy_opt_args(nixlcapi_opt_args_t args);
nixlcapi_status nixl_capi_opt_args_add_backend(nixlcapi_opt_args_t args,
                                               nixlcapi_backend_t backend);
nixlcapi_status nixl_capi_opt_args_set_notif_msg(nixlcapi_opt_args_t args, const void *msg,
                                                 size_t len);
nixlcapi_status nixl_capi_opt_args_set_has_notif(nixlcapi_opt_args_t args, bool has);

/* Registration lists (one region each here). */
nixlcapi_status nixl_capi_create_reg_dlist(int mem_type, nixlcapi_reg_dlist_t *out);
nixlcapi_status nixl_capi_reg_dlist_add_desc(nixlcapi_reg_dlist_t list, uintptr_t addr,
                                             size_t len, uint64_t dev, const void *md,
                                             size_t md_len);
nixlcapi_status nixl_capi_destroy_reg_dlist(nixlcapi_reg_dlist_t list);
nixlcapi_status nixl_capi_register_mem(nixlcapi_agent_t agent, nixlcapi_reg_dlist_t list,
                                       nixlcapi_opt_args_t args);
nixlcapi_status nixl_capi_deregister_mem(nixlcapi_agent_t agent, nixlcapi_reg_dlist_t list,
                                         nixlcapi_opt_args_t args);

/*
 * Metadata. get_local_md hands out a malloc'd copy (free it); load_remote_md
 * a malloc'd NUL-terminated name (free it).
 */
nixlcapi_status nixl_capi_get_local_md(nixlcapi_agent_t agent, void **data, size_t *len);
nixlcapi_status nixl_capi_load_remote_md(nixlcapi_agent_t agent, const void *data, size_t len,
                                         char **name);
nixlcapi_status nixl_capi_invalidate_remote_md(nixlcapi_agent_t agent, const char *name);

/* Transfer descriptor lists and their prepared handles. */
nixlcapi_status nixl_capi_create_xfer_dlist(int mem_type, nixlcapi_xfer_dlist_t *out);
nixlcapi_status nixl_capi_xfer_dlist_add_desc(nixlcapi_xfer_dlist_t list, uintptr_t addr,
                                              size_t len, uint64_t dev);
nixlcapi_status nixl_capi_destroy_xfer_dlist(nixlcapi_xfer_dlist_t list);
nixlcapi_status nixl_capi_prep_xfer_dlist(nixlcapi_agent_t agent, const char *owner,
                                          nixlcapi_xfer_dlist_t list,
                                          nixlcapi_dlist_handle_t *out,
                                          nixlcapi_opt_args_t args);
/* Releases the prepared list and frees the handle, whatever it returns. */
nixlcapi_status nixl_capi_release_xfer_dlist_handle(nixlcapi_agent_t agent,
                                                    nixlcapi_dlist_handle_t h);

/* Requests. */
nixlcapi_status nixl_capi_make_xfer_req(nixlcapi_agent_t agent, int op,
                                        nixlcapi_dlist_handle_t local, const int *lidx,
                                        size_t nl, nixlcapi_dlist_handle_t remote,
                                        const int *ridx, size_t nr, nixlcapi_xfer_req_t *out,
                                        nixlcapi_opt_args_t args);
nixlcapi_status nixl_capi_post_xfer_req(nixlcapi_agent_t agent, nixlcapi_xfer_req_t req,
                                        nixlcapi_opt_args_t args);
nixlcapi_status nixl_capi_get_xfer_status(nixlcapi_agent_t agent, nixlcapi_xfer_req_t req);
/* Releases (cancelling if in flight); on success the wrapper is empty... */
nixlcapi_status nixl_capi_release_xfer_req(nixlcapi_agent_t agent, nixlcapi_xfer_req_t req);
/* ...and only then may it be destroyed. */
nixlcapi_status nixl_capi_destroy_xfer_req(nixlcapi_xfer_req_t req);

/*
 * Notifications. get_notifs progresses the agent and appends what arrived
 * to the map; entries are read in place (valid until the map changes).
 */
nixlcapi_status nixl_capi_create_notif_map(nixlcapi_notif_map_t *out);
nixlcapi_status nixl_capi_destroy_notif_map(nixlcapi_notif_map_t map);
nixlcapi_status nixl_capi_get_notifs(nixlcapi_agent_t agent, nixlcapi_notif_map_t map,
                                     nixlcapi_opt_args_t args);
nixlcapi_status nixl_capi_notif_map_size(nixlcapi_notif_map_t map, size_t *n);
nixlcapi_status nixl_capi_notif_map_get_agent_at(nixlcapi_notif_map_t map, size_t i,
                                                 const char **name);
nixlcapi_status nixl_capi_notif_map_get_notifs_size(nixlcapi_notif_map_t map, const char *name,
                                                    size_t *n);
nixlcapi_status nixl_capi_notif_map_get_notif(nixlcapi_notif_map_t map, const char *name,
                                              size_t i, const void **data, size_t *len);
nixlcapi_status nixl_capi_notif_map_clear(nixlcapi_notif_map_t map);
nixlcapi_status nixl_capi_gen_notif(nixlcapi_agent_t agent, const char *peer, const void *msg,
                                    size_t len, nixlcapi_opt_args_t args);

#endif
