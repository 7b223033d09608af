// ecx_post_read_py: ecx_post_read for index lists that are Python lists or
// tuples of ints, as vLLM passes them, read in C with the GIL held.
//
// Converting two lists of 880 ints to int64 with struct.pack costs 25-30
// µs when their int objects are out of the cache, as they are after a READ
// has moved megabytes: CPython touches every object three times (the
// argument tuple's references in and out, and the value) and one at a
// time. Here each object is read once, a batch of them fetched ahead.
//
// The library does not link against Python. The Python package hands it
// the interpreter's own functions (ctypes.pythonapi, all of the stable
// ABI) with ecx_py_api, and only on a CPython whose objects start with
// two words, the second the type (not a free-threaded build, nor one with
// Py_TRACE_REFS). This file calls Python only from ecx_post_read_py,
// which the package calls through a ctypes.PyDLL, so with the GIL held:
// no other thread changes the lists while they are read, and nothing here
// runs Python code (only exact ints are read; an int subclass could run
// __index__). Anything else returns ECX_UNPACKED, and the package takes
// its general path, which says what is wrong with the lists. The GIL is
// released around the post itself.

#include <stdint.h>
#include <stdlib.h>

#include "_cgo_export.h"

// ECX_UNPACKED is codeUnpacked in codes.go.
#define ECX_UNPACKED (-18)

typedef intptr_t py_ssize;

struct py_head {
	py_ssize refcnt;
	void *type;
};

enum { PY_FNS = 12 };

static struct {
	py_ssize (*list_size)(void *);
	void *(*list_item)(void *, py_ssize);
	py_ssize (*tuple_size)(void *);
	void *(*tuple_item)(void *, py_ssize);
	long long (*as_long_long)(void *);
	void *(*err_occurred)(void);
	void (*err_clear)(void);
	void *(*save_thread)(void);
	void (*restore_thread)(void *);
	void *list_type, *tuple_type, *int_type;
} py;

static int py_ready;

// ecx_py_api installs, in this order: PyList_Size, PyList_GetItem,
// PyTuple_Size, PyTuple_GetItem, PyLong_AsLongLong, PyErr_Occurred,
// PyErr_Clear, PyEval_SaveThread, PyEval_RestoreThread, and the addresses
// of the types list, tuple and int. It returns 0, or -16 (bad argument:
// n is not 12 or a pointer is NULL; nothing is installed then). Call it
// once, before the first ecx_post_read_py, from the interpreter whose
// functions they are.
int ecx_py_api(void *const *fns, int64_t n)
{
	if (fns == NULL || n != PY_FNS)
		return -16;
	for (int i = 0; i < PY_FNS; i++)
		if (fns[i] == NULL)
			return -16;
	py.list_size = (py_ssize (*)(void *))fns[0];
	py.list_item = (void *(*)(void *, py_ssize))fns[1];
	py.tuple_size = (py_ssize (*)(void *))fns[2];
	py.tuple_item = (void *(*)(void *, py_ssize))fns[3];
	py.as_long_long = (long long (*)(void *))fns[4];
	py.err_occurred = (void *(*)(void))fns[5];
	py.err_clear = (void (*)(void))fns[6];
	py.save_thread = (void *(*)(void))fns[7];
	py.restore_thread = (void (*)(void *))fns[8];
	py.list_type = fns[9];
	py.tuple_type = fns[10];
	py.int_type = fns[11];
	py_ready = 1;
	return 0;
}

// seq_len stores the length of a list or tuple (exactly those types) and
// whether it is a list; it returns 0 for anything else.
static int seq_len(void *seq, int64_t *n, int *is_list)
{
	if (seq == NULL)
		return 0;
	void *type = ((struct py_head *)seq)->type;
	py_ssize len;
	if (type == py.list_type) {
		len = py.list_size(seq);
		*is_list = 1;
	} else if (type == py.tuple_type) {
		len = py.tuple_size(seq);
		*is_list = 0;
	} else {
		return 0;
	}
	if (len < 0) {
		py.err_clear();
		return 0;
	}
	*n = len;
	return 1;
}

enum { BATCH = 32 };

// pack reads the n ints of seq into out: 0, or ECX_UNPACKED at the first
// item that is not an exact int in int64's range (with no Python error
// left set).
static int64_t pack(void *seq, int is_list, int64_t n, int64_t *out)
{
	void *ob[BATCH];
	for (int64_t i = 0; i < n; i += BATCH) {
		int m = n - i < BATCH ? (int)(n - i) : BATCH;
		// The item pointers are in the sequence's own array; the objects
		// are wherever CPython allocated them. Ask for a batch of them
		// (both halves: a 32-byte object may straddle two cache lines)
		// before reading the first.
		for (int j = 0; j < m; j++) {
			void *o = is_list ? py.list_item(seq, i + j) : py.tuple_item(seq, i + j);
			if (o == NULL) {
				py.err_clear();
				return ECX_UNPACKED;
			}
			ob[j] = o;
			__builtin_prefetch(o);
			__builtin_prefetch((char *)o + 31);
		}
		for (int j = 0; j < m; j++) {
			if (((struct py_head *)ob[j])->type != py.int_type)
				return ECX_UNPACKED;
			long long v = py.as_long_long(ob[j]);
			if (v == -1 && py.err_occurred() != NULL) {
				py.err_clear(); // OverflowError: the general path raises its own
				return ECX_UNPACKED;
			}
			out[i + j] = v;
		}
	}
	return 0;
}

// STACK_IDX indices of both lists together are read onto the stack (vLLM's
// encodings of up to a few thousand blocks); longer ones into malloc'd
// memory.
enum { STACK_IDX = 2048 };

// ecx_post_read_py is ecx_post_read with the lists local and remote
// (PyObject pointers) read here: it returns the handle (> 0), a negative
// code from ecx_post_read, or ECX_UNPACKED when the library has no Python
// functions (see ecx_py_api), the lists' lengths differ, or a list is not
// a list or tuple of exact ints in int64's range, before anything is
// posted. The caller holds the GIL; it is released for the post.
int64_t ecx_post_read_py(uint64_t t, void *local, uint64_t peer, void *remote, void *notif, int64_t notif_len)
{
	int64_t nl, nr;
	int ll, rl;
	// Lists whose lengths differ go back too: the package raises vLLM's
	// "mismatch" ValueError for them (they may have changed since it
	// compared them, in a __str__ or another thread).
	if (!py_ready || !seq_len(local, &nl, &ll) || !seq_len(remote, &nr, &rl) || nl != nr)
		return ECX_UNPACKED;
	int64_t stack[STACK_IDX];
	int64_t *buf = stack;
	if (nl + nr > STACK_IDX) {
		buf = malloc((size_t)(nl + nr) * sizeof(int64_t));
		if (buf == NULL)
			return ECX_UNPACKED;
	}
	int64_t rc = pack(local, ll, nl, buf);
	if (rc == 0)
		rc = pack(remote, rl, nr, buf + nl);
	if (rc == 0) {
		void *ts = py.save_thread();
		rc = ecx_post_read(t, buf, nl, peer, buf + nl, nr, notif, notif_len);
		py.restore_thread(ts);
	}
	if (buf != stack)
		free(buf);
	return rc;
}
