// The calls the Python package makes on every READ, as functions of the
// interpreter's own (METH_FASTCALL builtins), and index lists read in C.
//
// Through ctypes every call pays libffi and a conversion object per
// argument: about 0.7 µs of check_xfer_state's 0.95 here, and 1-1.5 µs
// of a one-block post_read's 3, more than the library spends on them. The
// builtins made here take their arguments as the interpreter passes them
// to any builtin, an array of object pointers, and read the ints with the
// interpreter's own functions.
//
// Lists: converting two lists of 880 ints to int64 with struct.pack costs
// 25-30 µs when their int objects are out of the cache, as they are after
// a READ has moved megabytes: CPython touches every object three times
// (the argument tuple's references in and out, and the value) and one at
// a time. Here each object is read once, a batch of them fetched ahead.
//
// The library does not link against Python. The Python package hands it
// the interpreter's own functions (ctypes.pythonapi, all of the stable
// ABI) and the few objects it needs with ecx_py_api, and only on a
// CPython whose objects start with two words, the second the type (not a
// free-threaded build, nor one with Py_TRACE_REFS). It then asks for the
// builtins with ecx_py_call through a ctypes.PyDLL, with the GIL held, and
// calls them as Python calls any builtin, with the GIL held: no other
// thread changes the lists while they are read, and nothing here runs
// Python code (only exact ints, lists, tuples, bytes, dicts and strs are
// read; an int subclass could run __index__, a str subclass __eq__). The
// GIL is released around every call into the library proper. What the
// builtins cannot read they leave alone and return ECX_UNPACKED
// (post_read, release, wait) or "ERR" (check), and the package takes its
// general path, which says what is wrong.

#include <stdint.h>
#include <stdlib.h>

#include "_cgo_export.h"

// ECX_UNPACKED and ECX_BAD_ARG are codeUnpacked and codeBadArg in codes.go.
#define ECX_UNPACKED (-18)
#define ECX_BAD_ARG (-16)

typedef intptr_t py_ssize;

struct py_head {
	py_ssize refcnt;
	void *type;
};

#define TYPE(o) (((struct py_head *)(o))->type)

// The interpreter's PyMethodDef, and METH_FASTCALL: a builtin called
// with (self, args, nargs), the arguments an array of nargs objects
// (stable ABI since 3.10).
struct py_method_def {
	const char *name;
	void *meth;
	int flags;
	const char *doc;
};
#define PY_METH_FASTCALL 0x0080

enum { PY_FNS = 16, PY_OBJS = 10, PY_API = PY_FNS + PY_OBJS };

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
	void *(*cfunction_new)(struct py_method_def *, void *, void *);
	unsigned long long (*as_u64)(void *);
	void *(*from_i64)(long long);
	void (*incref)(void *);
	char *(*bytes_data)(void *);
	py_ssize (*bytes_size)(void *);
	void *(*dict_get)(void *, void *);
	void *list_type, *tuple_type, *int_type, *bytes_type, *dict_type, *str_type, *none;
	void *state[3]; // "PROC", "DONE", "ERR"
} py;

static int py_ready;

// The builtins (calls, below), made by ecx_py_call on request.
enum { N_CALLS = 4 };
static void *made[N_CALLS];

// ecx_py_api installs, in this order: PyList_Size, PyList_GetItem,
// PyTuple_Size, PyTuple_GetItem, PyLong_AsLongLong, PyErr_Occurred,
// PyErr_Clear, PyEval_SaveThread, PyEval_RestoreThread,
// PyCFunction_NewEx, PyLong_AsUnsignedLongLong, PyLong_FromLongLong,
// Py_IncRef, PyBytes_AsString, PyBytes_Size, PyDict_GetItemWithError;
// then the addresses of the types list, tuple, int, bytes, dict and str,
// of None, and of three str objects "PROC", "DONE" and "ERR", of which it
// takes a reference each. It returns 0, or -16 (bad argument: n is not
// 26 or a pointer is NULL; nothing is installed then). Call it before the
// first ecx_py_call, with the GIL held (a ctypes.PyDLL), from the
// interpreter whose functions and objects they are, and only from the
// process's main interpreter: what it installs is the whole process's. A
// later call installs its table in place of the last one and makes the
// builtins afresh: an embedder that finalized Python and initialized it
// again loads the package again, and the states and builtins of the
// interpreter that ended are gone (a builtin made before still works, on
// the new table: the old states it would return are taken once more, so
// they stay alive).
int ecx_py_api(void *const *fns, int64_t n)
{
	if (fns == NULL || n != PY_API)
		return ECX_BAD_ARG;
	for (int i = 0; i < PY_API; i++)
		if (fns[i] == NULL)
			return ECX_BAD_ARG;
	py.list_size = (py_ssize (*)(void *))fns[0];
	py.list_item = (void *(*)(void *, py_ssize))fns[1];
	py.tuple_size = (py_ssize (*)(void *))fns[2];
	py.tuple_item = (void *(*)(void *, py_ssize))fns[3];
	py.as_long_long = (long long (*)(void *))fns[4];
	py.err_occurred = (void *(*)(void))fns[5];
	py.err_clear = (void (*)(void))fns[6];
	py.save_thread = (void *(*)(void))fns[7];
	py.restore_thread = (void (*)(void *))fns[8];
	py.cfunction_new = (void *(*)(struct py_method_def *, void *, void *))fns[9];
	py.as_u64 = (unsigned long long (*)(void *))fns[10];
	py.from_i64 = (void *(*)(long long))fns[11];
	py.incref = (void (*)(void *))fns[12];
	py.bytes_data = (char *(*)(void *))fns[13];
	py.bytes_size = (py_ssize (*)(void *))fns[14];
	py.dict_get = (void *(*)(void *, void *))fns[15];
	py.list_type = fns[16];
	py.tuple_type = fns[17];
	py.int_type = fns[18];
	py.bytes_type = fns[19];
	py.dict_type = fns[20];
	py.str_type = fns[21];
	py.none = fns[22];
	for (int i = 0; i < 3; i++) {
		py.state[i] = fns[23 + i];
		py.incref(py.state[i]); // check hands them out for good
	}
	for (int i = 0; i < N_CALLS; i++)
		made[i] = NULL; // an ended interpreter's, or remade on request
	py_ready = 1;
	return 0;
}

static int seq_len(void *seq, int64_t *n, int *is_list)
{
	if (seq == NULL)
		return 0;
	void *type = TYPE(seq);
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
			if (TYPE(ob[j]) != py.int_type)
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

// post_lists is ecx_post_read with the lists local and remote (PyObject
// pointers) read here: it returns the handle (> 0), a negative code from
// ecx_post_read, or ECX_UNPACKED when the lists' lengths differ or a list
// is not a list or tuple of exact ints in int64's range, before anything
// is posted. The caller holds the GIL; it is released for the post.
static int64_t post_lists(uint64_t t, void *local, uint64_t peer, void *remote, void *notif, int64_t notif_len)
{
	int64_t nl, nr;
	int ll, rl;
	if (!seq_len(local, &nl, &ll) || !seq_len(remote, &nr, &rl) || nl != nr)
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

// arg_u64 reads an exact int in uint64's range (no Python error left set).
static int arg_u64(void *o, uint64_t *v)
{
	if (TYPE(o) != py.int_type)
		return 0;
	unsigned long long x = py.as_u64(o);
	if (x == (unsigned long long)-1 && py.err_occurred() != NULL) {
		py.err_clear(); // negative, or 2**64 or more
		return 0;
	}
	*v = x;
	return 1;
}

// arg_i64 reads an exact int in int64's range (no Python error left set).
static int arg_i64(void *o, int64_t *v)
{
	if (TYPE(o) != py.int_type)
		return 0;
	long long x = py.as_long_long(o);
	if (x == -1 && py.err_occurred() != NULL) {
		py.err_clear();
		return 0;
	}
	*v = x;
	return 1;
}

// peer_id looks name up in peers, a dict of the package's (agent name ->
// peer id): 1 and the id when name is a str there, with an int in uint64's
// range; 0 otherwise (no Python error left set). Only an exact str is
// looked up: the dict's keys are exact strs, so comparing them runs no
// Python code.
static int peer_id(void *peers, void *name, uint64_t *id)
{
	if (TYPE(peers) != py.dict_type || TYPE(name) != py.str_type)
		return 0;
	void *v = py.dict_get(peers, name); // borrowed
	if (v == NULL) {
		py.err_clear(); // none set when it is simply absent
		return 0;
	}
	return arg_u64(v, id);
}

// post_read(t, local, peers, name, remote, notif) -> int: t an int, peers
// the package's dict of peer ids, name a str, notif bytes; the handle
// (> 0), a negative code, or ECX_UNPACKED for anything else (an agent
// name peers lacks too; see post_lists) before anything is posted.
static void *call_post(void *self, void *const *args, py_ssize nargs)
{
	(void)self;
	uint64_t t, peer;
	int64_t rc = ECX_UNPACKED;
	if (nargs == 6 && arg_u64(args[0], &t) && peer_id(args[2], args[3], &peer) && TYPE(args[5]) == py.bytes_type)
		rc = post_lists(t, args[1], peer, args[4], py.bytes_data(args[5]), py.bytes_size(args[5]));
	return py.from_i64(rc);
}

// check(t, h) -> "PROC", "DONE" or "ERR". "ERR" also for a handle that is
// not an int in 1..2**64-1, without a call into the library; the error
// message of a failed check is dropped (the package asks for it with
// ecx_check when it wants it).
static void *call_check(void *self, void *const *args, py_ssize nargs)
{
	(void)self;
	uint64_t t, h;
	int st = -1;
	if (nargs == 2 && arg_u64(args[0], &t) && arg_u64(args[1], &h) && h != 0) {
		void *ts = py.save_thread();
		st = ecx_check(t, h);
		if (st < 0)
			ecx_last_error(NULL, 0);
		py.restore_thread(ts);
	}
	void *s = py.state[st == 0 ? 0 : st == 1 ? 1 : 2];
	py.incref(s);
	return s;
}

// release(t, h) -> int: 0, a negative code (its message kept for
// ecx_last_error), or ECX_UNPACKED for a handle that is not an int in
// 1..2**64-1, without a call into the library.
static void *call_release(void *self, void *const *args, py_ssize nargs)
{
	(void)self;
	uint64_t t, h;
	int rc = ECX_UNPACKED;
	if (nargs == 2 && arg_u64(args[0], &t) && arg_u64(args[1], &h) && h != 0) {
		void *ts = py.save_thread();
		rc = ecx_release(t, h);
		py.restore_thread(ts);
	}
	return py.from_i64(rc);
}

// wait(t, h, timeout_ns) -> int: what ecx_wait returns (its message kept),
// or ECX_UNPACKED for arguments that are not ints in range, without a
// call into the library.
static void *call_wait(void *self, void *const *args, py_ssize nargs)
{
	(void)self;
	uint64_t t, h;
	int64_t ns;
	int rc = ECX_UNPACKED;
	if (nargs == 3 && arg_u64(args[0], &t) && arg_u64(args[1], &h) && h != 0 && arg_i64(args[2], &ns)) {
		void *ts = py.save_thread();
		rc = ecx_wait(t, h, ns);
		py.restore_thread(ts);
	}
	return py.from_i64(rc);
}



static struct py_method_def calls[] = {
	{"post_read", (void *)call_post, PY_METH_FASTCALL, "ecxfer's post_read(t, local, peers, name, remote, notif)"},
	{"check", (void *)call_check, PY_METH_FASTCALL, "ecxfer's check(t, h)"},
	{"release", (void *)call_release, PY_METH_FASTCALL, "ecxfer's release(t, h)"},
	{"wait", (void *)call_wait, PY_METH_FASTCALL, "ecxfer's wait(t, h, timeout_ns)"},
};

_Static_assert(sizeof(calls) / sizeof(calls[0]) == N_CALLS, "N_CALLS is the number of builtins");

// ecx_py_call returns a new reference to the builtin number i (0
// post_read, 1 check, 2 release, 3 wait), made on the first call; to None
// for another i, and when the interpreter fails to make it (its error
// cleared); NULL only before ecx_py_api. The caller holds the GIL
// (ctypes.PyDLL with restype py_object, which takes the reference over,
// and takes NULL for a crash: call it after ecx_py_api succeeded).
void *ecx_py_call(int64_t i)
{
	if (!py_ready)
		return NULL;
	void *fn = py.none;
	if (i >= 0 && i < N_CALLS) {
		if (made[i] == NULL)
			made[i] = py.cfunction_new(&calls[i], NULL, NULL);
		if (made[i] != NULL)
			fn = made[i];
		else
			py.err_clear();
	}
	py.incref(fn);
	return fn;
}
