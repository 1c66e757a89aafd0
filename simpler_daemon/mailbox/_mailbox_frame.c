/*
 * simpler_daemon.mailbox._mailbox: frame access.
 *
 * Bulk helpers that read or write a whole task frame in one call: publish a task,
 * read a task / trailer / result, write a result, raw byte ranges.
 */

#include "_mailbox.h"

/* ------------------------------------------------------------------------ */
/* Bulk helpers                                                             */
/* ------------------------------------------------------------------------ */

PyObject *
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
            args, kwargs, "OO&O&y*O&O&y*y*O&O&O&O&O&:publish_task", kwlist, &obj, mb_conv_off,
            &frame_off, mb_conv_w32, &state, &config, mb_conv_u32, &slot_id, mb_conv_u64, &generation,
            &digest, &blob, mb_conv_u64, &protocol, mb_conv_u64, &run_id, mb_conv_u64, &t_slot, mb_conv_u64,
            &t_gen, mb_conv_u64, &dispatch_id)) {
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
    if (blob.len + 4 <= MAILBOX_ARGS_CAPACITY) {
        memset(f + OFF_ARGS + blob.len, 0, 4); /* no stale values magic after the blob */
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

/* The frame named by a (buf, frame_off) call of the reading functions below, with
 * `view` held (the caller releases it); NULL with an error set. `format` names the
 * function ("OO&:read_task"). */
static const char *
kw_frame(PyObject *args, PyObject *kwargs, const char *format, Py_buffer *view)
{
    static char *kwlist[] = {"buf", "frame_off", NULL};
    PyObject *obj;
    Py_ssize_t frame_off;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, format, kwlist, &obj, mb_conv_off,
                                     &frame_off)) {
        return NULL;
    }
    if (get_buf(obj, view) < 0) {
        return NULL;
    }
    const char *f = frame_ptr(view, frame_off);
    if (f == NULL) {
        PyBuffer_Release(view);
    }
    return f;
}

/* The length of the args blob in the frame at `f` (descriptors, scalars and a values
 * section, if any); -1 with ValueError set when its header or values section is
 * malformed.  The caller has read the frame's state (acquire). */
static long long
task_blob_len(const char *f)
{
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    int32_t t = __atomic_load_n(I32_AT(f, OFF_ARGS), __ATOMIC_RELAXED);
    int32_t s = __atomic_load_n(I32_AT(f, OFF_ARGS + 4), __ATOMIC_RELAXED);
    long long need = (long long)ARGS_HEADER_SIZE + (long long)t * TENSOR_DESC_SIZE +
                     (long long)s * 8;
    if (t < 0 || s < 0 || need > MAILBOX_ARGS_CAPACITY) {
        PyErr_Format(PyExc_ValueError,
                     "malformed args blob: T=%d S=%d needs %lld bytes, capacity %d", (int)t,
                     (int)s, need, MAILBOX_ARGS_CAPACITY);
        return -1;
    }
    if (need + VALUES_SECTION_SIZE <= MAILBOX_ARGS_CAPACITY &&
        __atomic_load_n(U32_AT(f, OFF_ARGS + need), __ATOMIC_RELAXED) == VALUES_MAGIC) {
        uint32_t where = __atomic_load_n(U32_AT(f, OFF_ARGS + need + 4), __ATOMIC_RELAXED);
        uint64_t nv = __atomic_load_n(U64_AT(f, OFF_ARGS + need + 8), __ATOMIC_RELAXED);
        uint64_t nk = __atomic_load_n(U64_AT(f, OFF_ARGS + need + 16), __ATOMIC_RELAXED);
        long long total = need + VALUES_SECTION_SIZE;
        if (where == 0) {
            total = (nv > MAILBOX_ARGS_CAPACITY || nk > MAILBOX_ARGS_CAPACITY)
                        ? MAILBOX_ARGS_CAPACITY + 1
                        : total + (long long)(nv + nk);
        }
        if (where > 1 || total > MAILBOX_ARGS_CAPACITY) {
            PyErr_Format(PyExc_ValueError,
                         "malformed values section: where=%u, %llu + %llu bytes after %lld",
                         (unsigned)where, (unsigned long long)nv, (unsigned long long)nk, need);
            return -1;
        }
        need = total;
    }
    return need;
}

PyObject *
mb_read_task(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    Py_buffer view;
    const char *f = kw_frame(args, kwargs, "OO&:read_task", &view);
    if (f == NULL) {
        return NULL;
    }
    long long need = task_blob_len(f);
    if (need < 0) {
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
    return mb_steal_tuple(10, items);
}

/* The task frame (not the base frame) named by a child_take / child_done call's first
 * two arguments, with `view` held (the caller releases it); NULL with an error set. */
static char *
child_frame(const char *name, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
            Py_buffer *view)
{
    Py_ssize_t frame_off;
    if (!mb_check_nargs(name, nargs, want) || !mb_conv_off(args[1], &frame_off)) {
        return NULL;
    }
    if (get_buf(args[0], view) < 0) {
        return NULL;
    }
    char *f = frame_ptr(view, frame_off);
    if (f != NULL && frame_off == 0) {
        PyErr_Format(PyExc_ValueError, "%s: the base frame carries no task", name);
        f = NULL;
    }
    if (f == NULL) {
        PyBuffer_Release(view);
    }
    return f;
}

/* child_take(buf, frame_off, /) -> (deadline_ms, digest, blob): what a SUB child reads
 * of the task it claimed, after storing its pick-up word (OFF_ACCEPTED = 1) first: the
 * deadline (the config's first word), the callable's digest and the args blob, as
 * read_task gives them, in one call. */
PyObject *
mb_child_take(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    char *f = child_frame("child_take", args, nargs, 2, &view);
    if (f == NULL) {
        return NULL;
    }
    __atomic_store_n(I32_AT(f, OFF_ACCEPTED), 1, __ATOMIC_SEQ_CST);
    long long need = task_blob_len(f);
    if (need < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t deadline;
    memcpy(&deadline, f + OFF_CONFIG, sizeof deadline); /* little-endian, as int.from_bytes */
    PyObject *items[3];
    items[0] = PyLong_FromUnsignedLongLong((unsigned long long)deadline);
    items[1] = PyBytes_FromStringAndSize(f + OFF_DIGEST, DIGEST_SIZE);
    items[2] = PyBytes_FromStringAndSize(f + OFF_ARGS, (Py_ssize_t)need);
    PyBuffer_Release(&view);
    return mb_steal_tuple(3, items);
}

/* child_done(buf, frame_off, doorbell, /) -> bool: a SUB task's plain end (no error, no
 * value): write_result(buf, frame_off, TASK_DONE, 0, "") then the doorbell's completion
 * count + 1; True when the parent is parked on the doorbell (the caller rings it). */
PyObject *
mb_child_done(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view, bell;
    char *f = child_frame("child_done", args, nargs, 3, &view);
    if (f == NULL) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &bell, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (bell.len < DOORBELL_SIZE || ((uintptr_t)bell.buf) % 8 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "child_done: the doorbell must be %d bytes, 8-byte aligned (got %zd)",
                     DOORBELL_SIZE, bell.len);
        PyBuffer_Release(&bell);
        PyBuffer_Release(&view);
        return NULL;
    }
    f[OFF_ERRMSG] = 0;
    __atomic_store_n(U32_AT(f, OFF_ERROR), 0, __ATOMIC_RELAXED);
    __atomic_store_n(U32_AT(f, OFF_STATE), STATE_TASK_DONE, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(I32_AT(bell.buf, DOORBELL_OFF_COMPLETED), 1, __ATOMIC_SEQ_CST);
    int parked = __atomic_load_n(I32_AT(bell.buf, DOORBELL_OFF_PARKED), __ATOMIC_SEQ_CST) != 0;
    PyBuffer_Release(&bell);
    PyBuffer_Release(&view);
    return PyBool_FromLong(parked);
}

PyObject *
mb_read_trailer(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    Py_buffer view;
    const char *f = kw_frame(args, kwargs, "OO&:read_trailer", &view);
    if (f == NULL) {
        return NULL;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    PyObject *items[5];
    for (int i = 0; i < 5; i++) {
        items[i] = u64_obj(f, OFF_TRAILER + 8 * i);
    }
    PyBuffer_Release(&view);
    return mb_steal_tuple(5, items);
}

static inline int
utf8_cont(unsigned char c)
{
    return (c & 0xC0) == 0x80;
}

PyObject *
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
                                     mb_conv_off, &frame_off, mb_conv_w32, &state, mb_conv_w32, &error,
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

PyObject *
mb_read_result(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    Py_buffer view;
    const char *f = kw_frame(args, kwargs, "OO&:read_result", &view);
    if (f == NULL) {
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
    return mb_steal_tuple(10, items);
}

PyObject *
mb_read_bytes(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "off", "n", NULL};
    PyObject *obj;
    Py_ssize_t off, n;
    Py_buffer view;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO&O&:read_bytes", kwlist, &obj, mb_conv_off,
                                     &off, mb_conv_count, &n)) {
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

PyObject *
mb_write_bytes(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "off", "data", NULL};
    PyObject *obj;
    Py_ssize_t off;
    Py_buffer data;
    Py_buffer view;
    PyObject *res = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO&y*:write_bytes", kwlist, &obj, mb_conv_off,
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
