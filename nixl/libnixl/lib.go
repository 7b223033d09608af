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
	"unsafe"
)

// LibName is the file name of the shim library `make nixl` builds.
const LibName = "libecxnixl.so"

// Environment variables that locate the library.
const (
	// EnvLib names the library file to load; it overrides the search.
	EnvLib = "ECXFER_NIXL_LIB"
	// EnvPrefix is NIXL's install prefix; the library is looked for next
	// to NIXL's own libraries there.
	EnvPrefix = "NIXL_PREFIX"
	// EnvParams holds UCX backend parameters for agents whose
	// Config.BackendParams is nil: "key=value,key=value".
	EnvParams = "ECXFER_NIXL_PARAMS"
)

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

const buildHint = `build it where NIXL is installed with "make nixl NIXL_PREFIX=/path/to/nixl", ` +
	`then set ` + EnvPrefix + ` (or ` + EnvLib + ` to the library file)`

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
// else $ECXFER_NIXL_LIB) is the only candidate when set.
func candidates(explicit string) []string {
	if explicit != "" {
		return []string{explicit}
	}
	if p := os.Getenv(EnvLib); p != "" {
		return []string{p}
	}
	var c []string
	if pre := os.Getenv(EnvPrefix); pre != "" {
		c = append(c, filepath.Join(pre, "lib", LibName))
		if m := multiarch(); m != "" {
			c = append(c, filepath.Join(pre, "lib", m, LibName))
		}
		c = append(c, filepath.Join(pre, "lib64", LibName))
	}
	// Last, the dynamic loader's own search (LD_LIBRARY_PATH, ld.so.cache).
	return append(c, LibName)
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
		}
		return nil, fmt.Errorf("%w: %s: %s", ErrBadLibrary, path, msg)
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

// Available reports whether the NIXL engine can be used here: nil when the
// library loads (from $ECXFER_NIXL_LIB, or found through $NIXL_PREFIX or
// the dynamic loader's path), else an error wrapping ErrNotInstalled or
// ErrBadLibrary that says what was tried.
func Available() error {
	_, err := load("")
	return err
}
