/* Fused copy-and-hash and receive-and-hash for the data plane's readers.
 *
 * Readers verify every chunk with xxh3-64 the moment it arrives. Done in Python, a chunk is
 * copied (or received) whole and then hashed, which reads its 1 MiB back from L2/L3 on a
 * second pass. Here each block is hashed right after it lands, while it is still in L1/L2,
 * with xxhash's runtime-dispatched SIMD code (AVX2/AVX-512 where the CPU has it: Debian's
 * libxxhash ships the dispatcher), and the GIL is released for the whole chunk.
 *
 * Digests equal xxhash.xxh3_64_intdigest() of the same bytes, so a reader with this module and
 * a source without it (or the other way round) agree; runtime/dataplane/memory.py falls back
 * to the pure-Python path when the module was not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h>
#define HASH_UPDATE XXH3_64bits_update_dispatch
#define HASH_ONESHOT XXH3_64bits_dispatch
#define DISPATCH 1
#else
#define HASH_UPDATE XXH3_64bits_update
#define HASH_ONESHOT XXH3_64bits
#define DISPATCH 0
#endif

/* Copy block: small enough that the block is still in L1/L2 when it is hashed. */
#define COPY_BLOCK ((size_t)64 * 1024)
/* Receive block: one recv() per block; larger than COPY_BLOCK to keep syscalls few. */
#define RECV_BLOCK ((size_t)256 * 1024)

static int parse_addr(PyObject *obj, char **out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    *out = (char *)(uintptr_t)v;
    return 1;
}

PyDoc_STRVAR(copy_hash_doc,
             "copy_hash(dst, src, n) -> int\n\n"
             "Copy n bytes from address src to address dst and return the xxh3-64 of the\n"
             "bytes written, hashing each block while it is in cache. Releases the GIL.");

static PyObject *copy_hash(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    Py_ssize_t n;
    char *dst, *src;
    if (!PyArg_ParseTuple(args, "OOn", &dst_obj, &src_obj, &n)) return NULL;
    if (!parse_addr(dst_obj, &dst) || !parse_addr(src_obj, &src)) return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "negative length %zd", n);
    XXH3_state_t state;
    XXH64_hash_t digest;
    Py_BEGIN_ALLOW_THREADS
    XXH3_64bits_reset(&state);
    for (size_t off = 0; off < (size_t)n; off += COPY_BLOCK) {
        size_t k = (size_t)n - off < COPY_BLOCK ? (size_t)n - off : COPY_BLOCK;
        memcpy(dst + off, src + off, k);
        HASH_UPDATE(&state, dst + off, k);
    }
    digest = XXH3_64bits_digest(&state);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(digest);
}

PyDoc_STRVAR(hash_doc,
             "hash(addr, n) -> int\n\n"
             "The xxh3-64 of n bytes at address addr. Releases the GIL.");

static PyObject *hash(PyObject *self, PyObject *args) {
    PyObject *addr_obj;
    Py_ssize_t n;
    char *addr;
    if (!PyArg_ParseTuple(args, "On", &addr_obj, &n)) return NULL;
    if (!parse_addr(addr_obj, &addr)) return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "negative length %zd", n);
    XXH64_hash_t digest;
    Py_BEGIN_ALLOW_THREADS
    digest = HASH_ONESHOT(addr, (size_t)n);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(digest);
}

PyDoc_STRVAR(recv_hash_doc,
             "recv_hash(fd, dst, n) -> (received, digest)\n\n"
             "Receive n bytes from the blocking socket fd into address dst, hashing each block\n"
             "as it lands; digest is the xxh3-64 of the bytes received. received < n means the\n"
             "peer closed the connection. A socket error raises OSError (EAGAIN, from an\n"
             "expired SO_RCVTIMEO, raises BlockingIOError). Releases the GIL.");

static PyObject *recv_hash(PyObject *self, PyObject *args) {
    int fd;
    PyObject *dst_obj;
    Py_ssize_t n;
    char *dst;
    if (!PyArg_ParseTuple(args, "iOn", &fd, &dst_obj, &n)) return NULL;
    if (!parse_addr(dst_obj, &dst)) return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "negative length %zd", n);
    XXH3_state_t state;
    size_t got = 0, hashed = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    XXH3_64bits_reset(&state);
    while (got < (size_t)n) {
        size_t want = (size_t)n - got < RECV_BLOCK ? (size_t)n - got : RECV_BLOCK;
        ssize_t k = recv(fd, dst + got, want, MSG_WAITALL);
        if (k < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (k == 0) break; /* peer closed */
        got += (size_t)k;
        HASH_UPDATE(&state, dst + hashed, got - hashed);
        hashed = got;
    }
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("nK", (Py_ssize_t)got,
                         (unsigned long long)XXH3_64bits_digest(&state));
}

static PyMethodDef methods[] = {
    {"copy_hash", copy_hash, METH_VARARGS, copy_hash_doc},
    {"hash", hash, METH_VARARGS, hash_doc},
    {"recv_hash", recv_hash, METH_VARARGS, recv_hash_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastpath",
    "Fused copy/receive-and-hash (xxh3-64, SIMD-dispatched) for the data plane.", -1, methods,
};

PyMODINIT_FUNC PyInit__fastpath(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "SIMD_DISPATCH", DISPATCH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
