/*
 * simpler_daemon._mailbox -- offsets and atomics for the shared-memory
 * mailboxes the daemon parent uses to talk to its forked worker children.
 *
 * This is deliberately a tiny shim: it knows the frame layout, how to do
 * acquire/release/seq_cst accesses on words inside a writable buffer
 * (mmap.mmap, bytearray, writable memoryview), and how to park on / wake a
 * futex that lives in MAP_SHARED memory.  It knows no policy.
 *
 * Every entry point acquires the buffer with PyBUF_WRITABLE, checks bounds
 * and alignment before touching memory (raising IndexError / ValueError,
 * never crashing) and releases the buffer on every path.
 *
 * Linux only (x86_64 / aarch64): GCC __atomic builtins and SYS_futex.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef __linux__
#error "simpler_daemon._mailbox supports Linux only"
#endif

/* ------------------------------------------------------------------------ */
/* Layout                                                                   */
/* ------------------------------------------------------------------------ */

#define ABI_VERSION 1

#define MAILBOX_FRAME_SIZE 65536
#define MAILBOX_NUM_FRAMES 3
#define MAILBOX_SIZE 196608

#define OFF_STATE 0          /* i32 */
#define OFF_ERROR 4          /* i32 */
#define OFF_RESERVED 8       /* u64: task 0 / base-frame control sub-command */
#define OFF_CONFIG 16
#define CONFIG_SIZE 1056
#define OFF_LEASE 1072       /* u32 slot_id, u32 reserved, u64 generation */
#define LEASE_SIZE 16
#define OFF_DIGEST 1088
#define DIGEST_SIZE 32
#define OFF_ARGS 1120
#define MAILBOX_ARGS_CAPACITY 64080
#define OFF_WAKE_SEQ 65200   /* i32, base frame only: futex word */
#define OFF_CHILD_PARKED 65208 /* i32, base frame only */
#define OFF_SHUTDOWN 65216   /* i32, base frame only, sticky */
#define OFF_TRAILER 65224    /* 5 x u64 */
#define TRAILER_SIZE 40
#define OFF_ACCEPTED 65264   /* i32 */
#define OFF_DISPOSITION 65272 /* i32 */
#define OFF_ERRMSG 65280
#define ERRMSG_SIZE 256

#define TENSOR_DESC_SIZE 168
#define ARGS_HEADER_SIZE 8   /* i32 T, i32 S */

#define STATE_IDLE 0
#define STATE_TASK_READY 1
#define STATE_TASK_DONE 2
#define STATE_SHUTDOWN 3
#define STATE_CONTROL_REQUEST 4
#define STATE_CONTROL_DONE 5
#define STATE_INIT_READY 6
#define STATE_INIT_FAILED 7
#define STATE_FRAME_STAGED 8
#define STATE_TASK_LAUNCHED 9
#define STATE_TASK_FAILED 10
#define STATE_ACTIVATE 11
#define STATE_PREPARE_READY 12

#define SPIN_WAIT_MAX_WORDS 8

_Static_assert(MAILBOX_FRAME_SIZE * MAILBOX_NUM_FRAMES == MAILBOX_SIZE, "mailbox size");
_Static_assert(OFF_STATE + 4 <= OFF_ERROR, "state/error overlap");
_Static_assert(OFF_ERROR + 4 <= OFF_RESERVED, "error/reserved overlap");
_Static_assert(OFF_RESERVED % 8 == 0, "reserved must be 8-aligned");
_Static_assert(OFF_RESERVED + 8 <= OFF_CONFIG, "reserved/config overlap");
_Static_assert(OFF_CONFIG + CONFIG_SIZE <= OFF_LEASE, "config/lease overlap");
_Static_assert(OFF_LEASE % 8 == 0, "lease must be 8-aligned");
_Static_assert((OFF_LEASE + 8) % 8 == 0, "lease generation must be 8-aligned");
_Static_assert(OFF_LEASE + LEASE_SIZE <= OFF_DIGEST, "lease/digest overlap");
_Static_assert(OFF_DIGEST + DIGEST_SIZE <= OFF_ARGS, "digest/args overlap");
_Static_assert(OFF_ARGS % 8 == 0, "args must be 8-aligned");
_Static_assert(OFF_ARGS + MAILBOX_ARGS_CAPACITY <= OFF_WAKE_SEQ, "args/wake_seq overlap");
_Static_assert(OFF_WAKE_SEQ % 4 == 0, "wake_seq must be 4-aligned");
_Static_assert(OFF_WAKE_SEQ + 4 <= OFF_CHILD_PARKED, "wake_seq/child_parked overlap");
_Static_assert(OFF_CHILD_PARKED % 4 == 0, "child_parked must be 4-aligned");
_Static_assert(OFF_CHILD_PARKED + 4 <= OFF_SHUTDOWN, "child_parked/shutdown overlap");
_Static_assert(OFF_SHUTDOWN % 4 == 0, "shutdown must be 4-aligned");
_Static_assert(OFF_SHUTDOWN + 4 <= OFF_TRAILER, "shutdown/trailer overlap");
_Static_assert(OFF_TRAILER % 8 == 0, "trailer must be 8-aligned");
_Static_assert(TRAILER_SIZE == 5 * 8, "trailer is 5 x u64");
_Static_assert(OFF_TRAILER + TRAILER_SIZE <= OFF_ACCEPTED, "trailer/accepted overlap");
_Static_assert(OFF_ACCEPTED % 4 == 0, "accepted must be 4-aligned");
_Static_assert(OFF_ACCEPTED + 4 <= OFF_DISPOSITION, "accepted/disposition overlap");
_Static_assert(OFF_DISPOSITION % 4 == 0, "disposition must be 4-aligned");
_Static_assert(OFF_DISPOSITION + 4 <= OFF_ERRMSG, "disposition/errmsg overlap");
_Static_assert(OFF_ERRMSG + ERRMSG_SIZE <= MAILBOX_FRAME_SIZE, "errmsg overflows the frame");
_Static_assert(ARGS_HEADER_SIZE <= MAILBOX_ARGS_CAPACITY, "args header");
_Static_assert(sizeof(int32_t) == 4 && sizeof(uint64_t) == 8, "word sizes");

/* ------------------------------------------------------------------------ */
/* Small helpers                                                            */
/* ------------------------------------------------------------------------ */

static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

static inline int64_t
monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + (int64_t)ts.tv_nsec;
}

static inline long
sys_futex_wait(int32_t *addr, int32_t expected, const struct timespec *ts)
{
    return syscall(SYS_futex, addr, FUTEX_WAIT, expected, ts, NULL, 0);
}

static inline long
sys_futex_wake(int32_t *addr, int n)
{
    return syscall(SYS_futex, addr, FUTEX_WAKE, n, NULL, NULL, 0);
}

static int
get_buf(PyObject *obj, Py_buffer *view)
{
    return PyObject_GetBuffer(obj, view, PyBUF_WRITABLE);
}

/* Pointer to a width-byte word at off, or NULL with IndexError/ValueError. */
static void *
word_ptr(Py_buffer *view, Py_ssize_t off, Py_ssize_t width)
{
    if (off < 0 || width > view->len || off > view->len - width) {
        PyErr_Format(PyExc_IndexError,
                     "offset %zd out of range for %zd-byte word in buffer of %zd bytes",
                     off, width, view->len);
        return NULL;
    }
    char *p = (char *)view->buf + off;
    if (((uintptr_t)p) % (uintptr_t)width != 0) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not %zd-byte aligned", off, width);
        return NULL;
    }
    return p;
}

/* Pointer to an n-byte range at off (no alignment requirement). */
static char *
range_ptr(Py_buffer *view, Py_ssize_t off, Py_ssize_t n)
{
    if (off < 0 || n > view->len || off > view->len - n) {
        PyErr_Format(PyExc_IndexError,
                     "offset %zd out of range for %zd-byte range in buffer of %zd bytes",
                     off, n, view->len);
        return NULL;
    }
    return (char *)view->buf + off;
}

/* Pointer to the frame at frame_off; the buffer must also hold the base
 * frame at offset 0 and be 8-byte aligned at its start. */
static char *
frame_ptr(Py_buffer *view, Py_ssize_t frame_off)
{
    if (frame_off % MAILBOX_FRAME_SIZE != 0) {
        PyErr_Format(PyExc_ValueError, "frame offset %zd is not a multiple of %d", frame_off,
                     MAILBOX_FRAME_SIZE);
        return NULL;
    }
    if (view->len < MAILBOX_FRAME_SIZE) {
        PyErr_Format(PyExc_IndexError,
                     "buffer of %zd bytes does not hold the base frame (%d bytes)", view->len,
                     MAILBOX_FRAME_SIZE);
        return NULL;
    }
    if (frame_off < 0 || frame_off > view->len - MAILBOX_FRAME_SIZE) {
        PyErr_Format(PyExc_IndexError,
                     "frame offset %zd out of range for %d-byte frame in buffer of %zd bytes",
                     frame_off, MAILBOX_FRAME_SIZE, view->len);
        return NULL;
    }
    if (((uintptr_t)view->buf) % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "mailbox buffer is not 8-byte aligned");
        return NULL;
    }
    return (char *)view->buf + frame_off;
}

/* The base frame (offset 0) of a whole mailbox, for park/wake words. */
static char *
base_ptr(Py_buffer *view)
{
    return frame_ptr(view, 0);
}

#define I32_AT(base, off) ((int32_t *)((char *)(base) + (off)))
#define U32_AT(base, off) ((uint32_t *)((char *)(base) + (off)))
#define U64_AT(base, off) ((uint64_t *)((char *)(base) + (off)))

/* Parent side of the Dekker park/wake handshake; `base` is the base frame.
 * The caller has already published (seq_cst store) whatever the child waits
 * on.  Returns 1 if the child was parked and has been woken. */
static int
wake_child_impl(char *base)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(I32_AT(base, OFF_CHILD_PARKED), __ATOMIC_SEQ_CST) != 0) {
        __atomic_fetch_add(I32_AT(base, OFF_WAKE_SEQ), 1, __ATOMIC_SEQ_CST);
        (void)sys_futex_wake(I32_AT(base, OFF_WAKE_SEQ), INT_MAX);
        return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Argument converters (usable with "O&" and directly)                      */
/* ------------------------------------------------------------------------ */

/* Byte offset: any index-able int; out-of-ssize_t values are clamped so that
 * the bounds check reports IndexError rather than OverflowError. */
static int
conv_off(PyObject *obj, void *out)
{
    Py_ssize_t v = PyNumber_AsSsize_t(obj, NULL);
    if (v == -1 && PyErr_Occurred()) {
        return 0;
    }
    *(Py_ssize_t *)out = v;
    return 1;
}

/* Non-negative count. */
static int
conv_count(PyObject *obj, void *out)
{
    Py_ssize_t v = PyNumber_AsSsize_t(obj, PyExc_OverflowError);
    if (v == -1 && PyErr_Occurred()) {
        return 0;
    }
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "count must be >= 0, got %zd", v);
        return 0;
    }
    *(Py_ssize_t *)out = v;
    return 1;
}

/* Reads an int as long long; *ovf is -1/0/+1 like PyLong_AsLongLongAndOverflow.
 * Returns 0 on error (TypeError for non-ints). */
static int
as_ll(PyObject *obj, long long *v, int *ovf, PyObject **idx_out)
{
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) {
        return 0;
    }
    *v = PyLong_AsLongLongAndOverflow(idx, ovf);
    if (*v == -1 && PyErr_Occurred()) {
        Py_DECREF(idx);
        return 0;
    }
    *idx_out = idx;
    return 1;
}

/* 32-bit word bit pattern: -2**31 .. 2**32-1. */
static int
conv_w32(PyObject *obj, void *out)
{
    long long v;
    int ovf;
    PyObject *idx;
    if (!as_ll(obj, &v, &ovf, &idx)) {
        return 0;
    }
    Py_DECREF(idx);
    if (ovf != 0 || v < (long long)INT32_MIN || v > (long long)UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "%R out of range for a 32-bit word", obj);
        return 0;
    }
    *(uint32_t *)out = (uint32_t)v;
    return 1;
}

/* Unsigned 32-bit field: 0 .. 2**32-1. */
static int
conv_u32(PyObject *obj, void *out)
{
    long long v;
    int ovf;
    PyObject *idx;
    if (!as_ll(obj, &v, &ovf, &idx)) {
        return 0;
    }
    Py_DECREF(idx);
    if (ovf != 0 || v < 0 || v > (long long)UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "%R out of range for an unsigned 32-bit field", obj);
        return 0;
    }
    *(uint32_t *)out = (uint32_t)v;
    return 1;
}

/* 64-bit word bit pattern: -2**63 .. 2**64-1. */
static int
conv_w64(PyObject *obj, void *out)
{
    long long v;
    int ovf;
    PyObject *idx;
    if (!as_ll(obj, &v, &ovf, &idx)) {
        return 0;
    }
    if (ovf == 0) {
        Py_DECREF(idx);
        *(uint64_t *)out = (uint64_t)v;
        return 1;
    }
    if (ovf > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(idx);
        Py_DECREF(idx);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto overflow;
        }
        *(uint64_t *)out = (uint64_t)u;
        return 1;
    }
    Py_DECREF(idx);
overflow:
    PyErr_Format(PyExc_OverflowError, "%R out of range for a 64-bit word", obj);
    return 0;
}

/* Unsigned 64-bit field: 0 .. 2**64-1. */
static int
conv_u64(PyObject *obj, void *out)
{
    long long v;
    int ovf;
    PyObject *idx;
    if (!as_ll(obj, &v, &ovf, &idx)) {
        return 0;
    }
    if (ovf == 0 && v >= 0) {
        Py_DECREF(idx);
        *(uint64_t *)out = (uint64_t)v;
        return 1;
    }
    if (ovf > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(idx);
        Py_DECREF(idx);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto overflow;
        }
        *(uint64_t *)out = (uint64_t)u;
        return 1;
    }
    Py_DECREF(idx);
overflow:
    PyErr_Format(PyExc_OverflowError, "%R out of range for an unsigned 64-bit field", obj);
    return 0;
}

/* Timeout in seconds: None -> forever (has_timeout = 0). */
typedef struct {
    int has_timeout;
    struct timespec ts;
} timeout_t;

static int
conv_timeout(PyObject *obj, void *out)
{
    timeout_t *t = (timeout_t *)out;
    if (obj == Py_None) {
        t->has_timeout = 0;
        return 1;
    }
    double secs = PyFloat_AsDouble(obj);
    if (secs == -1.0 && PyErr_Occurred()) {
        return 0;
    }
    if (secs != secs) {
        PyErr_SetString(PyExc_ValueError, "timeout must not be NaN");
        return 0;
    }
    if (secs < 0.0) {
        PyErr_Format(PyExc_ValueError, "timeout must be >= 0 or None, got %R", obj);
        return 0;
    }
    if (secs >= 1e9) { /* ~31 years: treat as forever, avoids time_t overflow */
        t->has_timeout = 0;
        return 1;
    }
    t->has_timeout = 1;
    t->ts.tv_sec = (time_t)secs;
    long nsec = (long)((secs - (double)t->ts.tv_sec) * 1e9);
    if (nsec < 0) {
        nsec = 0;
    }
    if (nsec > 999999999L) {
        nsec = 999999999L;
    }
    t->ts.tv_nsec = nsec;
    return 1;
}

/* Builds a tuple from n new references, stealing them; if any is NULL all
 * are released and NULL is returned (the error is already set). */
static PyObject *
steal_tuple(Py_ssize_t n, PyObject **items)
{
    PyObject *tup = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i] == NULL) {
            goto fail;
        }
    }
    tup = PyTuple_New(n);
    if (tup == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyTuple_SET_ITEM(tup, i, items[i]);
    }
    return tup;
fail:
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(items[i]);
    }
    return NULL;
}

static int
check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd positional arguments (%zd given)",
                     name, want, nargs);
        return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------------ */
/* Atomics                                                                  */
/* ------------------------------------------------------------------------ */

static PyObject *
mb_load32(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    Py_buffer view;
    if (!check_nargs("load32", nargs, 2) || !conv_off(args[1], &off)) {
        return NULL;
    }
    if (get_buf(args[0], &view) < 0) {
        return NULL;
    }
    int32_t *p = word_ptr(&view, off, 4);
    if (p == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int32_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromLong((long)v);
}

static PyObject *
mb_load64(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    Py_buffer view;
    if (!check_nargs("load64", nargs, 2) || !conv_off(args[1], &off)) {
        return NULL;
    }
    if (get_buf(args[0], &view) < 0) {
        return NULL;
    }
    uint64_t *p = word_ptr(&view, off, 8);
    if (p == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong((unsigned long long)v);
}

static PyObject *
mb_store32(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    uint32_t value;
    Py_buffer view;
    if (!check_nargs("store32", nargs, 3) || !conv_off(args[1], &off) ||
        !conv_w32(args[2], &value)) {
        return NULL;
    }
    if (get_buf(args[0], &view) < 0) {
        return NULL;
    }
    uint32_t *p = word_ptr(&view, off, 4);
    if (p == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    __atomic_store_n(p, value, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *
mb_store64(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    uint64_t value;
    Py_buffer view;
    if (!check_nargs("store64", nargs, 3) || !conv_off(args[1], &off) ||
        !conv_w64(args[2], &value)) {
        return NULL;
    }
    if (get_buf(args[0], &view) < 0) {
        return NULL;
    }
    uint64_t *p = word_ptr(&view, off, 8);
    if (p == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    __atomic_store_n(p, value, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *
mb_cas32(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    uint32_t expected, desired;
    Py_buffer view;
    if (!check_nargs("cas32", nargs, 4) || !conv_off(args[1], &off) ||
        !conv_w32(args[2], &expected) || !conv_w32(args[3], &desired)) {
        return NULL;
    }
    if (get_buf(args[0], &view) < 0) {
        return NULL;
    }
    uint32_t *p = word_ptr(&view, off, 4);
    if (p == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int ok = __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

static PyObject *
mb_cas64(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    uint64_t expected, desired;
    Py_buffer view;
    if (!check_nargs("cas64", nargs, 4) || !conv_off(args[1], &off) ||
        !conv_w64(args[2], &expected) || !conv_w64(args[3], &desired)) {
        return NULL;
    }
    if (get_buf(args[0], &view) < 0) {
        return NULL;
    }
    uint64_t *p = word_ptr(&view, off, 8);
    if (p == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int ok = __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

static PyObject *
mb_fetch_add32(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    uint32_t delta;
    Py_buffer view;
    if (!check_nargs("fetch_add32", nargs, 3) || !conv_off(args[1], &off) ||
        !conv_w32(args[2], &delta)) {
        return NULL;
    }
    if (get_buf(args[0], &view) < 0) {
        return NULL;
    }
    uint32_t *p = word_ptr(&view, off, 4);
    if (p == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    /* Unsigned arithmetic wraps; the old value is returned as signed i32. */
    uint32_t old = __atomic_fetch_add(p, delta, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyLong_FromLong((long)(int32_t)old);
}

static PyObject *
mb_fetch_add64(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    uint64_t delta;
    Py_buffer view;
    if (!check_nargs("fetch_add64", nargs, 3) || !conv_off(args[1], &off) ||
        !conv_w64(args[2], &delta)) {
        return NULL;
    }
    if (get_buf(args[0], &view) < 0) {
        return NULL;
    }
    uint64_t *p = word_ptr(&view, off, 8);
    if (p == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t old = __atomic_fetch_add(p, delta, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong((unsigned long long)old);
}

static PyObject *
mb_fence(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored))
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------ */
/* Futex                                                                    */
/* ------------------------------------------------------------------------ */

static PyObject *
mb_futex_wait(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "off", "expected", "timeout", NULL};
    PyObject *obj;
    Py_ssize_t off;
    uint32_t expected;
    timeout_t timeout = {0, {0, 0}};
    PyObject *timeout_obj = Py_None;
    Py_buffer view;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO&O&|O:futex_wait", kwlist, &obj, conv_off,
                                     &off, conv_w32, &expected, &timeout_obj)) {
        return NULL;
    }
    if (!conv_timeout(timeout_obj, &timeout)) {
        return NULL;
    }
    if (get_buf(obj, &view) < 0) {
        return NULL;
    }
    int32_t *p = word_ptr(&view, off, 4);
    if (p == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    long rc;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = sys_futex_wait(p, (int32_t)expected, timeout.has_timeout ? &timeout.ts : NULL);
    if (rc != 0) {
        err = errno;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);

    if (rc == 0) {
        return PyLong_FromLong(0);
    }
    switch (err) {
    case ETIMEDOUT:
        return PyLong_FromLong(1);
    case EAGAIN:
        return PyLong_FromLong(2);
    case EINTR:
        if (PyErr_CheckSignals() < 0) {
            return NULL;
        }
        return PyLong_FromLong(3);
    default:
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
}

static PyObject *
mb_futex_wake(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off, n;
    Py_buffer view;
    if (!check_nargs("futex_wake", nargs, 3) || !conv_off(args[1], &off) ||
        !conv_count(args[2], &n)) {
        return NULL;
    }
    if (n > INT_MAX) {
        n = INT_MAX;
    }
    if (get_buf(args[0], &view) < 0) {
        return NULL;
    }
    int32_t *p = word_ptr(&view, off, 4);
    if (p == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    long rc = sys_futex_wake(p, (int)n);
    int err = errno;
    PyBuffer_Release(&view);
    if (rc < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(rc);
}

/* ------------------------------------------------------------------------ */
/* Spin / park                                                              */
/* ------------------------------------------------------------------------ */

typedef struct {
    Py_ssize_t n;
    int32_t *ptr[SPIN_WAIT_MAX_WORDS];
    int32_t expected[SPIN_WAIT_MAX_WORDS];
} wordset_t;

/* Validates offsets/expected (sequences of 1..8 ints) against the buffer.
 * Must be called with the buffer acquired; sets an exception on failure. */
static int
wordset_init(wordset_t *ws, Py_buffer *view, PyObject *offsets, PyObject *expected)
{
    int ok = 0;
    PyObject *offs = PySequence_Fast(offsets, "offsets must be a sequence of ints");
    if (offs == NULL) {
        return 0;
    }
    PyObject *exps = PySequence_Fast(expected, "expected must be a sequence of ints");
    if (exps == NULL) {
        Py_DECREF(offs);
        return 0;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(offs);
    if (n < 1 || n > SPIN_WAIT_MAX_WORDS) {
        PyErr_Format(PyExc_ValueError, "need 1 to %d words to wait on, got %zd",
                     SPIN_WAIT_MAX_WORDS, n);
        goto done;
    }
    if (PySequence_Fast_GET_SIZE(exps) != n) {
        PyErr_Format(PyExc_ValueError, "offsets has %zd entries but expected has %zd", n,
                     PySequence_Fast_GET_SIZE(exps));
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t off;
        uint32_t e;
        if (!conv_off(PySequence_Fast_GET_ITEM(offs, i), &off) ||
            !conv_w32(PySequence_Fast_GET_ITEM(exps, i), &e)) {
            goto done;
        }
        int32_t *p = word_ptr(view, off, 4);
        if (p == NULL) {
            goto done;
        }
        ws->ptr[i] = p;
        ws->expected[i] = (int32_t)e;
    }
    ws->n = n;
    ok = 1;
done:
    Py_DECREF(offs);
    Py_DECREF(exps);
    return ok;
}

/* Index of the first word differing from its expected value, or -1. */
static inline Py_ssize_t
wordset_check(const wordset_t *ws)
{
    for (Py_ssize_t i = 0; i < ws->n; i++) {
        if (__atomic_load_n(ws->ptr[i], __ATOMIC_ACQUIRE) != ws->expected[i]) {
            return i;
        }
    }
    return -1;
}

static PyObject *
mb_spin_wait(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t spins;
    Py_buffer view;
    wordset_t ws;
    if (!check_nargs("spin_wait", nargs, 4) || !conv_count(args[3], &spins)) {
        return NULL;
    }
    if (get_buf(args[0], &view) < 0) {
        return NULL;
    }
    if (!wordset_init(&ws, &view, args[1], args[2])) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t r;
    Py_BEGIN_ALLOW_THREADS
    /* spins == 0 still polls once. */
    r = wordset_check(&ws);
    for (Py_ssize_t i = 1; r < 0 && i < spins; i++) {
        cpu_relax();
        r = wordset_check(&ws);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(r);
}

static PyObject *
mb_child_wait(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "offsets", "expected", "spin_ns", "timeout", NULL};
    PyObject *obj, *offsets, *expected, *timeout_obj;
    Py_ssize_t spin_ns;
    timeout_t timeout = {0, {0, 0}};
    Py_buffer view;
    wordset_t ws;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO&O:child_wait", kwlist, &obj, &offsets,
                                     &expected, conv_count, &spin_ns, &timeout_obj)) {
        return NULL;
    }
    if (!conv_timeout(timeout_obj, &timeout)) {
        return NULL;
    }
    if (get_buf(obj, &view) < 0) {
        return NULL;
    }
    char *base = base_ptr(&view);
    if (base == NULL || !wordset_init(&ws, &view, offsets, expected)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int32_t *wake_seq = I32_AT(base, OFF_WAKE_SEQ);
    int32_t *parked = I32_AT(base, OFF_CHILD_PARKED);

    Py_ssize_t r;
    long rc = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    /* 1. Spin, bounded by time (clock checked every 64 iterations). */
    r = wordset_check(&ws);
    if (r < 0 && spin_ns > 0) {
        int64_t deadline = monotonic_ns() + (int64_t)spin_ns;
        for (uint64_t it = 1;; it++) {
            cpu_relax();
            r = wordset_check(&ws);
            if (r >= 0) {
                break;
            }
            if ((it & 63) == 0) {
                if (monotonic_ns() >= deadline) {
                    break;
                }
                /* On a machine with more runnable processes than cores (a
                 * busy parent plus spinning children), hand the core back so
                 * the parent can publish the next task; a no-op when idle. */
                sched_yield();
            }
        }
    }
    /* 2. Park (Dekker): announce, re-check, sleep on the wake sequence. */
    if (r < 0) {
        int32_t seq = __atomic_load_n(wake_seq, __ATOMIC_ACQUIRE);
        __atomic_store_n(parked, 1, __ATOMIC_SEQ_CST);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        r = wordset_check(&ws);
        if (r < 0) {
            rc = sys_futex_wait(wake_seq, seq, timeout.has_timeout ? &timeout.ts : NULL);
            if (rc != 0) {
                err = errno;
            }
        }
        __atomic_store_n(parked, 0, __ATOMIC_SEQ_CST);
        if (r < 0) {
            r = wordset_check(&ws);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);

    if (rc != 0) {
        switch (err) {
        case ETIMEDOUT:
        case EAGAIN:
            break;
        case EINTR:
            if (PyErr_CheckSignals() < 0) {
                return NULL;
            }
            break;
        default:
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    return PyLong_FromSsize_t(r);
}

static PyObject *
mb_wake_child(PyObject *Py_UNUSED(m), PyObject *buf)
{
    Py_buffer view;
    if (get_buf(buf, &view) < 0) {
        return NULL;
    }
    char *base = base_ptr(&view);
    if (base == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int woke = wake_child_impl(base);
    PyBuffer_Release(&view);
    return PyBool_FromLong(woke);
}

/* ------------------------------------------------------------------------ */
/* Bulk helpers                                                             */
/* ------------------------------------------------------------------------ */

static PyObject *
mb_publish_task(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf",      "frame_off",   "state",           "config",
                             "slot_id",  "generation",  "digest",          "blob",
                             "protocol", "run_id",      "trailer_slot_id", "trailer_generation",
                             "dispatch_id", NULL};
    PyObject *obj;
    Py_ssize_t frame_off;
    uint32_t state, slot_id;
    uint64_t generation, protocol, run_id, t_slot, t_gen, dispatch_id;
    Py_buffer config = {0}, digest = {0}, blob = {0};
    Py_buffer view;
    PyObject *result = NULL;

    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "OO&O&y*O&O&y*y*O&O&O&O&O&:publish_task", kwlist, &obj, conv_off,
            &frame_off, conv_w32, &state, &config, conv_u32, &slot_id, conv_u64, &generation,
            &digest, &blob, conv_u64, &protocol, conv_u64, &run_id, conv_u64, &t_slot, conv_u64,
            &t_gen, conv_u64, &dispatch_id)) {
        return NULL;
    }
    if (config.len > CONFIG_SIZE) {
        PyErr_Format(PyExc_ValueError, "config of %zd bytes exceeds %d bytes", config.len,
                     CONFIG_SIZE);
        goto out;
    }
    if (digest.len != DIGEST_SIZE) {
        PyErr_Format(PyExc_ValueError, "digest must be exactly %d bytes, got %zd", DIGEST_SIZE,
                     digest.len);
        goto out;
    }
    if (blob.len > MAILBOX_ARGS_CAPACITY) {
        PyErr_Format(PyExc_ValueError,
                     "args blob of %zd bytes exceeds mailbox capacity of %d bytes", blob.len,
                     MAILBOX_ARGS_CAPACITY);
        goto out;
    }
    if (get_buf(obj, &view) < 0) {
        goto out;
    }
    char *f = frame_ptr(&view, frame_off);
    if (f == NULL) {
        goto release;
    }
    int32_t cur = __atomic_load_n(I32_AT(f, OFF_STATE), __ATOMIC_ACQUIRE);
    if (cur != STATE_IDLE) {
        PyErr_Format(PyExc_ValueError, "frame is not idle (state %d)", (int)cur);
        goto release;
    }

    __atomic_store_n(I32_AT(f, OFF_ERROR), 0, __ATOMIC_RELAXED);
    __atomic_store_n(U64_AT(f, OFF_RESERVED), 0, __ATOMIC_RELAXED);
    f[OFF_ERRMSG] = 0;
    __atomic_store_n(I32_AT(f, OFF_ACCEPTED), 0, __ATOMIC_RELAXED);
    __atomic_store_n(I32_AT(f, OFF_DISPOSITION), 0, __ATOMIC_RELAXED);

    memcpy(f + OFF_CONFIG, config.buf, (size_t)config.len);
    memset(f + OFF_CONFIG + config.len, 0, (size_t)(CONFIG_SIZE - config.len));

    __atomic_store_n(U32_AT(f, OFF_LEASE), slot_id, __ATOMIC_RELAXED);
    __atomic_store_n(U32_AT(f, OFF_LEASE + 4), 0, __ATOMIC_RELAXED);
    __atomic_store_n(U64_AT(f, OFF_LEASE + 8), generation, __ATOMIC_RELAXED);

    memcpy(f + OFF_DIGEST, digest.buf, DIGEST_SIZE);

    memcpy(f + OFF_ARGS, blob.buf, (size_t)blob.len);
    if (blob.len < ARGS_HEADER_SIZE) {
        /* Never leave a stale T/S header behind a short blob. */
        memset(f + OFF_ARGS + blob.len, 0, (size_t)(ARGS_HEADER_SIZE - blob.len));
    }

    __atomic_store_n(U64_AT(f, OFF_TRAILER + 0), protocol, __ATOMIC_RELAXED);
    __atomic_store_n(U64_AT(f, OFF_TRAILER + 8), run_id, __ATOMIC_RELAXED);
    __atomic_store_n(U64_AT(f, OFF_TRAILER + 16), t_slot, __ATOMIC_RELAXED);
    __atomic_store_n(U64_AT(f, OFF_TRAILER + 24), t_gen, __ATOMIC_RELAXED);
    __atomic_store_n(U64_AT(f, OFF_TRAILER + 32), dispatch_id, __ATOMIC_RELAXED);

    __atomic_store_n(U32_AT(f, OFF_STATE), state, __ATOMIC_SEQ_CST);
    (void)wake_child_impl((char *)view.buf);

    result = Py_NewRef(Py_None);
release:
    PyBuffer_Release(&view);
out:
    PyBuffer_Release(&config);
    PyBuffer_Release(&digest);
    PyBuffer_Release(&blob);
    return result;
}

static inline PyObject *
u64_obj(const char *f, Py_ssize_t off)
{
    return PyLong_FromUnsignedLongLong(
        (unsigned long long)__atomic_load_n(U64_AT(f, off), __ATOMIC_RELAXED));
}

static PyObject *
mb_read_task(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "frame_off", NULL};
    PyObject *obj;
    Py_ssize_t frame_off;
    Py_buffer view;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO&:read_task", kwlist, &obj, conv_off,
                                     &frame_off)) {
        return NULL;
    }
    if (get_buf(obj, &view) < 0) {
        return NULL;
    }
    const char *f = frame_ptr(&view, frame_off);
    if (f == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    int32_t t = __atomic_load_n(I32_AT(f, OFF_ARGS), __ATOMIC_RELAXED);
    int32_t s = __atomic_load_n(I32_AT(f, OFF_ARGS + 4), __ATOMIC_RELAXED);
    long long need = (long long)ARGS_HEADER_SIZE + (long long)t * TENSOR_DESC_SIZE +
                     (long long)s * 8;
    if (t < 0 || s < 0 || need > MAILBOX_ARGS_CAPACITY) {
        PyErr_Format(PyExc_ValueError,
                     "malformed args blob: T=%d S=%d needs %lld bytes, capacity %d", (int)t,
                     (int)s, need, MAILBOX_ARGS_CAPACITY);
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject *items[10];
    items[0] = PyBytes_FromStringAndSize(f + OFF_CONFIG, CONFIG_SIZE);
    items[1] = PyLong_FromUnsignedLong(
        (unsigned long)__atomic_load_n(U32_AT(f, OFF_LEASE), __ATOMIC_RELAXED));
    items[2] = u64_obj(f, OFF_LEASE + 8);
    items[3] = PyBytes_FromStringAndSize(f + OFF_DIGEST, DIGEST_SIZE);
    items[4] = PyBytes_FromStringAndSize(f + OFF_ARGS, (Py_ssize_t)need);
    items[5] = u64_obj(f, OFF_TRAILER + 0);
    items[6] = u64_obj(f, OFF_TRAILER + 8);
    items[7] = u64_obj(f, OFF_TRAILER + 16);
    items[8] = u64_obj(f, OFF_TRAILER + 24);
    items[9] = u64_obj(f, OFF_TRAILER + 32);
    PyBuffer_Release(&view);
    return steal_tuple(10, items);
}

static PyObject *
mb_read_trailer(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "frame_off", NULL};
    PyObject *obj;
    Py_ssize_t frame_off;
    Py_buffer view;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO&:read_trailer", kwlist, &obj, conv_off,
                                     &frame_off)) {
        return NULL;
    }
    if (get_buf(obj, &view) < 0) {
        return NULL;
    }
    const char *f = frame_ptr(&view, frame_off);
    if (f == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    PyObject *items[5];
    for (int i = 0; i < 5; i++) {
        items[i] = u64_obj(f, OFF_TRAILER + 8 * i);
    }
    PyBuffer_Release(&view);
    return steal_tuple(5, items);
}

static inline int
utf8_cont(unsigned char c)
{
    return (c & 0xC0) == 0x80;
}

static PyObject *
mb_write_result(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "frame_off", "state", "error", "message", NULL};
    PyObject *obj, *message;
    Py_ssize_t frame_off;
    uint32_t state, error;
    Py_buffer view;
    Py_buffer msg = {0};
    PyObject *encoded = NULL;
    const unsigned char *data;
    Py_ssize_t len;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO&O&O&O:write_result", kwlist, &obj,
                                     conv_off, &frame_off, conv_w32, &state, conv_w32, &error,
                                     &message)) {
        return NULL;
    }
    if (PyUnicode_Check(message)) {
        /* Lone surrogates must not make error reporting itself fail. */
        encoded = PyUnicode_AsEncodedString(message, "utf-8", "backslashreplace");
        if (encoded == NULL) {
            return NULL;
        }
        data = (const unsigned char *)PyBytes_AS_STRING(encoded);
        len = PyBytes_GET_SIZE(encoded);
    }
    else {
        if (PyObject_GetBuffer(message, &msg, PyBUF_SIMPLE) < 0) {
            return NULL;
        }
        data = (const unsigned char *)msg.buf;
        len = msg.len;
    }

    PyObject *result = NULL;
    if (get_buf(obj, &view) < 0) {
        goto out;
    }
    char *f = frame_ptr(&view, frame_off);
    if (f == NULL) {
        PyBuffer_Release(&view);
        goto out;
    }

    Py_ssize_t n = len;
    if (n > ERRMSG_SIZE - 1) {
        n = ERRMSG_SIZE - 1;
        /* data[n] is the first byte cut off; if it continues a multibyte
         * sequence, cut before that sequence's lead byte instead. */
        Py_ssize_t m = n;
        while (m > 0 && n - m < 4 && utf8_cont(data[m])) {
            m--;
        }
        if (!utf8_cont(data[m])) {
            n = m;
        }
    }
    memcpy(f + OFF_ERRMSG, data, (size_t)n);
    f[OFF_ERRMSG + n] = 0;
    __atomic_store_n(U32_AT(f, OFF_ERROR), error, __ATOMIC_RELAXED);
    __atomic_store_n(U32_AT(f, OFF_STATE), state, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    result = Py_NewRef(Py_None);
out:
    Py_XDECREF(encoded);
    if (msg.obj != NULL) {
        PyBuffer_Release(&msg);
    }
    return result;
}

static PyObject *
mb_read_result(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "frame_off", NULL};
    PyObject *obj;
    Py_ssize_t frame_off;
    Py_buffer view;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO&:read_result", kwlist, &obj, conv_off,
                                     &frame_off)) {
        return NULL;
    }
    if (get_buf(obj, &view) < 0) {
        return NULL;
    }
    const char *f = frame_ptr(&view, frame_off);
    if (f == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int32_t state = __atomic_load_n(I32_AT(f, OFF_STATE), __ATOMIC_ACQUIRE);
    int32_t error = __atomic_load_n(I32_AT(f, OFF_ERROR), __ATOMIC_RELAXED);
    const char *msg = f + OFF_ERRMSG;
    size_t mlen = strnlen(msg, ERRMSG_SIZE);
    PyObject *items[10];
    items[0] = PyLong_FromLong((long)state);
    items[1] = PyLong_FromLong((long)error);
    items[2] = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)mlen, "replace");
    items[3] = PyLong_FromLong((long)__atomic_load_n(I32_AT(f, OFF_ACCEPTED), __ATOMIC_RELAXED));
    items[4] =
        PyLong_FromLong((long)__atomic_load_n(I32_AT(f, OFF_DISPOSITION), __ATOMIC_RELAXED));
    for (int i = 0; i < 5; i++) {
        items[5 + i] = u64_obj(f, OFF_TRAILER + 8 * i);
    }
    PyBuffer_Release(&view);
    return steal_tuple(10, items);
}

static PyObject *
mb_read_bytes(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "off", "n", NULL};
    PyObject *obj;
    Py_ssize_t off, n;
    Py_buffer view;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO&O&:read_bytes", kwlist, &obj, conv_off,
                                     &off, conv_count, &n)) {
        return NULL;
    }
    if (get_buf(obj, &view) < 0) {
        return NULL;
    }
    const char *p = range_ptr(&view, off, n);
    PyObject *res = p == NULL ? NULL : PyBytes_FromStringAndSize(p, n);
    PyBuffer_Release(&view);
    return res;
}

static PyObject *
mb_write_bytes(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "off", "data", NULL};
    PyObject *obj;
    Py_ssize_t off;
    Py_buffer data;
    Py_buffer view;
    PyObject *res = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO&y*:write_bytes", kwlist, &obj, conv_off,
                                     &off, &data)) {
        return NULL;
    }
    if (get_buf(obj, &view) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    char *p = range_ptr(&view, off, data.len);
    if (p != NULL) {
        memmove(p, data.buf, (size_t)data.len);
        res = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&view);
    PyBuffer_Release(&data);
    return res;
}

static PyObject *
mb_set_pdeathsig(PyObject *Py_UNUSED(m), PyObject *arg)
{
    long signum = PyLong_AsLong(arg);
    if (signum == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (signum < 0 || signum > INT_MAX) {
        errno = EINVAL;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (prctl(PR_SET_PDEATHSIG, (unsigned long)signum, 0UL, 0UL, 0UL) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}


/* fork_sibling() -> int: fork a child of this process's parent (clone(CLONE_PARENT)).
 *
 * The fork server uses it: a replacement child becomes the Worker's own child, so the
 * Worker reaps it (and sees its real wait status) and it outlives a fork server that
 * dies. Same bookkeeping as os.fork() (PyOS_BeforeFork / AfterFork); the caller must
 * be single-threaded. Returns 0 in the child, the pid in the caller. */
static PyObject *
mb_fork_sibling(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(arg))
{
    PyOS_BeforeFork();
    long pid = syscall(SYS_clone, (unsigned long)(CLONE_PARENT | SIGCHLD), 0UL, NULL, NULL, 0UL);
    int saved_errno = errno;
    if (pid == 0) {
        PyOS_AfterFork_Child();
    }
    else {
        PyOS_AfterFork_Parent();
    }
    if (pid < 0) {
        errno = saved_errno;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(pid);
}

/* ------------------------------------------------------------------------ */
/* Module                                                                   */
/* ------------------------------------------------------------------------ */

#define FASTCALL(name, doc) {#name, (PyCFunction)(void (*)(void))mb_##name, METH_FASTCALL, doc}
#define KWCALL(name, doc)                                                                     \
    {#name, (PyCFunction)(void (*)(void))mb_##name, METH_VARARGS | METH_KEYWORDS, doc}

static PyMethodDef mailbox_methods[] = {
    FASTCALL(load32, "load32(buf, off, /) -> int: acquire load of a signed 32-bit word."),
    FASTCALL(load64, "load64(buf, off, /) -> int: acquire load of an unsigned 64-bit word."),
    FASTCALL(store32, "store32(buf, off, value, /) -> None: seq_cst store of a 32-bit word."),
    FASTCALL(store64, "store64(buf, off, value, /) -> None: seq_cst store of a 64-bit word."),
    FASTCALL(cas32, "cas32(buf, off, expected, desired, /) -> bool: seq_cst strong CAS."),
    FASTCALL(cas64, "cas64(buf, off, expected, desired, /) -> bool: seq_cst strong CAS."),
    FASTCALL(fetch_add32, "fetch_add32(buf, off, delta, /) -> int: returns the old value."),
    FASTCALL(fetch_add64, "fetch_add64(buf, off, delta, /) -> int: returns the old value."),
    {"fence", mb_fence, METH_NOARGS, "fence() -> None: seq_cst thread fence."},
    KWCALL(futex_wait,
           "futex_wait(buf, off, expected, timeout=None) -> int: 0 woken, 1 timed out, "
           "2 value != expected, 3 interrupted."),
    FASTCALL(futex_wake, "futex_wake(buf, off, n, /) -> int: number of waiters woken."),
    FASTCALL(spin_wait,
             "spin_wait(buf, offsets, expected, spins, /) -> int: index of the first 32-bit "
             "word that differs from its expected value, or -1 when the spin budget runs out."),
    KWCALL(child_wait,
           "child_wait(buf, offsets, expected, spin_ns, timeout) -> int: spin for spin_ns, "
           "then park on the mailbox wake futex; index of the changed word or -1."),
    {"wake_child", mb_wake_child, METH_O,
     "wake_child(buf, /) -> bool: wake the mailbox's child if it is parked."},
    KWCALL(publish_task, "publish_task(...) -> None: write a task into an idle frame, store "
                         "its state and wake the child."),
    KWCALL(read_task, "read_task(buf, frame_off) -> tuple: (config, slot_id, generation, "
                      "digest, blob, protocol, run_id, trailer_slot_id, trailer_generation, "
                      "dispatch_id)."),
    KWCALL(read_trailer, "read_trailer(buf, frame_off) -> tuple: (protocol, run_id, slot_id, "
                         "generation, dispatch_id)."),
    KWCALL(write_result, "write_result(buf, frame_off, state, error, message) -> None."),
    KWCALL(read_result, "read_result(buf, frame_off) -> tuple: (state, error, message, "
                        "accepted, disposition, protocol, run_id, slot_id, generation, "
                        "dispatch_id)."),
    KWCALL(read_bytes, "read_bytes(buf, off, n) -> bytes."),
    KWCALL(write_bytes, "write_bytes(buf, off, data) -> None."),
    {"set_pdeathsig", mb_set_pdeathsig, METH_O,
     "set_pdeathsig(signum, /) -> None: prctl(PR_SET_PDEATHSIG)."},
    {"fork_sibling", mb_fork_sibling, METH_NOARGS,
     "fork_sibling() -> int: fork a child of this process's parent (CLONE_PARENT); 0 in "
     "the child."},
    {NULL, NULL, 0, NULL},
};

static int
add_int(PyObject *m, const char *name, long value)
{
    return PyModule_AddIntConstant(m, name, value);
}

static int
mailbox_exec(PyObject *m)
{
    static const struct {
        const char *name;
        long value;
    } consts[] = {
        {"ABI_VERSION", ABI_VERSION},
        {"MAILBOX_FRAME_SIZE", MAILBOX_FRAME_SIZE},
        {"MAILBOX_NUM_FRAMES", MAILBOX_NUM_FRAMES},
        {"MAILBOX_SIZE", MAILBOX_SIZE},
        {"OFF_STATE", OFF_STATE},
        {"OFF_ERROR", OFF_ERROR},
        {"OFF_RESERVED", OFF_RESERVED},
        {"OFF_CONFIG", OFF_CONFIG},
        {"CONFIG_SIZE", CONFIG_SIZE},
        {"OFF_LEASE", OFF_LEASE},
        {"OFF_DIGEST", OFF_DIGEST},
        {"DIGEST_SIZE", DIGEST_SIZE},
        {"OFF_ARGS", OFF_ARGS},
        {"MAILBOX_ARGS_CAPACITY", MAILBOX_ARGS_CAPACITY},
        {"OFF_WAKE_SEQ", OFF_WAKE_SEQ},
        {"OFF_CHILD_PARKED", OFF_CHILD_PARKED},
        {"OFF_SHUTDOWN", OFF_SHUTDOWN},
        {"OFF_TRAILER", OFF_TRAILER},
        {"TRAILER_SIZE", TRAILER_SIZE},
        {"OFF_ACCEPTED", OFF_ACCEPTED},
        {"OFF_DISPOSITION", OFF_DISPOSITION},
        {"OFF_ERRMSG", OFF_ERRMSG},
        {"ERRMSG_SIZE", ERRMSG_SIZE},
        {"TENSOR_DESC_SIZE", TENSOR_DESC_SIZE},
    };
    static const struct {
        const char *name;
        long value;
    } states[] = {
        {"IDLE", STATE_IDLE},
        {"TASK_READY", STATE_TASK_READY},
        {"TASK_DONE", STATE_TASK_DONE},
        {"SHUTDOWN", STATE_SHUTDOWN},
        {"CONTROL_REQUEST", STATE_CONTROL_REQUEST},
        {"CONTROL_DONE", STATE_CONTROL_DONE},
        {"INIT_READY", STATE_INIT_READY},
        {"INIT_FAILED", STATE_INIT_FAILED},
        {"FRAME_STAGED", STATE_FRAME_STAGED},
        {"TASK_LAUNCHED", STATE_TASK_LAUNCHED},
        {"TASK_FAILED", STATE_TASK_FAILED},
        {"ACTIVATE", STATE_ACTIVATE},
        {"PREPARE_READY", STATE_PREPARE_READY},
    };

    for (size_t i = 0; i < sizeof(consts) / sizeof(consts[0]); i++) {
        if (add_int(m, consts[i].name, consts[i].value) < 0) {
            return -1;
        }
    }
    PyObject *d = PyDict_New();
    if (d == NULL) {
        return -1;
    }
    for (size_t i = 0; i < sizeof(states) / sizeof(states[0]); i++) {
        char name[64];
        PyOS_snprintf(name, sizeof(name), "STATE_%s", states[i].name);
        PyObject *v = PyLong_FromLong(states[i].value);
        if (v == NULL || PyDict_SetItemString(d, states[i].name, v) < 0 ||
            PyModule_AddObjectRef(m, name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return -1;
        }
        Py_DECREF(v);
    }
    if (PyModule_AddObjectRef(m, "STATES", d) < 0) {
        Py_DECREF(d);
        return -1;
    }
    Py_DECREF(d);
    return 0;
}

static PyModuleDef_Slot mailbox_slots[] = {
    {Py_mod_exec, (void *)mailbox_exec},
    {0, NULL},
};

static struct PyModuleDef mailbox_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "simpler_daemon._mailbox",
    .m_doc = "Shared-memory mailbox offsets, atomics, futex park/wake and bulk task "
             "publication helpers.",
    .m_size = 0,
    .m_methods = mailbox_methods,
    .m_slots = mailbox_slots,
};

PyMODINIT_FUNC
PyInit__mailbox(void)
{
    return PyModuleDef_Init(&mailbox_module);
}
