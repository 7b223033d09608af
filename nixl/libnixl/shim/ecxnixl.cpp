// ecxnixl.cpp: ecxfer's C ABI (../ecxnixl.h) over NIXL's C++ agent.
//
// Built into libecxnixl.so by `make nixl NIXL_PREFIX=...` against an
// installed NIXL; never compiled by `go build` (this directory has no Go
// files). Package libnixl loads the result with dlopen.
//
// Every entry point catches C++ exceptions and turns them into
// ECXNIXL_ERR_UNKNOWN: nothing may unwind into Go.

#include <cstring>
#include <deque>
#include <exception>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nixl.h>

#include "../ecxnixl.h"

struct ecxnixl_dlist {
    nixlDlistH *h = nullptr;
};

struct ecxnixl_req {
    nixlXferReqH *h = nullptr;
};

struct ecxnixl_agent {
    nixlAgent *agent = nullptr;
    nixlBackendH *ucx = nullptr;
    // Notifications collected from NIXL but not yet handed to the caller.
    std::deque<std::pair<std::string, std::string>> queued;
    nixl_notifs_t scratch;
    std::unordered_set<ecxnixl_dlist *> dlists;
    std::unordered_set<ecxnixl_req *> reqs;
};

namespace {

void
set_err(char *buf, size_t cap, const std::string &msg) {
    if (buf == nullptr || cap == 0) return;
    size_t n = msg.size() < cap - 1 ? msg.size() : cap - 1;
    std::memcpy(buf, msg.data(), n);
    buf[n] = '\0';
}

// Parses "key=value" lines into params, overriding what is there.
void
parse_params(const char *p, size_t n, nixl_b_params_t &params) {
    std::string s(p == nullptr ? "" : std::string(p, n));
    size_t pos = 0;
    while (pos < s.size()) {
        size_t end = s.find('\n', pos);
        if (end == std::string::npos) end = s.size();
        std::string line = s.substr(pos, end - pos);
        size_t eq = line.find('=');
        if (eq != std::string::npos && eq > 0) params[line.substr(0, eq)] = line.substr(eq + 1);
        pos = end + 1;
    }
}

nixl_reg_dlist_t
reg_list(uint64_t addr, uint64_t len, uint64_t dev) {
    nixl_reg_dlist_t l(DRAM_SEG);
    l.addDesc(nixlBlobDesc(static_cast<uintptr_t>(addr), static_cast<size_t>(len), dev));
    return l;
}

size_t
record_size(const std::pair<std::string, std::string> &n) {
    return (8 + n.first.size() + n.second.size() + 7) & ~size_t(7);
}

} // namespace

#define ECXNIXL_GUARD_BEGIN try {
#define ECXNIXL_GUARD_END                                                                         \
    }                                                                                             \
    catch (...) {                                                                                 \
        return ECXNIXL_ERR_UNKNOWN;                                                               \
    }

extern "C" {

uint32_t
ecxnixl_abi_version(void) {
    return ECXNIXL_ABI_VERSION;
}

int32_t
ecxnixl_agent_create(const char *name, size_t name_len, const char *params, size_t params_len,
                     ecxnixl_agent **out, char *errbuf, size_t errcap) {
    if (out == nullptr) return ECXNIXL_ERR_INVALID_PARAM;
    *out = nullptr;
    if (name == nullptr || name_len == 0) {
        set_err(errbuf, errcap, "empty agent name");
        return ECXNIXL_ERR_INVALID_PARAM;
    }
    ecxnixl_agent *a = nullptr;
    try {
        nixlAgentConfig cfg(false);
        cfg.useProgThread = false;
        cfg.syncMode = nixl_thread_sync_t::NIXL_THREAD_SYNC_NONE;
        a = new ecxnixl_agent();
        a->agent = new nixlAgent(std::string(name, name_len), cfg);

        nixl_mem_list_t mems;
        nixl_b_params_t bparams;
        nixl_status_t st = a->agent->getPluginParams("UCX", mems, bparams);
        if (st != NIXL_SUCCESS) {
            set_err(errbuf, errcap,
                    "NIXL has no UCX plugin (status " + std::to_string(st) +
                        "); is NIXL_PLUGIN_DIR right, or the plugins directory next to libnixl.so "
                        "present?");
            delete a->agent;
            delete a;
            return st;
        }
        parse_params(params, params_len, bparams);
        st = a->agent->createBackend("UCX", bparams, a->ucx);
        if (st != NIXL_SUCCESS) {
            set_err(errbuf, errcap, "creating NIXL's UCX backend failed (status " +
                        std::to_string(st) + ")");
            delete a->agent;
            delete a;
            return st;
        }
    }
    catch (const std::exception &e) {
        set_err(errbuf, errcap, std::string("NIXL agent: ") + e.what());
        if (a != nullptr) {
            delete a->agent;
            delete a;
        }
        return ECXNIXL_ERR_UNKNOWN;
    }
    catch (...) {
        set_err(errbuf, errcap, "NIXL agent: unknown exception");
        if (a != nullptr) {
            delete a->agent;
            delete a;
        }
        return ECXNIXL_ERR_UNKNOWN;
    }
    *out = a;
    return ECXNIXL_SUCCESS;
}

void
ecxnixl_agent_destroy(ecxnixl_agent *a) {
    if (a == nullptr) return;
    try {
        for (ecxnixl_req *r : a->reqs) {
            a->agent->releaseXferReq(r->h);
            delete r;
        }
        a->reqs.clear();
        for (ecxnixl_dlist *d : a->dlists) {
            a->agent->releasedDlistH(d->h);
            delete d;
        }
        a->dlists.clear();
        delete a->agent;
    }
    catch (...) {
    }
    delete a;
}

int32_t
ecxnixl_mem_register(ecxnixl_agent *a, uint64_t addr, uint64_t len, uint64_t dev) {
    ECXNIXL_GUARD_BEGIN
    nixl_opt_args_t extra;
    extra.backends.push_back(a->ucx);
    return a->agent->registerMem(reg_list(addr, len, dev), &extra);
    ECXNIXL_GUARD_END
}

int32_t
ecxnixl_mem_deregister(ecxnixl_agent *a, uint64_t addr, uint64_t len, uint64_t dev) {
    ECXNIXL_GUARD_BEGIN
    nixl_opt_args_t extra;
    extra.backends.push_back(a->ucx);
    return a->agent->deregisterMem(reg_list(addr, len, dev), &extra);
    ECXNIXL_GUARD_END
}

int32_t
ecxnixl_local_md(ecxnixl_agent *a, void *buf, size_t cap, size_t *len) {
    ECXNIXL_GUARD_BEGIN
    nixl_blob_t md;
    nixl_status_t st = a->agent->getLocalMD(md);
    if (st != NIXL_SUCCESS) return st;
    *len = md.size();
    if (md.size() > cap) return ECXNIXL_ERR_INVALID_PARAM;
    std::memcpy(buf, md.data(), md.size());
    return ECXNIXL_SUCCESS;
    ECXNIXL_GUARD_END
}

int32_t
ecxnixl_load_md(ecxnixl_agent *a, const void *md, size_t md_len, char *name, size_t cap,
                size_t *name_len) {
    ECXNIXL_GUARD_BEGIN
    std::string out;
    nixl_status_t st =
        a->agent->loadRemoteMD(nixl_blob_t(static_cast<const char *>(md), md_len), out);
    *name_len = out.size();
    std::memcpy(name, out.data(), out.size() < cap ? out.size() : cap);
    return st;
    ECXNIXL_GUARD_END
}

int32_t
ecxnixl_invalidate(ecxnixl_agent *a, const char *name, size_t name_len) {
    ECXNIXL_GUARD_BEGIN
    return a->agent->invalidateRemoteMD(std::string(name, name_len));
    ECXNIXL_GUARD_END
}

int32_t
ecxnixl_prep_dlist(ecxnixl_agent *a, const char *peer, size_t peer_len, const uint64_t *addr,
                   const uint64_t *len, const uint64_t *dev, size_t n, ecxnixl_dlist **out) {
    *out = nullptr;
    ECXNIXL_GUARD_BEGIN
    nixl_xfer_dlist_t l(DRAM_SEG);
    l.reserve(n);
    for (size_t i = 0; i < n; i++)
        l.addDesc(nixlBasicDesc(static_cast<uintptr_t>(addr[i]), static_cast<size_t>(len[i]),
                                dev[i]));
    nixl_opt_args_t extra;
    extra.backends.push_back(a->ucx);
    nixlDlistH *h = nullptr;
    const std::string who = peer_len == 0 ? std::string(NIXL_INIT_AGENT) :
                                            std::string(peer, peer_len);
    nixl_status_t st = a->agent->prepXferDlist(who, l, h, &extra);
    if (st != NIXL_SUCCESS) return st;
    auto *d = new ecxnixl_dlist();
    d->h = h;
    a->dlists.insert(d);
    *out = d;
    return ECXNIXL_SUCCESS;
    ECXNIXL_GUARD_END
}

int32_t
ecxnixl_release_dlist(ecxnixl_agent *a, ecxnixl_dlist *d) {
    ECXNIXL_GUARD_BEGIN
    if (a->dlists.erase(d) == 0) return ECXNIXL_ERR_NOT_FOUND;
    nixl_status_t st = a->agent->releasedDlistH(d->h);
    delete d;
    return st;
    ECXNIXL_GUARD_END
}

int32_t
ecxnixl_post(ecxnixl_agent *a, int32_t op, ecxnixl_dlist *local, const int32_t *lidx,
             ecxnixl_dlist *remote, const int32_t *ridx, size_t n, const void *notif,
             size_t notif_len, ecxnixl_req **out) {
    *out = nullptr;
    ECXNIXL_GUARD_BEGIN
    if (op != ECXNIXL_OP_READ && op != ECXNIXL_OP_WRITE) return ECXNIXL_ERR_INVALID_PARAM;
    std::vector<int> li(lidx, lidx + n), ri(ridx, ridx + n);
    nixl_opt_args_t extra;
    extra.backends.push_back(a->ucx);
    if (notif_len > 0) {
        extra.notifMsg.assign(static_cast<const char *>(notif), notif_len);
        extra.hasNotif = true;
    }
    nixlXferReqH *h = nullptr;
    nixl_status_t st = a->agent->makeXferReq(op == ECXNIXL_OP_READ ? NIXL_READ : NIXL_WRITE,
                                             local->h, li, remote->h, ri, h, &extra);
    if (st != NIXL_SUCCESS) return st;
    st = a->agent->postXferReq(h);
    if (st < 0) {
        a->agent->releaseXferReq(h);
        return st;
    }
    auto *r = new ecxnixl_req();
    r->h = h;
    a->reqs.insert(r);
    *out = r;
    return st;
    ECXNIXL_GUARD_END
}

int32_t
ecxnixl_status(ecxnixl_agent *a, ecxnixl_req *const *reqs, int32_t *st, size_t n) {
    ECXNIXL_GUARD_BEGIN
    int32_t done = 0;
    for (size_t i = 0; i < n; i++) {
        st[i] = a->agent->getXferStatus(reqs[i]->h);
        if (st[i] != NIXL_IN_PROG) done++;
    }
    return done;
    ECXNIXL_GUARD_END
}

int32_t
ecxnixl_release_req(ecxnixl_agent *a, ecxnixl_req *r) {
    ECXNIXL_GUARD_BEGIN
    if (a->reqs.erase(r) == 0) return ECXNIXL_ERR_NOT_FOUND;
    nixl_status_t st = a->agent->releaseXferReq(r->h);
    delete r;
    return st;
    ECXNIXL_GUARD_END
}

int32_t
ecxnixl_notifs(ecxnixl_agent *a, void *buf, size_t cap, size_t *used, size_t *count) {
    *used = 0;
    *count = 0;
    ECXNIXL_GUARD_BEGIN
    nixl_status_t st = a->agent->getNotifs(a->scratch);
    for (auto &kv : a->scratch) {
        for (auto &msg : kv.second)
            a->queued.emplace_back(kv.first, std::move(msg));
    }
    a->scratch.clear();
    auto *p = static_cast<unsigned char *>(buf);
    size_t off = 0;
    while (!a->queued.empty()) {
        const auto &n = a->queued.front();
        size_t sz = record_size(n);
        if (off + sz > cap) {
            if (off == 0) {
                *used = sz;
                return ECXNIXL_ERR_INVALID_PARAM;
            }
            break;
        }
        uint32_t hl = static_cast<uint32_t>(n.first.size());
        uint32_t ml = static_cast<uint32_t>(n.second.size());
        std::memcpy(p + off, &hl, 4);
        std::memcpy(p + off + 4, &ml, 4);
        std::memcpy(p + off + 8, n.first.data(), hl);
        std::memcpy(p + off + 8 + hl, n.second.data(), ml);
        off += sz;
        (*count)++;
        a->queued.pop_front();
    }
    *used = off;
    return st < 0 ? st : ECXNIXL_SUCCESS;
    ECXNIXL_GUARD_END
}

int32_t
ecxnixl_send_notif(ecxnixl_agent *a, const char *peer, size_t peer_len, const void *msg,
                   size_t msg_len) {
    ECXNIXL_GUARD_BEGIN
    nixl_opt_args_t extra;
    extra.backends.push_back(a->ucx);
    return a->agent->genNotif(std::string(peer, peer_len),
                              nixl_blob_t(static_cast<const char *>(msg), msg_len), &extra);
    ECXNIXL_GUARD_END
}

} // extern "C"
