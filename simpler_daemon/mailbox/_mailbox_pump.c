/*
 * simpler_daemon.mailbox._mailbox: the SUB pump.
 *
 * The per-task hot loop of single-frame SUB lanes over one ready queue (see
 * sub_pump below and docs/mailbox.md, "The SUB fast loop").
 */

#include "_mailbox.h"

/* ------------------------------------------------------------------------ */
/* SUB pump: the per-task hot loop of single-frame SUB lanes                */
/* ------------------------------------------------------------------------ */

/* sub_pump(lanes, queue, ready, published, spin_ns, max_publish) -> int
 *
 * One call runs the per-task loop of the SUB lanes in `lanes` over the ready queue
 * `queue` (a collections.deque of TaskSlot, the Scheduler's SUB queue of one run):
 * poll each lane's task frame, complete a task that finished plainly, take the next
 * ready slot from the head of `queue`, publish it (payload, trailer, state, wake the
 * child), until nothing is in flight, `max_publish` slots were published, no lane
 * progressed for `spin_ns` (0: one pass over the lanes, so that a task it published is
 * never completed by the same call), or a task of another run than the queue's head (one
 * in flight at entry) completed: that pass is the last, so the Scheduler sees the other
 * run's completion at once.  It decides no policy: the Scheduler chose the queue and
 * the lanes; the pump stops at anything unusual and leaves it to the Python path: a
 * completion that needs it ends the call after the current pass, with nothing more
 * published in that pass.
 *
 * Each lane is a list [buf, frame_off, slot, dispatch_id, next_dispatch_id,
 * published_ns, stop, done, peer] (SUBPUMP_* indices below), read at entry and
 * written back on every exit, also on error, so the caller always sees what is in
 * flight.  A lane list is one task frame: `peer` is the index in `lanes` of the other
 * task frame of the same child (a queue frame, docs/mailbox.md), or -1.  The two share
 * the child's dispatch counter (the child runs its frames in dispatch order).  A pass
 * publishes into free children first (both frames IDLE) and only then queues a task
 * into the free frame of a busy child, behind a task of the same run only; a frame left
 * to the Python path (stop) closes the queue, so nothing is queued behind it.  `slot` is the TaskSlot in flight (None: the frame is IDLE), `stop` is set
 * to 1 when its completion needs the Python path (an error, a failed or stale frame,
 * an oversized result) and to 2 when its frame was not IDLE at publication.
 *
 * The head of `queue` is taken only if `slot.state is ready`, `slot.group_size == 1`
 * and its config, digest and blob fit the frame; otherwise the pump publishes nothing
 * more (the Python path handles that head).  Published slots are appended to
 * `published` in order; completed ones to their lane's `done` list, as the slot (no
 * value) or as (slot, bytes) (a value of at most SUBPUMP_MAX_RESULT bytes), in
 * completion order.  The caller claims and completes them.  The GIL is held while
 * Python objects are touched; once a pass made no progress (every lane busy, or nothing
 * more to publish) the call waits for a completion with the GIL released, yielding the
 * core every 64 polls.  `spin_ns` and `max_publish` bound the call. */


/* The TaskSlot fields read here, the contract with the Python side: state (only the
 * `ready` object is taken), group_size (1), blobs (a list or tuple of one bytes blob),
 * config_bytes and digest (bytes), run_id, slot_id, lease_slot and lease_generation
 * (unsigned 64-bit values for the lease and the trailer).  The same list is
 * PUMP_SLOT_FIELDS in simpler_daemon/scheduler/runmodel.py (a test compares the two):
 * rename or retype a field at both ends.  `popleft` is the deque's method. */
static PyObject *str_state, *str_group_size, *str_blobs, *str_config_bytes, *str_digest,
    *str_run_id, *str_slot_id, *str_lease_slot, *str_lease_generation, *str_popleft;

typedef struct {
    Py_buffer view;
    int have_view;
    char *f;
    PyObject *slot; /* strong reference or NULL */
    uint64_t did, next, run_id, slot_id, gen;
    uint64_t *nextp; /* the dispatch counter: this lane's `next`, or its peer's */
    Py_ssize_t peer; /* the other frame of the same child, or -1 */
    int64_t at;
    long stop;
    /* The task in flight is one of another run than the queue's, published before the
     * call: its completion ends the call after the pass. */
    int other;
    PyObject *lane; /* strong: the lane's list (written back at the end) */
    PyObject *done; /* strong: the lane's done list */
} pump_lane;

/* An attribute of `obj` as an unsigned 64-bit value; 0 with an error set on failure. */
static int
attr_u64(PyObject *obj, PyObject *name, uint64_t *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) {
        return 0;
    }
    int ok = mb_conv_u64(v, out);
    Py_DECREF(v);
    return ok;
}

/* The trailer identity of `slot`: run_id, slot_id, lease_generation. */
static int
slot_identity(PyObject *slot, pump_lane *ln)
{
    return attr_u64(slot, str_run_id, &ln->run_id) && attr_u64(slot, str_slot_id, &ln->slot_id) &&
           attr_u64(slot, str_lease_generation, &ln->gen);
}

/* Item i of a lane list, borrowed; NULL with an error when the list shrank (an
 * __index__ of one of its items could change it while the lane is read). */
static PyObject *
lane_item(PyObject *lane, Py_ssize_t i)
{
    if (PyList_GET_SIZE(lane) != SUBPUMP_FIELDS) {
        PyErr_SetString(PyExc_RuntimeError, "sub_pump: a lane changed size during the call");
        return NULL;
    }
    return PyList_GET_ITEM(lane, i);
}

static int
lane_int(PyObject *lane, Py_ssize_t i, uint64_t *out)
{
    PyObject *v = lane_item(lane, i);
    return v != NULL && mb_conv_u64(v, out);
}

static int
lane_set(PyObject *lane, Py_ssize_t i, PyObject *value)
{
    if (value == NULL) {
        return -1;
    }
    return PyList_SetItem(lane, i, value); /* steals */
}

/* Write a lane's state back into its list; -1 on error (memory). */
static int
pump_writeback(PyObject *lane, pump_lane *ln)
{
    int rc = 0;
    rc |= lane_set(lane, SUBPUMP_SLOT, ln->slot != NULL ? Py_NewRef(ln->slot) : Py_NewRef(Py_None));
    rc |= lane_set(lane, SUBPUMP_DID, PyLong_FromUnsignedLongLong(ln->did));
    rc |= lane_set(lane, SUBPUMP_NEXT, PyLong_FromUnsignedLongLong(*ln->nextp));
    rc |= lane_set(lane, SUBPUMP_AT, PyLong_FromLongLong(ln->at));
    rc |= lane_set(lane, SUBPUMP_STOP, PyLong_FromLong(ln->stop));
    return rc ? -1 : 0;
}

/* The frame's completion: 1 completed (slot released), 0 still running, -1 needs the
 * Python path (stop set), -2 error (exception set). */
static int
pump_poll(pump_lane *ln)
{
    char *f = ln->f;
    int32_t st = __atomic_load_n(I32_AT(f, OFF_STATE), __ATOMIC_ACQUIRE);
    if (st == STATE_TASK_READY || st == STATE_TASK_LAUNCHED) { /* LAUNCHED: claimed */
        return 0;
    }
    if (st != STATE_TASK_DONE || __atomic_load_n(I32_AT(f, OFF_ERROR), __ATOMIC_RELAXED) != 0 ||
        __atomic_load_n(U64_AT(f, OFF_TRAILER + 0), __ATOMIC_RELAXED) != SUBPUMP_PROTOCOL ||
        __atomic_load_n(U64_AT(f, OFF_TRAILER + 8), __ATOMIC_RELAXED) != ln->run_id ||
        __atomic_load_n(U64_AT(f, OFF_TRAILER + 16), __ATOMIC_RELAXED) != ln->slot_id ||
        __atomic_load_n(U64_AT(f, OFF_TRAILER + 24), __ATOMIC_RELAXED) != ln->gen ||
        __atomic_load_n(U64_AT(f, OFF_TRAILER + 32), __ATOMIC_RELAXED) != ln->did) {
        ln->stop = 1;
        return -1;
    }
    uint64_t n = __atomic_load_n(U64_AT(f, OFF_RESERVED), __ATOMIC_RELAXED);
    if (n > SUBPUMP_MAX_RESULT) {
        ln->stop = 1;
        return -1;
    }
    if (n == 0) {
        if (PyList_Append(ln->done, ln->slot) < 0) {
            return -2;
        }
    }
    else {
        PyObject *data = PyBytes_FromStringAndSize(f + OFF_ARGS, (Py_ssize_t)n);
        if (data == NULL) {
            return -2;
        }
        PyObject *pair = PyTuple_Pack(2, ln->slot, data);
        Py_DECREF(data);
        if (pair == NULL) {
            return -2;
        }
        int rc = PyList_Append(ln->done, pair);
        Py_DECREF(pair);
        if (rc < 0) {
            return -2;
        }
    }
    __atomic_store_n(I32_AT(f, OFF_STATE), STATE_IDLE, __ATOMIC_SEQ_CST);
    Py_CLEAR(ln->slot);
    return 1;
}

/* Publish the head of `queue` into the lane's frame: 1 published, 0 the head is not
 * for the pump (or the queue is empty), 3 the head is not of the run of `behind` (the
 * task this queue frame would wait behind: a task is queued only behind one of its own
 * run), -1 the frame is not IDLE (stop set), -2 error. */
static int
pump_publish(pump_lane *ln, const pump_lane *behind, PyObject *queue, PyObject *ready,
             PyObject *published)
{
    if (PyObject_Length(queue) <= 0) {
        return PyErr_Occurred() ? -2 : 0;
    }
    PyObject *item = PySequence_GetItem(queue, 0);
    if (item == NULL) {
        return -2;
    }
    int rc = -2;
    PyObject *state = NULL, *gsize = NULL, *blobs = NULL, *config = NULL, *digest = NULL;
    PyObject *popped = NULL;
    uint64_t lease_slot, gen, run_id, slot_id;
    state = PyObject_GetAttr(item, str_state);
    if (state == NULL) {
        goto out;
    }
    if (state != ready) {
        rc = 0;
        goto out;
    }
    gsize = PyObject_GetAttr(item, str_group_size);
    blobs = PyObject_GetAttr(item, str_blobs);
    config = PyObject_GetAttr(item, str_config_bytes);
    digest = PyObject_GetAttr(item, str_digest);
    if (gsize == NULL || blobs == NULL || config == NULL || digest == NULL) {
        goto out;
    }
    if (!PyLong_CheckExact(gsize) || PyLong_AsLong(gsize) != 1 || !PyBytes_CheckExact(config) ||
        PyBytes_GET_SIZE(config) > CONFIG_SIZE || !PyBytes_CheckExact(digest) ||
        PyBytes_GET_SIZE(digest) != DIGEST_SIZE) {
        rc = PyErr_Occurred() ? -2 : 0;
        goto out;
    }
    /* A list of one blob, or the shared tuple of a plain task's (no allocation per task). */
    PyObject *blob = NULL;
    if (PyList_CheckExact(blobs) && PyList_GET_SIZE(blobs) == 1) {
        blob = PyList_GET_ITEM(blobs, 0);
    }
    else if (PyTuple_CheckExact(blobs) && PyTuple_GET_SIZE(blobs) == 1) {
        blob = PyTuple_GET_ITEM(blobs, 0);
    }
    if (blob == NULL || !PyBytes_CheckExact(blob) ||
        PyBytes_GET_SIZE(blob) > MAILBOX_ARGS_CAPACITY) {
        rc = 0;
        goto out;
    }
    if (!attr_u64(item, str_lease_slot, &lease_slot) ||
        !attr_u64(item, str_lease_generation, &gen) || !attr_u64(item, str_run_id, &run_id) ||
        !attr_u64(item, str_slot_id, &slot_id)) {
        goto out;
    }
    if (behind != NULL && behind->run_id != run_id) {
        rc = 3;
        goto out;
    }
    if (lease_slot > UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "lease slot %llu out of range",
                     (unsigned long long)lease_slot);
        goto out;
    }
    char *f = ln->f;
    if (__atomic_load_n(I32_AT(f, OFF_STATE), __ATOMIC_ACQUIRE) != STATE_IDLE) {
        ln->stop = 2;
        rc = -1;
        goto out;
    }
    popped = PyObject_CallMethodNoArgs(queue, str_popleft);
    if (popped == NULL) {
        goto out;
    }
    if (popped != item) {
        PyErr_SetString(PyExc_RuntimeError, "sub_pump: the queue changed during the call");
        goto out;
    }
    if (PyList_Append(published, item) < 0) {
        goto out;
    }
    Py_ssize_t clen = PyBytes_GET_SIZE(config), blen = PyBytes_GET_SIZE(blob);
    __atomic_store_n(I32_AT(f, OFF_ERROR), 0, __ATOMIC_RELAXED);
    __atomic_store_n(U64_AT(f, OFF_RESERVED), 0, __ATOMIC_RELAXED);
    f[OFF_ERRMSG] = 0;
    __atomic_store_n(I32_AT(f, OFF_ACCEPTED), 0, __ATOMIC_RELAXED);
    __atomic_store_n(I32_AT(f, OFF_DISPOSITION), 0, __ATOMIC_RELAXED);
    memcpy(f + OFF_CONFIG, PyBytes_AS_STRING(config), (size_t)clen);
    memset(f + OFF_CONFIG + clen, 0, (size_t)(CONFIG_SIZE - clen));
    __atomic_store_n(U32_AT(f, OFF_LEASE), (uint32_t)lease_slot, __ATOMIC_RELAXED);
    __atomic_store_n(U32_AT(f, OFF_LEASE + 4), 0, __ATOMIC_RELAXED);
    __atomic_store_n(U64_AT(f, OFF_LEASE + 8), gen, __ATOMIC_RELAXED);
    memcpy(f + OFF_DIGEST, PyBytes_AS_STRING(digest), DIGEST_SIZE);
    memcpy(f + OFF_ARGS, PyBytes_AS_STRING(blob), (size_t)blen);
    if (blen < ARGS_HEADER_SIZE) {
        memset(f + OFF_ARGS + blen, 0, (size_t)(ARGS_HEADER_SIZE - blen));
    }
    if (blen + 4 <= MAILBOX_ARGS_CAPACITY) {
        memset(f + OFF_ARGS + blen, 0, 4); /* no stale values magic after the blob */
    }
    uint64_t did = *ln->nextp;
    __atomic_store_n(U64_AT(f, OFF_TRAILER + 0), SUBPUMP_PROTOCOL, __ATOMIC_RELAXED);
    __atomic_store_n(U64_AT(f, OFF_TRAILER + 8), run_id, __ATOMIC_RELAXED);
    __atomic_store_n(U64_AT(f, OFF_TRAILER + 16), slot_id, __ATOMIC_RELAXED);
    __atomic_store_n(U64_AT(f, OFF_TRAILER + 24), gen, __ATOMIC_RELAXED);
    __atomic_store_n(U64_AT(f, OFF_TRAILER + 32), did, __ATOMIC_RELAXED);
    __atomic_store_n(I32_AT(f, OFF_STATE), STATE_TASK_READY, __ATOMIC_SEQ_CST);
    (void)wake_child_impl((char *)ln->view.buf);
    ln->slot = Py_NewRef(item);
    ln->did = did;
    *ln->nextp = did + 1;
    ln->run_id = run_id;
    ln->slot_id = slot_id;
    ln->gen = gen;
    ln->at = monotonic_ns();
    rc = 1;
out:
    Py_XDECREF(popped);
    Py_XDECREF(state);
    Py_XDECREF(gsize);
    Py_XDECREF(blobs);
    Py_XDECREF(config);
    Py_XDECREF(digest);
    Py_DECREF(item);
    return rc;
}

/* Spin until a frame in flight (slot set, no stop) ends (leaves TASK_READY and
 * TASK_LAUNCHED) or `deadline`
 * (monotonic ns) passes, with the GIL released and a sched_yield every 64 polls. Only
 * the frames' shared memory is read: the lanes' buffer views stay held by the caller. */
static void
pump_wait_unlocked(pump_lane *ln, Py_ssize_t nl, int64_t deadline)
{
    Py_BEGIN_ALLOW_THREADS
    for (uint64_t it = 1;; it++) {
        int moved = 0;
        for (Py_ssize_t i = 0; i < nl; i++) {
            if (ln[i].slot != NULL && !ln[i].stop) {
                int32_t st = __atomic_load_n(I32_AT(ln[i].f, OFF_STATE), __ATOMIC_ACQUIRE);
                if (st != STATE_TASK_READY && st != STATE_TASK_LAUNCHED) {
                    moved = 1;
                    break;
                }
            }
        }
        if (moved) {
            break;
        }
        cpu_relax();
        if ((it & 63) == 0) {
            if (monotonic_ns() >= deadline) {
                break;
            }
            sched_yield();
        }
    }
    Py_END_ALLOW_THREADS
}

PyObject *
mb_sub_pump(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7 && !mb_check_nargs("sub_pump", nargs, 6)) {
        return NULL;
    }
    PyObject *lanes = args[0], *queue = args[1], *ready = args[2], *published = args[3];
    Py_ssize_t spin_ns, max_publish;
    if (!PyList_CheckExact(lanes) || !PyList_CheckExact(published)) {
        PyErr_SetString(PyExc_TypeError, "sub_pump: lanes and published must be lists");
        return NULL;
    }
    if (!mb_conv_count(args[4], &spin_ns) || !mb_conv_count(args[5], &max_publish)) {
        return NULL;
    }
    /* queue_frames 0: publish only into free children (a lane the caller left out may
     * be free for the next task, so none is queued behind a busy one). */
    int queue_frames = 1;
    if (nargs == 7 && (queue_frames = PyObject_IsTrue(args[6])) < 0) {
        return NULL;
    }
    Py_ssize_t nl = PyList_GET_SIZE(lanes);
    if (nl > SUBPUMP_MAX_LANES) {
        PyErr_Format(PyExc_ValueError, "sub_pump: %zd lanes, at most %d", nl, SUBPUMP_MAX_LANES);
        return NULL;
    }
    pump_lane *ln = PyMem_Calloc((size_t)(nl > 0 ? nl : 1), sizeof(pump_lane));
    if (ln == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t count = 0, loaded = 0;
    int failed = 0;
    /* Load every lane; a malformed one fails the call before anything is touched. */
    for (; loaded < nl; loaded++) {
        if (PyList_GET_SIZE(lanes) != nl) {
            PyErr_SetString(PyExc_RuntimeError, "sub_pump: the lanes changed during the call");
            failed = 1;
            break;
        }
        PyObject *lane = PyList_GET_ITEM(lanes, loaded);
        pump_lane *l = &ln[loaded];
        Py_ssize_t off;
        uint64_t v, stop;
        if (!PyList_CheckExact(lane) || PyList_GET_SIZE(lane) != SUBPUMP_FIELDS) {
            PyErr_Format(PyExc_TypeError, "sub_pump: lane %zd must be a list of %d items",
                         loaded, SUBPUMP_FIELDS);
            failed = 1;
            break;
        }
        l->lane = Py_NewRef(lane);
        PyObject *buf = lane_item(lane, SUBPUMP_BUF);
        if (buf == NULL || get_buf(buf, &l->view) < 0) {
            failed = 1;
            break;
        }
        l->have_view = 1;
        PyObject *off_obj = lane_item(lane, SUBPUMP_OFF);
        if (off_obj == NULL || !mb_conv_off(off_obj, &off) ||
            (l->f = frame_ptr(&l->view, off)) == NULL || off == 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "sub_pump: the base frame carries no task");
            }
            failed = 1;
            break;
        }
        if (!lane_int(lane, SUBPUMP_DID, &l->did) || !lane_int(lane, SUBPUMP_NEXT, &l->next) ||
            !lane_int(lane, SUBPUMP_AT, &v) || !lane_int(lane, SUBPUMP_STOP, &stop)) {
            failed = 1;
            break;
        }
        l->at = (int64_t)v;
        l->stop = stop > 2 ? 2 : (long)stop;
        PyObject *peer = lane_item(lane, SUBPUMP_PEER);
        if (peer == NULL) {
            failed = 1;
            break;
        }
        l->peer = PyLong_AsSsize_t(peer);
        if (l->peer == -1 && PyErr_Occurred()) {
            failed = 1;
            break;
        }
        l->nextp = &l->next;
        PyObject *done = lane_item(lane, SUBPUMP_DONE);
        PyObject *slot = lane_item(lane, SUBPUMP_SLOT);
        if (done == NULL || slot == NULL) {
            failed = 1;
            break;
        }
        l->done = Py_NewRef(done);
        if (!PyList_CheckExact(l->done)) {
            PyErr_Format(PyExc_TypeError, "sub_pump: lane %zd: done must be a list", loaded);
            failed = 1;
            break;
        }
        if (slot != Py_None) {
            l->slot = Py_NewRef(slot); /* before any attribute read can run code */
            if (!slot_identity(l->slot, l)) {
                failed = 1;
                break;
            }
        }
    }
    /* The run whose queue this is: its head's. A task in flight at entry of any other run
     * is marked: its completion may finish that run or make its next task ready, so the
     * Scheduler must see it before this call goes on publishing the queue's tasks (on a
     * loaded machine a wait's yield can outlast a whole task, so every pass would
     * progress and the call would run to max_publish). With an empty queue nothing is
     * published: the call ends with the tasks in flight, as before. */
    if (!failed) {
        int have_qrun = 0;
        uint64_t qrun = 0;
        Py_ssize_t qlen = PyObject_Length(queue);
        if (qlen < 0) {
            failed = 1;
        }
        else if (qlen > 0) {
            PyObject *head = PySequence_GetItem(queue, 0);
            if (head == NULL || !attr_u64(head, str_run_id, &qrun)) {
                failed = 1;
            }
            have_qrun = !failed;
            Py_XDECREF(head);
        }
        for (Py_ssize_t i = 0; i < loaded && !failed; i++) {
            ln[i].other = have_qrun && ln[i].slot != NULL && ln[i].run_id != qrun;
        }
    }
    /* Pair the frames of each child: both ends must name each other. */
    for (Py_ssize_t i = 0; i < loaded && !failed; i++) {
        Py_ssize_t p = ln[i].peer;
        if (p == -1) {
            continue;
        }
        if (p < 0 || p >= loaded || p == i || ln[p].peer != i || ln[p].view.buf != ln[i].view.buf) {
            PyErr_Format(PyExc_ValueError,
                         "sub_pump: lane %zd names peer %zd, which is not the other frame of "
                         "its child",
                         i, p);
            failed = 1;
            break;
        }
        if (p < i) {
            ln[i].nextp = &ln[p].next;
        }
    }
    if (!failed) {
        int queue_open = 1, unusual = 0;
        int64_t last = monotonic_ns();
        for (;;) {
            int progress = 0, inflight = 0, other_done = 0;
            for (Py_ssize_t i = 0; i < nl; i++) {
                pump_lane *l = &ln[i];
                if (l->stop || l->slot == NULL) {
                    continue;
                }
                int r = pump_poll(l);
                if (r == -2) {
                    failed = 1;
                    break;
                }
                if (r < 0) {
                    /* Leave it to the Python path at once, and publish nothing more:
                     * a failure must be seen before later tasks start (the first
                     * failure fails the run; the tasks after it are skipped). */
                    unusual = 1;
                    queue_open = 0;
                }
                else if (r == 1) {
                    progress = 1;
                    other_done |= l->other;
                    l->other = 0;
                }
            }
            /* Free children first (round 0: the frame and its peer IDLE), then the
             * queue frames of busy ones (round 1). */
            for (int round = 0; round < 1 + queue_frames && !failed; round++) {
                for (Py_ssize_t i = 0; i < nl && queue_open && count < max_publish; i++) {
                    pump_lane *l = &ln[i];
                    if (l->stop || l->slot != NULL) {
                        continue;
                    }
                    pump_lane *peer = l->peer >= 0 ? &ln[l->peer] : NULL;
                    if (peer != NULL && (peer->stop || (peer->slot != NULL) != round)) {
                        continue;
                    }
                    if (peer == NULL && round == 1) {
                        continue;
                    }
                    int r = pump_publish(l, round ? peer : NULL, queue, ready, published);
                    if (r == -2) {
                        failed = 1;
                        break;
                    }
                    if (r == 0) {
                        queue_open = 0;
                    }
                    else if (r == 1) {
                        count++;
                        progress = 1;
                    }
                }
            }
            for (Py_ssize_t i = 0; i < nl; i++) {
                inflight += ln[i].slot != NULL && !ln[i].stop;
            }
            if (failed || unusual || other_done || !inflight || spin_ns == 0) {
                break; /* spin_ns 0: one pass, never a completion of what it published */
            }
            int64_t now = monotonic_ns();
            if (progress) {
                last = now;
            }
            else if (now - last > (int64_t)spin_ns) {
                break;
            }
            else {
                /* A pass without progress: every lane that can run is busy (an idle
                 * one would have published, or closed the queue), so only a completion
                 * can move this call on. Wait for one without the GIL (no Python object
                 * is touched) and with a yield every few polls, so that a child woken
                 * onto this core runs at once; the next pass completes it. */
                pump_wait_unlocked(ln, nl, last + (int64_t)spin_ns);
            }
        }
    }
    /* Write back every loaded lane (also after an error: what is in flight must show). */
    PyObject *exc_type = NULL, *exc_value = NULL, *exc_tb = NULL;
    if (failed) {
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    }
    int wb_failed = 0;
    for (Py_ssize_t i = 0; i < loaded; i++) {
        if (PyList_GET_SIZE(ln[i].lane) != SUBPUMP_FIELDS) {
            PyErr_SetString(PyExc_RuntimeError, "sub_pump: a lane changed size during the call");
            wb_failed = 1;
        }
        else if (pump_writeback(ln[i].lane, &ln[i]) < 0) {
            wb_failed = 1;
        }
    }
    for (Py_ssize_t i = 0; i < nl; i++) {
        Py_XDECREF(ln[i].slot);
        Py_XDECREF(ln[i].lane);
        Py_XDECREF(ln[i].done);
        if (ln[i].have_view) {
            PyBuffer_Release(&ln[i].view);
        }
    }
    PyMem_Free(ln);
    if (failed) {
        if (wb_failed) {
            PyErr_Clear();
        }
        PyErr_Restore(exc_type, exc_value, exc_tb);
        return NULL;
    }
    if (wb_failed) {
        return NULL;
    }
    return PyLong_FromSsize_t(count);
}


int
mb_pump_init(void)
{
    static const struct {
        PyObject **ref;
        const char *name;
    } names[] = {
        {&str_state, "state"},
        {&str_group_size, "group_size"},
        {&str_blobs, "blobs"},
        {&str_config_bytes, "config_bytes"},
        {&str_digest, "digest"},
        {&str_run_id, "run_id"},
        {&str_slot_id, "slot_id"},
        {&str_lease_slot, "lease_slot"},
        {&str_lease_generation, "lease_generation"},
        {&str_popleft, "popleft"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].ref == NULL) {
            /* Interned names live as long as the process (one per name, never freed). */
            *names[i].ref = PyUnicode_InternFromString(names[i].name);
            if (*names[i].ref == NULL) {
                return -1;
            }
        }
    }
    return 0;
}
