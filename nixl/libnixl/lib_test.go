package libnixl

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecxfer/ecxfer/nixl"
)

// These tests run everywhere: they exercise the paths taken when the
// library is missing or unusable.

func TestNotInstalledExplicitPath(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "nope", LibName)
	_, err := New(Config{Name: "a", LibPath: missing})
	require.ErrorIs(t, err, ErrNotInstalled)
	require.NotErrorIs(t, err, ErrBadLibrary)
	msg := err.Error()
	require.Contains(t, msg, missing, "the message names what was tried")
	require.Contains(t, msg, "make nixl", "the message says how to build it")
}

func TestNotInstalledEnv(t *testing.T) {
	missing := filepath.Join(t.TempDir(), LibName)
	t.Setenv(EnvLib, missing)
	_, err := New(Config{Name: "a"})
	require.ErrorIs(t, err, ErrNotInstalled)
	require.Contains(t, err.Error(), missing)
	require.ErrorIs(t, Available(), ErrNotInstalled)
}

func TestNotInstalledSearch(t *testing.T) {
	prefix := t.TempDir()
	t.Setenv(EnvLib, "")
	t.Setenv(EnvPrefix, prefix)
	t.Setenv(EnvVenv, "")
	t.Chdir(prefix)                 // away from the project's .venv
	t.Setenv("LD_LIBRARY_PATH", "") // read by the loader at startup only; harmless
	err := Available()
	if err == nil {
		t.Skip("a " + LibName + " is on the loader path of this machine")
	}
	require.ErrorIs(t, err, ErrNotInstalled)
	msg := err.Error()
	require.Contains(t, msg, filepath.Join(prefix, "lib", "ecxfer", LibName))
	require.Contains(t, msg, filepath.Join(prefix, "lib", LibName))
	require.Contains(t, msg, "loader path")
	require.Contains(t, msg, "no usable "+ProjectVenv+" in", "the message says no project .venv was found")
}

func TestCandidates(t *testing.T) {
	t.Setenv(EnvLib, "")
	t.Setenv(EnvPrefix, "/opt/nixl")
	t.Setenv(EnvVenv, "/srv/venv")
	// A project tree with its .venv, entered two levels down.
	root := t.TempDir()
	sub := filepath.Join(root, "a", "b")
	require.NoError(t, os.MkdirAll(sub, 0o755))
	require.NoError(t, os.Mkdir(filepath.Join(root, ProjectVenv), 0o755))
	t.Chdir(sub)
	c := candidates("")
	require.Equal(t, "/opt/nixl/lib/ecxfer/"+LibName, c[0])
	require.Equal(t, "/opt/nixl/lib/"+LibName, c[1])
	iPrefix := slices.Index(c, "/opt/nixl/lib64/"+LibName)
	iVenv := slices.Index(c, "/srv/venv/lib/ecxfer/"+LibName)
	iProject := slices.Index(c, filepath.Join(root, ProjectVenv, "lib", "ecxfer", LibName))
	require.True(t, iPrefix >= 0 && iVenv > iPrefix && iProject > iVenv,
		"order: NIXL_PREFIX, VIRTUAL_ENV, the project's .venv: %q", c)
	require.Equal(t, LibName, c[len(c)-1])
	require.Equal(t, len(c)-2, iProject)
	require.Equal(t, []string{"/x/y.so"}, candidates("/x/y.so"))
	t.Setenv(EnvLib, "/env/lib.so")
	require.Equal(t, []string{"/env/lib.so"}, candidates(""))
	require.Equal(t, []string{"/x/y.so"}, candidates("/x/y.so"), "Config.LibPath wins over the environment")
}

func TestNotALibrary(t *testing.T) {
	paths := []string{filepath.Join(t.TempDir(), LibName)}
	require.NoError(t, os.WriteFile(paths[0], []byte("just text\n"), 0o644))
	if _, err := os.Stat("/etc/hostname"); err == nil {
		paths = append(paths, "/etc/hostname")
	}
	for _, p := range paths {
		_, err := New(Config{Name: "a", LibPath: p})
		require.ErrorIs(t, err, ErrBadLibrary, p)
		require.NotErrorIs(t, err, ErrNotInstalled, p)
		require.Contains(t, err.Error(), p)
	}
}

// buildSO compiles C source into a shared library in a temporary directory,
// skipping the test when no C compiler is available.
func buildSO(t *testing.T, src string) string {
	t.Helper()
	cc, err := exec.LookPath("gcc")
	if err != nil {
		if cc, err = exec.LookPath("cc"); err != nil {
			t.Skip("no C compiler")
		}
	}
	dir := t.TempDir()
	c := filepath.Join(dir, "fake.c")
	so := filepath.Join(dir, LibName)
	require.NoError(t, os.WriteFile(c, []byte(src), 0o644))
	out, err := exec.Command(cc, "-shared", "-fPIC", "-o", so, c).CombinedOutput()
	require.NoError(t, err, "%s", out)
	return so
}

func TestMissingSymbol(t *testing.T) {
	so := buildSO(t, `
#include <stdint.h>
uint32_t ecxnixl_abi_version(void) { return 1; }
`)
	_, err := New(Config{Name: "a", LibPath: so})
	require.ErrorIs(t, err, ErrBadLibrary)
	require.Contains(t, err.Error(), "symbol ecxnixl_check_nixl is missing", "the message names the missing symbol")
	require.Contains(t, err.Error(), so)
	requireMapped(t, so)
}

// allSymbols defines every symbol of the ABI; the functions fail.
const allSymbols = `
#include <stddef.h>
#include <stdint.h>
int32_t ecxnixl_agent_create(const char *n, size_t nl, const char *p, size_t pl, void **out,
                             char *e, size_t ec) {
    *out = 0;
    if (ec > 10) { e[0] = 'n'; e[1] = 'o'; e[2] = ' '; e[3] = 'U'; e[4] = 'C'; e[5] = 'X'; e[6] = 0; }
    return -9;
}
void ecxnixl_agent_destroy(void *a) {}
int32_t ecxnixl_mem_register(void) { return -8; }
int32_t ecxnixl_mem_deregister(void) { return -8; }
int32_t ecxnixl_local_md(void) { return -8; }
int32_t ecxnixl_load_md(void) { return -8; }
int32_t ecxnixl_invalidate(void) { return -8; }
int32_t ecxnixl_prep_dlist(void) { return -8; }
int32_t ecxnixl_release_dlist(void) { return -8; }
int32_t ecxnixl_post(void) { return -8; }
int32_t ecxnixl_status(void) { return -8; }
int32_t ecxnixl_release_req(void) { return -8; }
int32_t ecxnixl_notifs(void) { return -8; }
int32_t ecxnixl_send_notif(void) { return -8; }
`

// nixlOK is the version check of a shim over the right NIXL release.
const nixlOK = `
int32_t ecxnixl_check_nixl(char *f, size_t fc, char *e, size_t ec) { if (fc) f[0] = 0; return 0; }
`

func TestABIMismatch(t *testing.T) {
	so := buildSO(t, allSymbols+nixlOK+`uint32_t ecxnixl_abi_version(void) { return 999; }`)
	_, err := New(Config{Name: "a", LibPath: so})
	require.ErrorIs(t, err, ErrBadLibrary)
	require.Contains(t, err.Error(), "ABI version 999")
	requireMapped(t, so)
}

// requireMapped checks that the library at path is still mapped in this
// process: one that failed a check after dlopen loaded it (with NIXL's
// C++ libraries, in the real case) is not unloaded.
func requireMapped(t *testing.T, path string) {
	t.Helper()
	maps, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	require.Contains(t, string(maps), path, "the library was unloaded after failing its check")
}

func TestAgentCreateFails(t *testing.T) {
	so := buildSO(t, allSymbols+nixlOK+abiCurrent())
	_, err := New(Config{Name: "a", LibPath: so})
	require.ErrorIs(t, err, nixl.ErrNotSupported, "the raw status becomes its nixl error")
	require.Contains(t, err.Error(), "no UCX", "the shim's message is kept")
	var ne *nixl.Error
	require.True(t, errors.As(err, &ne))
}

// abiCurrent defines ecxnixl_abi_version returning this build's version.
func abiCurrent() string {
	return fmt.Sprintf("uint32_t ecxnixl_abi_version(void) { return %d; }\n", ABIVersion())
}

// A shim over another NIXL release (or one whose release cannot be told)
// is refused with the shim's own message.
func TestNIXLVersionMismatch(t *testing.T) {
	so := buildSO(t, allSymbols+abiCurrent()+`
#include <stdio.h>
int32_t ecxnixl_check_nixl(char *f, size_t fc, char *e, size_t ec) {
    snprintf(f, fc, "1.4.0");
    snprintf(e, ec, "libnixl_capi.so is NIXL 1.4.0, but the shim is written for NIXL 1.5.1 exactly");
    return -5;
}
`)
	_, err := New(Config{Name: "a", LibPath: so})
	require.ErrorIs(t, err, ErrBadLibrary)
	require.NotErrorIs(t, err, ErrNotInstalled)
	require.Contains(t, err.Error(), "NIXL 1.4.0")
	require.Contains(t, err.Error(), so)
}

func TestConfigValidation(t *testing.T) {
	for _, cfg := range []Config{
		{},
		{Name: strings.Repeat("x", maxNameLen+1)},
		{Name: "a", MaxNotif: -1},
		{Name: "a", BackendParams: map[string]string{"a=b": "c"}},
		{Name: "a", BackendParams: map[string]string{"k": "line\nbreak"}},
	} {
		_, err := New(cfg)
		require.ErrorIs(t, err, nixl.ErrInvalidParam)
	}
	t.Setenv(EnvParams, "no-equals-sign")
	_, err := New(Config{Name: "a"})
	require.ErrorIs(t, err, nixl.ErrInvalidParam)
	require.Contains(t, err.Error(), EnvParams)
}

// The search for a project .venv climbs into directories other users may
// write to (a working directory under /tmp): a .venv there that belongs
// to another user, or that every user may write, is skipped, and its
// library is never opened (opening it would run its constructor here).
func TestProjectVenvOfOtherUserSkipped(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to give a directory to another user")
	}
	shared := t.TempDir() // stands in for /tmp
	marker := filepath.Join(shared, "constructor-ran")
	dir := filepath.Join(shared, ProjectVenv, "lib", "ecxfer")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	src := filepath.Join(shared, "planted.c")
	require.NoError(t, os.WriteFile(src, []byte(`#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
	FILE *f = fopen("`+marker+`", "w");
	if (f) { fputs("ran\n", f); fclose(f); }
}
`), 0o644))
	lib := filepath.Join(dir, LibName)
	if out, err := exec.Command("gcc", "-shared", "-fPIC", "-o", lib, src).CombinedOutput(); err != nil {
		t.Skipf("gcc: %v\n%s", err, out)
	}
	work := filepath.Join(shared, "job", "work")
	require.NoError(t, os.MkdirAll(work, 0o755))
	t.Chdir(work)
	t.Setenv(EnvLib, "")
	t.Setenv(EnvPrefix, "")
	t.Setenv(EnvVenv, "")
	venv := filepath.Join(shared, ProjectVenv)
	for _, c := range []struct {
		name  string
		setup func()
	}{
		{"other user's .venv", func() { require.NoError(t, os.Chown(venv, 65534, 65534)) }},
		{"other user's library", func() { require.NoError(t, os.Chown(lib, 65534, 65534)) }},
		{"world-writable lib/ecxfer", func() { require.NoError(t, os.Chmod(dir, 0o777)) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, p := range []string{venv, filepath.Dir(dir), dir, lib} {
				require.NoError(t, os.Chown(p, 0, 0))
			}
			require.NoError(t, os.Chmod(dir, 0o755))
			c.setup()
			require.NotContains(t, candidates(""), lib)
			_, err := load("")
			require.Error(t, err)
			require.Contains(t, err.Error(), venv+" skipped", "the error says which .venv was skipped and why")
			_, statErr := os.Stat(marker)
			require.True(t, os.IsNotExist(statErr), "the planted library was opened and ran its constructor")
		})
	}
	// The same tree, owned by root and not writable by others, is this
	// user's (root's) own: it is a candidate.
	require.NoError(t, os.Chown(venv, 0, 0))
	require.NoError(t, os.Chown(lib, 0, 0))
	require.NoError(t, os.Chmod(dir, 0o755))
	require.Contains(t, candidates(""), lib)
}

// A project .venv that is a symbolic link to this user's own virtual
// environment is taken: a link's own mode (always rwxrwxrwx) is not held
// against it, its owner and its target's are checked.
func TestProjectVenvOwnSymlink(t *testing.T) {
	root := t.TempDir()
	real := filepath.Join(root, "venvs", "ecxfer")
	lib := filepath.Join(real, "lib", "ecxfer", LibName)
	require.NoError(t, os.MkdirAll(filepath.Dir(lib), 0o755))
	require.NoError(t, os.WriteFile(lib, []byte("x"), 0o644))
	proj := filepath.Join(root, "proj")
	require.NoError(t, os.MkdirAll(proj, 0o755))
	require.NoError(t, os.Symlink(real, filepath.Join(proj, ProjectVenv)))
	t.Chdir(proj)
	t.Setenv(EnvLib, "")
	t.Setenv(EnvPrefix, "")
	t.Setenv(EnvVenv, "")
	v, skipped := projectVenv()
	require.Equal(t, filepath.Join(proj, ProjectVenv), v, "skipped: %q", skipped)
	// Its target writable by every user: skipped.
	require.NoError(t, os.Chmod(filepath.Dir(lib), 0o777))
	v, skipped = projectVenv()
	require.Empty(t, v)
	require.Len(t, skipped, 1)
	require.Contains(t, skipped[0], "writable by every user")
}
