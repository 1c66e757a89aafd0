/*
 * simpler_daemon.mailbox._mailbox: atomics and futex words.
 *
 * acquire/seq_cst loads, stores, CAS and fetch-add on 32/64-bit words inside a
 * writable buffer, and FUTEX_WAIT/FUTEX_WAKE on a word in MAP_SHARED memory.
 */

#include "_mailbox.h"

/* ------------------------------------------------------------------------ */
/* Atomics                                                                  */
/* ------------------------------------------------------------------------ */

PyObject *
mb_load32(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    Py_buffer view;
    if (!mb_check_nargs("load32", nargs, 2) || !mb_conv_off(args[1], &off)) {
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

PyObject *
mb_load64(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    Py_buffer view;
    if (!mb_check_nargs("load64", nargs, 2) || !mb_conv_off(args[1], &off)) {
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

PyObject *
mb_store32(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    uint32_t value;
    Py_buffer view;
    if (!mb_check_nargs("store32", nargs, 3) || !mb_conv_off(args[1], &off) ||
        !mb_conv_w32(args[2], &value)) {
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

PyObject *
mb_store64(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    uint64_t value;
    Py_buffer view;
    if (!mb_check_nargs("store64", nargs, 3) || !mb_conv_off(args[1], &off) ||
        !mb_conv_w64(args[2], &value)) {
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

PyObject *
mb_cas32(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    uint32_t expected, desired;
    Py_buffer view;
    if (!mb_check_nargs("cas32", nargs, 4) || !mb_conv_off(args[1], &off) ||
        !mb_conv_w32(args[2], &expected) || !mb_conv_w32(args[3], &desired)) {
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

PyObject *
mb_cas64(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    uint64_t expected, desired;
    Py_buffer view;
    if (!mb_check_nargs("cas64", nargs, 4) || !mb_conv_off(args[1], &off) ||
        !mb_conv_w64(args[2], &expected) || !mb_conv_w64(args[3], &desired)) {
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

PyObject *
mb_fetch_add32(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    uint32_t delta;
    Py_buffer view;
    if (!mb_check_nargs("fetch_add32", nargs, 3) || !mb_conv_off(args[1], &off) ||
        !mb_conv_w32(args[2], &delta)) {
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

PyObject *
mb_fetch_add64(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off;
    uint64_t delta;
    Py_buffer view;
    if (!mb_check_nargs("fetch_add64", nargs, 3) || !mb_conv_off(args[1], &off) ||
        !mb_conv_w64(args[2], &delta)) {
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

PyObject *
mb_fence(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored))
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------ */
/* Futex                                                                    */
/* ------------------------------------------------------------------------ */

PyObject *
mb_futex_wait(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "off", "expected", "timeout", NULL};
    PyObject *obj;
    Py_ssize_t off;
    uint32_t expected;
    timeout_t timeout = {0, {0, 0}};
    PyObject *timeout_obj = Py_None;
    Py_buffer view;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO&O&|O:futex_wait", kwlist, &obj, mb_conv_off,
                                     &off, mb_conv_w32, &expected, &timeout_obj)) {
        return NULL;
    }
    if (!mb_conv_timeout(timeout_obj, &timeout)) {
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

PyObject *
mb_futex_wake(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t off, n;
    Py_buffer view;
    if (!mb_check_nargs("futex_wake", nargs, 3) || !mb_conv_off(args[1], &off) ||
        !mb_conv_count(args[2], &n)) {
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
