/*
 * simpler_daemon.mailbox._mailbox: argument converters.
 *
 * Python ints, counts and timeouts to C values with the errors the entry points
 * document (IndexError on a bad offset rather than OverflowError, OverflowError
 * naming the field width), plus the tuple and arity helpers they share.
 */

#include "_mailbox.h"

/* ------------------------------------------------------------------------ */
/* Argument converters (usable with "O&" and directly)                      */
/* ------------------------------------------------------------------------ */

/* Byte offset: any index-able int; out-of-ssize_t values are clamped so that
 * the bounds check reports IndexError rather than OverflowError. */
int
mb_conv_off(PyObject *obj, void *out)
{
    Py_ssize_t v = PyNumber_AsSsize_t(obj, NULL);
    if (v == -1 && PyErr_Occurred()) {
        return 0;
    }
    *(Py_ssize_t *)out = v;
    return 1;
}

/* Non-negative count. */
int
mb_conv_count(PyObject *obj, void *out)
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
int
mb_conv_w32(PyObject *obj, void *out)
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
int
mb_conv_u32(PyObject *obj, void *out)
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
int
mb_conv_w64(PyObject *obj, void *out)
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
int
mb_conv_u64(PyObject *obj, void *out)
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


int
mb_conv_timeout(PyObject *obj, void *out)
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
PyObject *
mb_steal_tuple(Py_ssize_t n, PyObject **items)
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

int
mb_check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd positional arguments (%zd given)",
                     name, want, nargs);
        return 0;
    }
    return 1;
}
