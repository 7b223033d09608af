package libnixl

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "dl.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"unsafe"
)

// LibName is the file name of the shim library `make nixl` builds.
const LibName = "libecxnixl.so"

// Environment variables that locate the library.
const (
	// EnvLib names the library file to load; it overrides the search.
	EnvLib = "ECXFER_NIXL_LIB"
	// EnvPrefix is a prefix the shim was built into: a virtual
	// environment holding NIXL's wheel (`make nixl NIXL_VENV=<prefix>`
	// puts it in <prefix>/lib/ecxfer), or a prefix with it in lib/.
	EnvPrefix = "NIXL_PREFIX"
	// EnvVenv is the active Python virtual environment, where
	// `make nixl NIXL_VENV=$VIRTUAL_ENV` puts the shim (lib/ecxfer).
	EnvVenv = "VIRTUAL_ENV"
	// EnvParams holds UCX backend parameters for agents whose
	// Config.BackendParams is nil: "key=value,key=value".
	EnvParams = "ECXFER_NIXL_PARAMS"
)

// ProjectVenv is the project's virtual environment directory, looked for
// in the working directory and its parents.
const ProjectVenv = ".venv"

// shimDir is where `make nixl` puts the library inside a prefix.
var shimDir = filepath.Join("lib", "ecxfer")

// RequireEnv names the environment variable that, set to 1, makes tests
// that need the library fail instead of skipping when it does not load
// (for machines where NIXL is meant to be installed).
const RequireEnv = "ECXFER_REQUIRE_NIXL"

// ErrNotInstalled reports that the shim library was found nowhere.
var ErrNotInstalled = errors.New("libnixl: the NIXL engine library (" + LibName + ") is not installed")

// ErrBadLibrary reports a library file that exists but cannot be used: not
// a shared library, a dependency (NIXL itself) missing, a symbol of the ABI
// missing, or another ABI version.
var ErrBadLibrary = errors.New("libnixl: the NIXL engine library cannot be used")

const buildHint = `"make nixl" in ecxfer's tree installs NIXL's wheel into its .venv and builds the library there; ` +
	`for another virtual environment holding the wheel, "make nixl NIXL_VENV=<venv>", then run with ` +
	EnvVenv + ` or ` + EnvPrefix + ` set to it (or ` + EnvLib + ` to the library file)`

// lib is one loaded library. Loaded libraries are never unloaded.
type lib struct {
	path string
	c    *C.ecx_dl_t
}

var (
	libMu  sync.Mutex
	loaded = map[string]*lib{}
)

// multiarch is Debian's library subdirectory for this architecture.
func multiarch() string {
	switch runtime.GOARCH {
	case "amd64":
		return "x86_64-linux-gnu"
	case "arm64":
		return "aarch64-linux-gnu"
	}
	return ""
}

// candidates lists where to look for the library, in order. explicit (or
// else $ECXFER_NIXL_LIB) is the only candidate when set. Then come
// $NIXL_PREFIX, $VIRTUAL_ENV, the project's .venv (the nearest one from
// the working directory up) and last the dynamic loader's own search.
func candidates(explicit string) []string {
	if explicit != "" {
		return []string{explicit}
	}
	if p := os.Getenv(EnvLib); p != "" {
		return []string{p}
	}
	var c []string
	if pre := os.Getenv(EnvPrefix); pre != "" {
		c = append(c, filepath.Join(pre, shimDir, LibName), filepath.Join(pre, "lib", LibName))
		if m := multiarch(); m != "" {
			c = append(c, filepath.Join(pre, "lib", m, LibName))
		}
		c = append(c, filepath.Join(pre, "lib64", LibName))
	}
	if v := os.Getenv(EnvVenv); v != "" {
		c = append(c, filepath.Join(v, shimDir, LibName))
	}
	if v, _ := projectVenv(); v != "" {
		c = append(c, filepath.Join(v, shimDir, LibName))
	}
	// Last, the dynamic loader's own search (LD_LIBRARY_PATH, ld.so.cache).
	return append(c, LibName)
}

// projectVenv returns the nearest .venv directory from the working
// directory up that this process may trust, or "". The search climbs into
// directories other users can write to (a working directory under /tmp),
// so a .venv is skipped unless it, its lib/ecxfer directories and the
// library in it belong to this user or root and are not writable by every
// user (see trusted; a group may write them: Debian's per-user groups do): a library planted there would run its code in this
// process the moment it is opened.
// The reasons for the ones skipped on the way come back too.
func projectVenv() (string, []string) {
	dir, err := os.Getwd()
	if err != nil {
		return "", nil
	}
	var skipped []string
	for {
		v := filepath.Join(dir, ProjectVenv)
		if fi, err := os.Stat(v); err == nil && fi.IsDir() {
			err := venvTrusted(v)
			if err == nil {
				return v, skipped
			}
			skipped = append(skipped, fmt.Sprintf("%s skipped (%v)", v, err))
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", skipped
		}
		dir = parent
	}
}

// venvTrusted reports why the library of venv v may not be trusted, or nil:
// v, v/lib, v/lib/ecxfer and the library (those of them that exist) must
// each be owned by this process's user or root and not writable by every
// user, and so must what a symbolic link among them points to (the link
// itself only owned so).
func venvTrusted(v string) error {
	p := v
	for _, part := range append(strings.Split(shimDir, string(filepath.Separator)), LibName) {
		if err := trusted(p); err != nil {
			return err
		}
		p = filepath.Join(p, part)
	}
	return trusted(p)
}

// trusted checks one path and, when it is a symbolic link, its target; a
// path that does not exist is no objection.
func trusted(p string) error {
	euid := uint32(os.Geteuid())
	check := func(fi os.FileInfo) error {
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("%s: no owner to check", p)
		}
		if st.Uid != euid && st.Uid != 0 {
			return fmt.Errorf("%s belongs to uid %d, not to this user or root", p, st.Uid)
		}
		// A link's own mode is always rwxrwxrwx and means nothing: only
		// its owner (who may repoint it) and its target's mode count.
		if fi.Mode()&os.ModeSymlink == 0 && fi.Mode().Perm()&0o002 != 0 {
			return fmt.Errorf("%s is writable by every user", p)
		}
		return nil
	}
	fi, err := os.Lstat(p)
	if err != nil {
		return nil
	}
	if err := check(fi); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		return err
	}
	if fi, err = os.Stat(p); err != nil {
		return nil
	}
	return check(fi)
}

// load finds and opens the library. Successes are cached per path.
func load(explicit string) (*lib, error) {
	libMu.Lock()
	defer libMu.Unlock()
	var tried []string
	for _, path := range candidates(explicit) {
		if l := loaded[path]; l != nil {
			return l, nil
		}
		if strings.ContainsRune(path, '/') {
			if _, err := os.Stat(path); err != nil {
				tried = append(tried, fmt.Sprintf("%s (%v)", path, errors.Unwrap(err)))
				continue
			}
		}
		l, why, msg := open(path)
		if l != nil {
			loaded[path] = l
			return l, nil
		}
		if why == C.ECX_DL_OPEN && !strings.ContainsRune(path, '/') &&
			strings.Contains(msg, "No such file") {
			tried = append(tried, fmt.Sprintf("%s on the loader path (not found)", path))
			continue
		}
		switch why {
		case C.ECX_DL_SYMBOL:
			return nil, fmt.Errorf("%w: %s: %s (stale or foreign library; rebuild it: %s)", ErrBadLibrary, path, msg, buildHint)
		case C.ECX_DL_ABI:
			return nil, fmt.Errorf("%w: %s: %s (rebuild it: %s)", ErrBadLibrary, path, msg, buildHint)
		case C.ECX_DL_NIXL:
			return nil, fmt.Errorf("%w: %s: %s", ErrBadLibrary, path, msg)
		}
		return nil, fmt.Errorf("%w: %s: %s", ErrBadLibrary, path, msg)
	}
	if explicit == "" && os.Getenv(EnvLib) == "" {
		if v, skipped := projectVenv(); v == "" {
			wd, _ := os.Getwd()
			tried = append(tried, skipped...)
			tried = append(tried, fmt.Sprintf("no usable %s in %s or above", ProjectVenv, wd))
		}
	}
	return nil, fmt.Errorf("%w: tried %s; %s", ErrNotInstalled, strings.Join(tried, ", "), buildHint)
}

func open(path string) (*lib, C.int, string) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	const errCap = 1024
	ebuf := (*C.char)(C.malloc(errCap))
	defer C.free(unsafe.Pointer(ebuf))
	var why C.int
	c := C.ecx_dl_open(cpath, &why, ebuf, errCap)
	if c == nil {
		return nil, why, C.GoString(ebuf)
	}
	return &lib{path: path, c: c}, 0, ""
}

// ABIVersion is the version of the C ABI (ecxnixl.h) this package speaks;
// a library speaking another is refused with ErrBadLibrary.
func ABIVersion() uint32 { return C.ECXNIXL_ABI_VERSION }

// abiVersion asks a loaded library for its ABI version.
func (l *lib) abiVersion() uint32 { return uint32(C.ecx_dl_abi_version(l.c)) }

// nixlVersion asks a loaded library which NIXL release it runs on (the
// version of the wheel's metadata beside NIXL's libraries) and whether that
// is the one it was written for.
func (l *lib) nixlVersion() (string, error) {
	const cp = 1024
	found := (*C.char)(C.malloc(cp))
	defer C.free(unsafe.Pointer(found))
	ebuf := (*C.char)(C.malloc(cp))
	defer C.free(unsafe.Pointer(ebuf))
	*found, *ebuf = 0, 0
	if st := C.ecx_dl_check_nixl(l.c, found, cp, ebuf, cp); st != 0 {
		return C.GoString(found), fmt.Errorf("%w: %s: %s", ErrBadLibrary, l.path, C.GoString(ebuf))
	}
	return C.GoString(found), nil
}

// Available reports whether the NIXL engine can be used here: nil when the
// library loads (from $ECXFER_NIXL_LIB, or found through $NIXL_PREFIX,
// $VIRTUAL_ENV, the project's .venv or the dynamic loader's path), else an
// error wrapping ErrNotInstalled or ErrBadLibrary that says what was
// tried.
func Available() error {
	_, err := load("")
	return err
}
