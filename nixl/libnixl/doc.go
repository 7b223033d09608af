// Package libnixl is ecxfer's engine over the NIXL library itself: a
// nixl.Agent backed by one NIXL agent (UCX backend, DRAM), so that an
// ecxfer service and vLLM's Python NIXL agents load each other's metadata
// and read each other's blocks.
//
// # Loading
//
// NIXL is C++ and often not installed, so nothing here links against it.
// A small C ABI of our own (ecxnixl.h: opaque handles, nixl_status_t
// results, arrays in and out) is implemented by shim/ecxnixl.c in C on top
// of NIXL's C API (libnixl_capi.so, which NIXL's wheel ships; the shim's
// declarations of it are shim/nixlcapi.h). `make nixl` builds it into
// libecxnixl.so in a virtual environment holding the wheel (the project's
// .venv, filled by `make deps` from requirements-nixl.txt). New opens that
// library with dlopen and resolves every symbol (dl.c); Go calls them
// through small C trampolines. The library is taken from Config.LibPath,
// else $ECXFER_NIXL_LIB, else looked for under $NIXL_PREFIX, then
// $VIRTUAL_ENV, then the nearest .venv from the working directory up (one
// that belongs to this user or root, with its lib/ecxfer and the library,
// none of them writable by every user: a .venv another user left in /tmp
// is skipped), then on the dynamic loader's path. When it is found nowhere, New fails with
// ErrNotInstalled; when it exists but cannot be used (not a library, NIXL
// missing, a symbol missing, another ABI version, or a NIXL release other
// than the one nixlcapi.h is written for), with ErrBadLibrary. Available
// reports the same without creating an agent, so tests and callers can
// skip. The package therefore compiles and its tests run everywhere.
//
// The wheel brings its own UCX, newer than the system's that package
// nixl/ucx links, under private file names but with the same symbol
// names. The shim is opened with RTLD_DEEPBIND and loads NIXL's UCX
// plugin itself the same way, so the wheel's libraries bind to their own
// UCX; in a process that also holds the system UCX, the wheel's UCX loads
// only its cma module, which the shim loads first the same way; the
// others (InfiniBand) would bind to the system's UCX (see ecxnixl.c).
//
// # Driving NIXL
//
// The NIXL agent has no progress thread and thread-sync mode NONE: like
// every engine it is owned by one goroutine (the reactor's thread), and
// that goroutine's calls drive it. Progress checks every in-flight request
// with one call (NIXL's status check advances its UCX worker and sends the
// notification of a finished read); GetNotifs drains notifications with
// one call, progressing the worker even when nothing is in flight, which is
// what serves peers' reads of our memory. The shim hands notifications over
// as packed records (ecxnixl.h); each is bounds-checked before it is read,
// and records that do not parse are dropped and counted (DroppedNotifs,
// nixl.NotifDropper), as are messages longer than 1 MiB (MaxNotif's limit)
// or from a sender whose name is longer than 256 bytes, which the shim
// drops uncopied as NIXL hands them over. NIXL exposes no descriptor to
// sleep on, so EventFD is -1 and the reactor never sleeps longer than a
// millisecond.
//
// MakeXfer only checks indices and lengths; PostXfer makes and posts the
// NIXL request in one call.
//
// A request released while in flight (ReleaseXfer, or its peer
// invalidated) is not handed to NIXL's release, which would cancel it: with
// UCX 1.13 (the version this was found with; the wheel brings 1.23, where
// it was not tried again) a cancelled get stays on its endpoint until it
// completes, and closing that endpoint (invalidating the peer) or
// destroying the worker before then aborts the process in a UCX assertion. The request becomes a
// zombie instead: it is no longer reported, Progress keeps polling it and
// releases it once it has finished, so its data may still land and its
// notification may still be sent. A READ posted into local blocks a
// zombie READ may still write is held, in flight with nothing posted,
// until every such zombie has finished, so that the late data never lands
// on its bytes. An invalidated peer with zombies is
// forgotten by NIXL only after they finish; loading that peer again waits
// for them (at most two seconds, then fails with ErrBackend). One case
// escapes this: when a transfer finds its peer disconnected, NIXL itself
// invalidates the peer, and from then on reports every request to it as
// NOT_FOUND without asking the backend; a zombie reported so is taken as
// finished, released (NIXL cancels it if its backend still runs it) and
// its blocks unfenced. With NIXL's default of one UCX worker that is
// sound: the peer's only endpoint has failed, and UCX ended every get on
// it. With num_workers above 1 (ECXFER_NIXL_PARAMS, BackendParams) a get
// on another worker's endpoint may still run then, and its late data land
// on a READ posted after it. The same holds for a READ that ended in an
// error: NIXL reports a request failed as soon as one of its gets failed,
// keeps that answer, and cancels the gets still running when it is
// released, so its blocks are not fenced after it. A failed endpoint (the
// usual cause) has ended them all; a get refused alone (a remote access
// error, which the bounds checks at PrepDlist and MakeXfer keep this
// package's READs from) would leave the others running. Close gives
// in-flight requests two seconds, and if some are still running it leaves
// the NIXL agent and its memory in place rather than abort, and says so.
//
// # Metadata
//
// The metadata is NIXL's own blob, byte for byte, so Python agents load it
// unchanged. NIXL refuses a changed blob under a loaded name without saying
// which name; the nixl.Agent contract wants the name, so this package reads
// it from the blob (md.go), and also refuses a blob cut short before NIXL
// can half-load it. A transfer whose peer was invalidated ends as NOT_FOUND,
// which becomes nixl.ErrRemoteDisconnect. NIXL's C API folds every other
// error into BACKEND, REMOTE_DISCONNECT included, so a transfer whose peer
// process died ends in nixl.ErrBackend (ecxfer.ErrEngine at the top), not
// nixl.ErrRemoteDisconnect.
//
// Memory from AllocMem is an anonymous mapping registered with NIXL (NIXL
// allocates nothing itself).
package libnixl
