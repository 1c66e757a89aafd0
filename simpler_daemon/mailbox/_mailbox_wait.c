/*
 * simpler_daemon.mailbox._mailbox: spin, then park.
 *
 * spin_wait (bounded spin over up to 8 words), child_wait (the child's spin-then-
 * park on its mailbox wake futex) and wake_child (the parent's side of that
 * Dekker handshake).
 */

#include "_mailbox.h"

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
        if (!mb_conv_off(PySequence_Fast_GET_ITEM(offs, i), &off) ||
            !mb_conv_w32(PySequence_Fast_GET_ITEM(exps, i), &e)) {
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

PyObject *
mb_spin_wait(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t spins;
    Py_buffer view;
    wordset_t ws;
    if (!mb_check_nargs("spin_wait", nargs, 4) || !mb_conv_count(args[3], &spins)) {
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

PyObject *
mb_child_wait(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "offsets", "expected", "spin_ns", "timeout", NULL};
    PyObject *obj, *offsets, *expected, *timeout_obj;
    Py_ssize_t spin_ns;
    timeout_t timeout = {0, {0, 0}};
    Py_buffer view;
    wordset_t ws;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO&O:child_wait", kwlist, &obj, &offsets,
                                     &expected, mb_conv_count, &spin_ns, &timeout_obj)) {
        return NULL;
    }
    if (!mb_conv_timeout(timeout_obj, &timeout)) {
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

PyObject *
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

/* child_claim(buf, hold, /) -> int: a SUB child's pick of its next task over its two
 * task frames (a queue frame, docs/mailbox.md).  -1 while the frame at offset `hold`
 * (0: none) still says TASK_DONE: the parent has not read that task's unusual end, so
 * no other frame is taken.  Else the TASK_READY frame with the lower dispatch id, claimed
 * by compare-exchange TASK_READY -> TASK_LAUNCHED: its offset; 0 when no frame is ready
 * (or the parent took the ready one back first). */
PyObject *
mb_child_claim(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t hold;
    if (!mb_check_nargs("child_claim", nargs, 2) || !mb_conv_off(args[1], &hold)) {
        return NULL;
    }
    Py_buffer view;
    if (get_buf(args[0], &view) < 0) {
        return NULL;
    }
    char *base = base_ptr(&view);
    if (base == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (hold != 0 && hold != MAILBOX_FRAME_SIZE && hold != 2 * MAILBOX_FRAME_SIZE) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "child_claim: hold %zd is not a task frame", hold);
        return NULL;
    }
    long got = 0;
    if (hold && __atomic_load_n(I32_AT(base, hold + OFF_STATE), __ATOMIC_ACQUIRE) ==
                    STATE_TASK_DONE) {
        got = -1;
    }
    else {
        char *f0 = base + MAILBOX_FRAME_SIZE, *f1 = base + 2 * MAILBOX_FRAME_SIZE;
        for (int tries = 0; tries < 2 && got == 0; tries++) {
            int r0 = __atomic_load_n(I32_AT(f0, OFF_STATE), __ATOMIC_ACQUIRE) == STATE_TASK_READY;
            int r1 = __atomic_load_n(I32_AT(f1, OFF_STATE), __ATOMIC_ACQUIRE) == STATE_TASK_READY;
            if (!r0 && !r1) {
                break;
            }
            char *f = r0 ? f0 : f1;
            if (r0 && r1 &&
                __atomic_load_n(U64_AT(f1, OFF_TRAILER + 32), __ATOMIC_ACQUIRE) <
                    __atomic_load_n(U64_AT(f0, OFF_TRAILER + 32), __ATOMIC_ACQUIRE)) {
                f = f1;
            }
            int32_t want = STATE_TASK_READY;
            if (__atomic_compare_exchange_n(I32_AT(f, OFF_STATE), &want, STATE_TASK_LAUNCHED, 0,
                                            __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
                got = (long)(f - base);
            }
        }
    }
    PyBuffer_Release(&view);
    return PyLong_FromLong(got);
}
